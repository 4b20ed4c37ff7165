"""alphabet_sort: per-turn power-scaled similarity, the improving-attempts rule, multi-turn flow."""

from __future__ import annotations

import difflib
import json

import pytest

from floe.envs import make_family
from floe.envs.alphabet_sort import (
    AlphabetSortEnv,
    expected_lines,
    normalise,
    turn_reward,
)

TURNS = [["CarlaZhang", "AdaWeber"], ["BenAbbott"], ["DanaXu", "AlanYilmaz"]]


def _reply(tag: str, lines: list[str]) -> str:
    body = "\n".join(lines)
    return f"<{tag}>\n{body}\n</{tag}>"


def test_expected_lists_mark_new_names_after_the_first_turn() -> None:
    assert expected_lines(TURNS, 0, "first") == ["AdaWeber", "CarlaZhang"]
    assert expected_lines(TURNS, 1, "first") == ["AdaWeber", "BenAbbott // new name!", "CarlaZhang"]
    assert expected_lines(TURNS, 1, "last") == ["BenAbbott // new name!", "AdaWeber", "CarlaZhang"]


def test_perfect_episode_scores_one_each_turn() -> None:
    env = AlphabetSortEnv(TURNS, "first", power=4)
    assert "CarlaZhang, AdaWeber" in env.initial_messages()[0]["content"]
    first = env.step(_reply("alphabetical_sorted", expected_lines(TURNS, 0, "first")))
    assert first.reward == 1.0 and not first.done
    (follow_up,) = first.next_messages
    assert follow_up["role"] == "user" and "BenAbbott" in follow_up["content"]
    assert "<combined_alphabetical_sorted>" in follow_up["content"] and "// new name!" in follow_up["content"]
    second = env.step(_reply("combined_alphabetical_sorted", expected_lines(TURNS, 1, "first")))
    third = env.step(_reply("combined_alphabetical_sorted", expected_lines(TURNS, 2, "first")))
    assert second.reward == 1.0 and third.reward == 1.0 and third.done and third.next_messages == []
    assert env.episode_reward() == 1.0


def test_episode_reward_is_the_mean_of_turns() -> None:
    env = AlphabetSortEnv(TURNS, "first", power=4)
    env.step(_reply("alphabetical_sorted", expected_lines(TURNS, 0, "first")))  # 1.0
    env.step("no tags at all")  # 0.0
    # Turn 3 with the turn-1 tag: the combined tag is required after turn 1.
    wrong_tag = env.step(_reply("alphabetical_sorted", expected_lines(TURNS, 2, "first")))
    assert wrong_tag.reward == 0.0
    assert env.episode_reward() == pytest.approx(1 / 3)


def test_reward_is_similarity_to_the_power() -> None:
    expected = expected_lines(TURNS, 1, "first")
    answer = ["AdaWeber", "BenAbbott", "CarlaZhang"]  # forgot the new-name mark
    ratio = difflib.SequenceMatcher(None, normalise("\n".join(answer)), normalise("\n".join(expected))).ratio()
    assert 0 < ratio < 1
    got, attempts = turn_reward(_reply("combined_alphabetical_sorted", answer), "combined_alphabetical_sorted", expected, 4)
    assert attempts == 1 and got == pytest.approx(ratio**4)
    squared, _ = turn_reward(_reply("combined_alphabetical_sorted", answer), "combined_alphabetical_sorted", expected, 2)
    assert squared == pytest.approx(ratio**2)


def test_case_and_whitespace_do_not_matter() -> None:
    expected = expected_lines(TURNS, 0, "first")
    sloppy = "<alphabetical_sorted>\n   adaweber  \n\n CARLAZHANG\n</alphabetical_sorted>"
    assert turn_reward(sloppy, "alphabetical_sorted", expected, 4) == (1.0, 1)


def test_strictly_improving_attempts_count_and_the_last_one_is_scored() -> None:
    expected = expected_lines(TURNS, 0, "first")
    worse = _reply("alphabetical_sorted", ["CarlaZhang", "AdaWeber"])
    better = _reply("alphabetical_sorted", ["AdaWeber", "CarlaZhang"])
    reward, attempts = turn_reward(f"{worse}\nWait, fixing it:\n{better}", "alphabetical_sorted", expected, 4)
    assert attempts == 2 and reward == 1.0


@pytest.mark.parametrize("order", ["worse_last", "equal"])
def test_attempts_that_do_not_improve_zero_the_turn(order: str) -> None:
    expected = expected_lines(TURNS, 0, "first")
    good = _reply("alphabetical_sorted", ["AdaWeber", "CarlaZhang"])
    bad = _reply("alphabetical_sorted", ["CarlaZhang", "AdaWeber"])
    completion = f"{good}{bad}" if order == "worse_last" else f"{good}{good}"
    assert turn_reward(completion, "alphabetical_sorted", expected, 4) == (0.0, 2)


def test_generated_episodes_have_one_to_three_turns_and_valid_names() -> None:
    family = make_family("alphabet_sort")
    tasks = family.tasks("train", 100, 0)
    assert {len(t.data["turns"]) for t in tasks} == {1, 2, 3}
    for task in tasks:
        names = [n for turn in task.data["turns"] for n in turn]
        assert len(names) == len(set(names)) and all(n.isascii() and n.isalpha() for n in names)
        assert all(1 <= len(turn) <= 5 for turn in task.data["turns"])


def test_perfect_answers_score_one_and_garbage_scores_zero() -> None:
    family = make_family("alphabet_sort", sort_by="random")
    for task in family.tasks("eval", 10, 0):
        turns, by = task.data["turns"], task.data["sort_by"]
        env, garbage = family.make_env(task), family.make_env(task)
        for turn in range(len(turns)):
            tag = "alphabetical_sorted" if turn == 0 else "combined_alphabetical_sorted"
            assert env.step(_reply(tag, expected_lines(turns, turn, by))).reward == 1.0
            garbage.step("Sure! Here you go.")
        assert env.episode_reward() == 1.0 and garbage.episode_reward() == 0.0


def test_reads_names_dataset(tmp_path) -> None:
    path = tmp_path / "authors.jsonl"
    rows = [{"names": [f"Author{chr(65 + i)} Person{chr(65 + j)}" for j in range(12)]} for i in range(20)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    family = make_family("alphabet_sort", data_path=str(path))
    for task in family.tasks("train", 5, 0):
        names = [n for turn in task.data["turns"] for n in turn]
        assert all(" " not in n for n in names)  # spaces removed, as the peer does
