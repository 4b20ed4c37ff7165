"""floe.integrations.staleness: per-sample staleness from floe's weights versions (core suite;
the async plugins' runs check it end to end: tests/integrations/verl/test_one_step.py,
tests/integrations/skyrl/test_fully_async.py)."""

from __future__ import annotations

import json

import pytest

from floe.integrations.staleness import append_samples, staleness_stats


def test_stats_are_the_per_sample_differences():
    stats = staleness_stats(5, [5, 4, 4, 2], limit=2)
    assert stats == {"mean": 1.25, "max": 3, "min": 0, "ratio": 0.75, "violation_count": 1,
                     "weights_version_min": 2, "weights_version_max": 5}


def test_a_sample_newer_than_the_policy_is_a_bug_not_a_negative_staleness():
    with pytest.raises(RuntimeError, match="newer than the policy's 3"):
        staleness_stats(3, [3, 4], limit=1)
    with pytest.raises(ValueError, match="at least one"):
        staleness_stats(3, [], limit=1)


def test_samples_are_appended_one_line_each(tmp_path):
    path = tmp_path / "deep" / "floe_samples.jsonl"
    append_samples(path, [{"step": 1, "staleness": 0}])
    append_samples(path, ({"step": 2, "staleness": s} for s in (1, 1)))
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 1, "staleness": 0}, {"step": 2, "staleness": 1}, {"step": 2, "staleness": 1}]
