"""math reward against verl's gsm8k strict method, and the generated problems' correctness."""

from __future__ import annotations

import json
import re

import pytest

from floe.envs import make_family
from floe.envs.math import extract_answer, gsm8k_target, reward


@pytest.mark.parametrize(
    ("completion", "extracted"),
    [
        ("so the answer is #### 42", "42"),
        ("#### 1 then again #### 2", "2"),  # last one wins
        ("#### 1,234", "1234"),  # commas removed
        ("#### -7", "-7"),
        ("#### 3.5", "3.5"),
        ("#### 5.", "5."),  # the regex keeps a trailing dot, so this does not equal "5"
        ("#### $18", None),  # verl's regex needs a digit/sign/dot/comma right after "#### "
        ("####42", None),  # the space is required
        ("the answer is 42", None),
        ("", None),
    ],
)
def test_strict_extraction(completion: str, extracted: str | None) -> None:
    assert extract_answer(completion) == extracted


def test_only_the_last_300_characters_are_read() -> None:
    answer = "#### 9"
    assert extract_answer(answer + "x" * 294) == "9"  # ends exactly at the window's start
    assert extract_answer(answer + "x" * 295) is None  # clipped away, as verl does
    assert extract_answer("#### 1 " + "x" * 400 + " #### 2") == "2"


def test_reward_is_exact_string_match() -> None:
    assert reward("Work... #### 1,000", "1000") == 1.0
    assert reward("#### 1000.0", "1000") == 0.0
    assert reward("#### 12 #### 13", "12") == 0.0
    assert reward("#### -3", "-3") == 1.0
    assert reward("no answer", "3") == 0.0


def test_gsm8k_target_extraction() -> None:
    assert gsm8k_target("Natalia sold 48/2 = 24 clips.\n#### 72") == "72"
    assert gsm8k_target("so\n#### 1,080") == "1080"
    assert gsm8k_target("no final answer") is None


def test_level1_problems_are_small_single_step_and_correct() -> None:
    family = make_family("math", min_level=1, max_level=1, max_number=9)
    for task in family.tasks("train", 200, 0):
        a, b = (int(n) for n in re.findall(r"\d+", task.data["question"]))
        assert a <= 9 and b <= 9
        expected = a + b if "more" in task.data["question"] else a - b
        assert task.data["target"] == str(expected) and expected >= 0
        assert task.data["question"].isascii() and len(task.data["question"]) < 90


def test_higher_levels_have_more_steps() -> None:
    tasks = make_family("math", min_level=3, max_level=3).tasks("train", 50, 0)
    assert all(len(re.findall(r"\d+", t.data["question"])) >= 3 for t in tasks)
    assert all(int(t.data["target"]) >= 0 for t in tasks)


def test_perfect_answer_scores_one_and_garbage_scores_zero() -> None:
    family = make_family("math")
    for task in family.tasks("eval", 20, 1):
        perfect = family.make_env(task).step(f"Let me add it up.\n#### {task.data['target']}")
        assert perfect.reward == 1.0 and perfect.metrics["format_ok"] == 1.0
        garbage = family.make_env(task).step("banana")
        assert garbage.reward == 0.0 and garbage.metrics["format_ok"] == 0.0


def test_reads_gsm8k_jsonl(tmp_path) -> None:
    path = tmp_path / "train.jsonl"
    rows = [{"question": f"What is {i} + 1000?", "answer": f"{i} + 1000 = {i + 1000}\n#### {i + 1000:,}"} for i in range(30)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    family = make_family("math", data_path=str(path))
    tasks = family.tasks("train", 10, 0)
    for task in tasks:
        i = int(re.search(r"What is (\d+)", task.data["question"]).group(1))
        assert task.data["target"] == str(i + 1000)
        assert family.make_env(task).step(f"#### {i + 1000:,}").reward == 1.0


def test_separate_eval_file_is_used_for_eval(tmp_path) -> None:
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text(json.dumps({"question": "q train", "answer": "#### 1"}))
    test.write_text(json.dumps({"question": "q test", "answer": "#### 2"}))
    family = make_family("math", data_path=str(train), eval_data_path=str(test))
    assert [t.data["question"] for t in family.tasks("eval", 1, 0)] == ["q test"]


def test_gsm8k_row_without_final_answer_is_an_error(tmp_path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "no marker"}))
    with pytest.raises(ValueError, match="data_path: row 0"):
        make_family("math", data_path=str(path)).tasks("train", 1, 0)
