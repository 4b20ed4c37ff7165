"""Generated data: same seed -> same tasks, and eval never repeats a train task."""

from __future__ import annotations

import json

import pytest

from floe.envs import make_family

GENERATED = {
    "reverse_text": {},
    "math": {},
    "alphabet_sort": {},
    "text2sql": None,  # db_dir filled in per test
}


def _family(name: str, tmp_path):
    options = {"db_dir": str(tmp_path)} if name == "text2sql" else {}
    return make_family(name, **options)


def _content(task) -> str:
    data = dict(task.data)
    data.pop("db_path", None)  # the file location is not the problem
    return json.dumps(data, sort_keys=True)


@pytest.mark.parametrize("name", list(GENERATED))
def test_same_seed_same_tasks(name: str, tmp_path) -> None:
    first = _family(name, tmp_path).tasks("train", 40, seed=3)
    again = _family(name, tmp_path).tasks("train", 40, seed=3)
    other = _family(name, tmp_path).tasks("train", 40, seed=4)
    assert first == again
    assert [_content(t) for t in first] != [_content(t) for t in other]
    assert len({t.id for t in first}) == 40


@pytest.mark.parametrize("name", list(GENERATED))
def test_eval_is_disjoint_from_train_across_seeds(name: str, tmp_path) -> None:
    family = _family(name, tmp_path)
    train = {_content(t) for seed in (0, 1) for t in family.tasks("train", 150, seed)}
    evals = {_content(t) for seed in (0, 7) for t in family.tasks("eval", 40, seed)}
    assert evals and train
    assert not train & evals


def test_reverse_text_length_knob() -> None:
    tasks = make_family("reverse_text", min_length=3, max_length=4).tasks("train", 200, 0)
    lengths = {len(t.data["text"]) for t in tasks}
    assert lengths == {3, 4}
    assert all(t.data["text"].isalpha() and t.data["text"].islower() for t in tasks)
    assert all(t.data["target"] == t.data["text"][::-1] for t in tasks)


def test_small_problem_spaces_still_fill_both_splits() -> None:
    # 26 one-letter problems: about a fifth hash into eval; requests larger than the space repeat.
    family = make_family("reverse_text", min_length=1, max_length=1)
    train = {t.data["text"] for t in family.tasks("train", 60, 0)}
    evals = {t.data["text"] for t in family.tasks("eval", 30, 0)}
    assert evals and train and not train & evals
    assert len(train | evals) <= 26
