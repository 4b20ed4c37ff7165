"""verl's LR schedule in the floe plugin (floe.integrations.verl.schedule), step by step against
verl 0.9.1's own engine: the scheduler `FSDPEngine._build_lr_scheduler` builds from the same
`FSDPOptimizerConfig`, stepped once per training step as `engine_workers.update_actor` steps
it. Also the plugin's resume: `at(k)` continues exactly where k steps left the schedule.
Runs in verl's environment (scripts/ci/verl.sh, marker `verl`).
"""

from __future__ import annotations

from dataclasses import asdict

import pytest

from floe.errors import InvalidInput
from tests.integrations.verl.run import verl_engine_rates

pytestmark = pytest.mark.verl

TOTAL = 12
CASES = [
    {"lr_scheduler_type": "constant"},
    {"lr_scheduler_type": "constant", "lr_warmup_steps": 4},
    {"lr_scheduler_type": "constant", "lr_warmup_steps_ratio": 0.25},
    {"lr_scheduler_type": "cosine", "lr_warmup_steps": 3},
    {"lr_scheduler_type": "cosine", "lr_warmup_steps": 2, "min_lr_ratio": 0.1, "num_cycles": 0.4},
    {"lr_scheduler_type": "cosine", "lr_warmup_steps_ratio": 0.2, "zero_indexed_step": False},
    {"warmup_style": "cosine", "lr_warmup_steps": 1},
]


@pytest.mark.parametrize("optim", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_plugin_schedule_matches_verls_engine_at_every_step_and_resumes(optim: dict) -> None:
    from verl.workers.config import FSDPOptimizerConfig  # noqa: PLC0415

    from floe.integrations.verl.schedule import VerlSchedule  # noqa: PLC0415 - imports verl

    resolved = asdict(FSDPOptimizerConfig(lr=2e-3, total_training_steps=TOTAL, **optim))  # what the plugin reads
    schedule = VerlSchedule(resolved)
    got = []
    for _ in range(TOTAL):
        got.append(schedule.lr)
        schedule.step()
    want = verl_engine_rates({"lr": 2e-3, **optim}, TOTAL)
    assert got == pytest.approx(want, rel=1e-12, abs=0.0)
    assert schedule.steps == TOTAL
    for k in (0, 5, TOTAL - 1):
        assert schedule.at(k).lr == pytest.approx(want[k], rel=1e-12, abs=0.0)


def test_a_schedule_without_the_runs_total_is_refused_by_name() -> None:
    from floe.integrations.verl.schedule import VerlSchedule  # noqa: PLC0415

    with pytest.raises(InvalidInput) as err:
        VerlSchedule({"lr": 1e-3, "lr_scheduler_type": "cosine", "total_training_steps": -1})
    assert err.value.field == "actor_rollout_ref.actor.optim.total_training_steps"
