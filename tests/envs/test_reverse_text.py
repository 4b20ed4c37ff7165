"""reverse_text reward against the peer definition (difflib ratio with default arguments)."""

from __future__ import annotations

import difflib
import json
import random

import pytest

from floe.envs import make_family
from floe.envs.reverse_text import extract_answer, reward


def test_no_tags_scores_zero() -> None:
    assert extract_answer("olleh") == ""
    assert reward("olleh", "olleh") == 0.0


def test_unclosed_tag_is_no_answer() -> None:
    assert reward("<reversed_text>olleh", "olleh") == 0.0


def test_first_tag_wins() -> None:
    completion = "<reversed_text>wrong</reversed_text> <reversed_text>olleh</reversed_text>"
    assert extract_answer(completion) == "wrong"
    assert reward(completion, "olleh") == difflib.SequenceMatcher(None, "wrong", "olleh").ratio()


def test_answer_is_stripped_and_multiline_allowed() -> None:
    assert reward("<reversed_text>\n  olleh \n</reversed_text>", "olleh") == 1.0
    assert extract_answer("<reversed_text>a\nb</reversed_text>") == "a\nb"


def test_empty_answer_scores_zero_against_nonempty_target() -> None:
    assert reward("<reversed_text></reversed_text>", "x") == 0.0
    assert reward("<reversed_text>   </reversed_text>", "abc") == 0.0


def test_partial_answer_gets_difflib_ratio() -> None:
    # matches "olle" of 5+4 chars: 2*4/9
    assert reward("<reversed_text>olle</reversed_text>", "olleh") == pytest.approx(8 / 9)


def test_long_strings_use_difflib_autojunk_like_the_peers() -> None:
    rng = random.Random(0)
    target = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(300))
    answer = target[150:] + target[:150]  # both halves right, in the wrong order
    with_autojunk = difflib.SequenceMatcher(None, answer, target).ratio()
    true_lcs_like = difflib.SequenceMatcher(None, answer, target, autojunk=False).ratio()
    # The case is only meaningful when autojunk changes the answer.
    assert abs(with_autojunk - true_lcs_like) > 0.1
    assert reward(f"<reversed_text>{answer}</reversed_text>", target) == with_autojunk


def test_perfect_answer_scores_one_and_garbage_scores_low() -> None:
    family = make_family("reverse_text")
    for task in family.tasks("eval", 10, 0):
        env = family.make_env(task)
        perfect = env.step(f"<reversed_text>{task.data['text'][::-1]}</reversed_text>")
        assert perfect.reward == 1.0 and perfect.done and perfect.metrics["exact"] == 1.0
        assert env.episode_reward() == 1.0
        garbage = family.make_env(task).step("I cannot do that.")
        assert garbage.reward == 0.0 and garbage.metrics["tag_found"] == 0.0


def test_prompt_shows_text_and_asks_for_tags() -> None:
    family = make_family("reverse_text")
    task = family.tasks("train", 1, 0)[0]
    system, user = family.make_env(task).initial_messages()
    assert "<reversed_text>" in system["content"] and user["content"] == task.data["text"]
    (only,) = make_family("reverse_text", system_prompt=False).make_env(task).initial_messages()
    assert only["role"] == "user" and only["content"].endswith(task.data["text"])


def test_reads_public_dataset_jsonl(tmp_path) -> None:
    path = tmp_path / "reverse.jsonl"
    rows = [{"prompt": f"sentence number {i}"} for i in range(50)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    family = make_family("reverse_text", data_path=str(path))
    train, evals = family.tasks("train", 5, 0), family.tasks("eval", 3, 0)
    assert all(t.data["target"] == t.data["text"][::-1] for t in train + evals)
    assert not {t.data["text"] for t in train} & {t.data["text"] for t in evals}
    with pytest.raises(ValueError, match="count=500"):
        family.tasks("train", 500, 0)


def test_bad_data_files_name_the_problem(tmp_path) -> None:
    missing_column = tmp_path / "bad.jsonl"
    missing_column.write_text(json.dumps({"text": "abc"}) + "\n")
    with pytest.raises(ValueError, match="data_path.*prompt"):
        make_family("reverse_text", data_path=str(missing_column)).tasks("train", 1, 0)
    with pytest.raises(ValueError, match="no such file"):
        make_family("reverse_text", data_path=str(tmp_path / "nope.jsonl")).tasks("train", 1, 0)
    parquet = tmp_path / "rows.parquet"
    parquet.write_bytes(b"PAR1")
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="pyarrow"):
            make_family("reverse_text", data_path=str(parquet)).tasks("train", 1, 0)
