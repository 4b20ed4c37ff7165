"""Registry, option validation and the Env contract shared by every family."""

from __future__ import annotations

import pytest

from floe.envs import FAMILIES, EnvFamily, make_family


def test_families_lists_every_env() -> None:
    assert FAMILIES == ("reverse_text", "math", "alphabet_sort", "text2sql")
    for name in ("reverse_text", "math", "alphabet_sort"):
        family = make_family(name)
        assert isinstance(family, EnvFamily) and family.name == name


def test_unknown_family_is_named_and_valid_ones_listed() -> None:
    with pytest.raises(ValueError) as err:
        make_family("reverse_txt")
    assert "'reverse_txt'" in str(err.value)
    for name in FAMILIES:
        assert name in str(err.value)


def test_unknown_option_is_named_and_valid_ones_listed() -> None:
    with pytest.raises(ValueError) as err:
        make_family("reverse_text", max_lenght=5)
    message = str(err.value)
    assert "'max_lenght'" in message and "reverse_text" in message
    assert "max_length" in message and "min_length" in message and "data_path" in message


@pytest.mark.parametrize(
    ("name", "options", "field"),
    [
        ("reverse_text", {"min_length": 0}, "min_length"),
        ("reverse_text", {"min_length": 9, "max_length": 3}, "min_length"),
        ("math", {"max_level": 4}, "max_level"),
        ("math", {"max_number": "many"}, "max_number"),
        ("alphabet_sort", {"sort_by": "middle"}, "sort_by"),
        ("alphabet_sort", {"similarity_power": 0}, "similarity_power"),
        ("text2sql", {"timeout_s": 0}, "timeout_s"),
        ("text2sql", {"schemas": ("zoo",)}, "schemas"),
        ("text2sql", {"data_path": "dev.json"}, "db_root"),
    ],
)
def test_invalid_option_values_name_the_field(name: str, options: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        make_family(name, **options)


@pytest.mark.parametrize(
    ("split", "count", "seed", "field"),
    [("test", 1, 0, "split"), ("train", -1, 0, "count"), ("train", 1.5, 0, "count"), ("train", 1, "0", "seed")],
)
def test_bad_task_requests_name_the_field(split: object, count: object, seed: object, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        make_family("reverse_text").tasks(split, count, seed)  # type: ignore[arg-type]


def test_text2sql_family_is_cheap_to_construct(tmp_path) -> None:
    db_dir = tmp_path / "dbs"
    family = make_family("text2sql", db_dir=str(db_dir))
    # No databases built and no worker process started until tasks are asked for / scored.
    assert not db_dir.exists()
    assert family.runner._pool is None


def test_env_is_single_use_and_reward_needs_a_finished_episode() -> None:
    family = make_family("reverse_text")
    env = family.make_env(family.tasks("train", 1, 0)[0])
    with pytest.raises(RuntimeError, match="before the episode is done"):
        env.episode_reward()
    result = env.step("no tags")
    assert result.done and result.next_messages == []
    with pytest.raises(RuntimeError, match="after the episode is done"):
        env.step("again")


def test_initial_messages_are_ascii_and_well_formed(tmp_path) -> None:
    for name in FAMILIES:
        options = {"db_dir": str(tmp_path)} if name == "text2sql" else {}
        family = make_family(name, **options)
        for task in family.tasks("train", 5, 0):
            for message in family.make_env(task).initial_messages():
                assert message["role"] in ("system", "user")
                assert message["content"].isascii() and message["content"]
