"""Registry, option validation and the Env contract shared by every family."""

from __future__ import annotations

import pytest

import floe
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


USER_MODULE = '''
from floe.envs import EnvFamily, FamilyOptions, Score, SingleTurnEnv, Task, generate_tasks, parse_options

BUILT = []


class CountOptions(FamilyOptions):
    top: int = 9


class CountFamily(EnvFamily):
    name = "count"
    options_model = CountOptions

    def __init__(self, **options):
        BUILT.append(options)
        self.options = parse_options(CountOptions, self.name, options)

    def tasks(self, split, count, seed):
        def draw(rng):
            n = rng.randint(1, self.options.top)
            return str(n), {"n": n}
        return generate_tasks(self.name, split, count, seed, draw)

    def make_env(self, task):
        target = str(task.data["n"] + 1)
        return SingleTurnEnv([{"role": "user", "content": f"{task.data['n']} + 1"}],
                             lambda c: Score(float(c.strip() == target), {}))


class NoName(EnvFamily):
    def tasks(self, split, count, seed):
        return []

    def make_env(self, task):
        raise NotImplementedError


def not_a_family():
    return None
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user's module `user_envs` (outside floe) on sys.path."""
    (tmp_path / "user_envs.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_envs"
    import sys

    sys.modules.pop("user_envs", None)


def test_a_users_class_loads_by_module_and_class_name(user_module) -> None:
    from floe.envs import family_class

    family = make_family(f"{user_module}:CountFamily", top=3)
    assert family.name == "count" and family_class(f"{user_module}:CountFamily") is type(family)
    tasks = family.tasks("train", 4, 0)
    assert all(1 <= t.data["n"] <= 3 for t in tasks)
    env = family.make_env(tasks[0])
    assert env.step(str(tasks[0].data["n"] + 1)).reward == 1.0


def test_options_model_validates_without_building_the_family(user_module) -> None:
    import sys

    from floe.envs import options_model, validate_options

    assert options_model(f"{user_module}:CountFamily").__name__ == "CountOptions"
    assert options_model("reverse_text").__name__ == "ReverseTextOptions"
    assert validate_options(f"{user_module}:CountFamily", {"top": 5}).top == 5
    with pytest.raises(floe.InvalidInput) as err:
        validate_options(f"{user_module}:CountFamily", {"tpo": 5})
    assert err.value.field == "env.options.tpo" and "valid options: top" in err.value.message
    assert sys.modules[user_module].BUILT == []  # nothing was built


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no_such_module_xyz:Family", "cannot import module 'no_such_module_xyz'"),
        ("user_envs:Missing", "module 'user_envs' has no attribute 'Missing'"),
        ("user_envs:not_a_family", "is not an EnvFamily subclass (got function)"),
        ("user_envs:CountOptions", "is not an EnvFamily subclass (got class CountOptions)"),
        ("user_envs:NoName", "must set a class attribute `name`"),
        ("user_envs", "unknown env 'user_envs'"),
    ],
)
def test_bad_user_classes_are_named(user_module, name: str, message: str) -> None:
    with pytest.raises(floe.InvalidInput) as err:
        make_family(name)
    assert err.value.field == "env.name" and message in err.value.message


def test_import_errors_inside_the_users_module_are_reported(tmp_path, monkeypatch) -> None:
    (tmp_path / "broken_envs.py").write_text("import not_installed_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(floe.InvalidInput) as err:
        make_family("broken_envs:Family")
    assert "'broken_envs'" in err.value.message and "not_installed_dependency_xyz" in err.value.message


def test_entry_points_register_families_by_name(user_module, tmp_path, monkeypatch) -> None:
    """An installed package's `floe.envs` entry point makes its family available by name."""
    from floe.envs.registry import entry_point_names

    dist = tmp_path / "site" / "user_envs_pkg-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: user-envs-pkg\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[floe.envs]\ncount = user_envs:CountFamily\nbroken = no_such_module_xyz:Family\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert {"count", "broken"} <= set(entry_point_names())
    family = make_family("count", top=2)
    assert family.name == "count" and family.options.top == 2
    with pytest.raises(floe.InvalidInput, match="entry point 'broken'.*no_such_module_xyz"):
        make_family("broken")
    with pytest.raises(floe.InvalidInput) as err:
        make_family("counter")
    assert "broken, count" in err.value.message and "reverse_text" in err.value.message


def test_option_errors_name_the_recipe_key() -> None:
    with pytest.raises(floe.InvalidInput) as err:
        make_family("math", max_level=7)
    assert err.value.field == "env.options.max_level"
    with pytest.raises(floe.InvalidInput) as err:
        make_family("math", min_level=3, max_level=2)
    assert err.value.field == "env.options" and "min_level" in err.value.message
