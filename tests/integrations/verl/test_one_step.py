"""verl's one-step off-policy trainer on floe: verl's own entrypoint
(`python -m verl.experimental.one_step_off_policy.main_ppo`, its one_step_off_ppo_trainer.yaml)
with the keys of its stock example (stock_recipes.ONE_STEP) through the one-key switch, 4 steps
on the tiny model on this CPU machine. The batch of step k+1 is generated while step k trains;
each sample's floe weights version gives its staleness, logged by verl per step
(`floe/staleness/*`) and per sample (floe_samples.jsonl). Runs in verl's environment
(scripts/ci/verl.sh)."""

from __future__ import annotations

import json
import math
import re
import statistics
from collections import defaultdict
from pathlib import Path

import pytest

from tests.integrations.verl.assets import make_data, make_model
from tests.integrations.verl.run import VLLM_RECIPE_SWITCH, grpo_recipe, run_main_ppo
from tests.integrations.verl.stock_recipes import ONE_STEP, cpu_sized

pytestmark = [pytest.mark.verl, pytest.mark.timeout(900)]

ENTRYPOINT = "verl.experimental.one_step_off_policy.main_ppo"
STEPS = 4
STEP_LINE = re.compile(r"\bstep:(\d+) - ")  # verl's console logger, one line per step


def verl_root() -> Path:
    """The folder holding the `verl` package: verl's experimental configs name their base config
    as `file://verl/trainer/config`, relative to where they run (verl's scripts run from its root)."""
    import verl  # noqa: PLC0415 - verl's environment

    return Path(verl.__file__).parent.parent


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory, shared_ray: str) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("verl-one-step")
    train, test = make_data(root / "data")
    return {"root": root, "model": make_model(root / "tiny"), "train": train, "test": test}


def samples_by_step(path: Path) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = defaultdict(list)
    for line in path.read_text().splitlines():
        record = json.loads(line)
        out[record["step"]].append(record)
    return dict(out)


def test_verls_one_step_off_policy_trainer_runs_on_floe_with_staleness_per_sample(assets):
    out = assets["root"] / "run"
    args = cpu_sized(ONE_STEP, grpo_recipe(assets["model"], assets["train"], assets["test"], out, steps=STEPS))
    run = run_main_ppo(args, assets["root"] / "one_step.log", timeout_s=700, switch=VLLM_RECIPE_SWITCH,
                       entrypoint=ENTRYPOINT, cwd=verl_root())
    print(f"verl {ONE_STEP.source} on floe: exit {run.returncode}, {run.seconds:.0f} s")
    assert run.returncode == 0, run.log[-5000:]
    assert "floe backend at http://127.0.0.1" in run.log, run.log[-3000:]
    # the steps, logged in order
    logged = [int(m.group(1)) for m in map(STEP_LINE.search, run.log.splitlines()) if m]
    assert [s for s in logged if s > 0] == list(range(1, STEPS + 1)), logged
    samples = samples_by_step(out / "checkpoints" / "floe_samples.jsonl")
    assert sorted(samples) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        m = run.steps[step]
        assert math.isfinite(m["actor/grad_norm"]) and m["actor/grad_norm"] > 0, (step, m)
        assert "critic/score/mean" in m and "critic/rewards/mean" in m, (step, m)  # verl's reward metrics
        rows = samples[step]
        assert len(rows) == 4 * 2  # data.train_batch_size x rollout.n
        assert all(r["staleness"] == r["policy_version"] - r["weights_version"] for r in rows)
        stalenesses = [r["staleness"] for r in rows]
        # verl's metrics are the per-sample values' statistics
        assert m["floe/staleness/mean"] == pytest.approx(statistics.fmean(stalenesses)), (step, m)
        assert m["floe/staleness/max"] == max(stalenesses) and m["floe/staleness/min"] == min(stalenesses)
        assert m["floe/staleness/violation_count"] == 0 and m["floe/policy_version"] == rows[0]["policy_version"]
        assert m["floe/weights_version/min"] == min(r["weights_version"] for r in rows)
        # one-step off-policy: every batch was generated one sync before the step trains on it
        assert max(stalenesses) <= 1
        if step > 1:
            assert stalenesses == [1] * len(rows), (step, rows)
            assert m["floe/policy_version"] == run.steps[step - 1]["floe/policy_version"] + 1


def composed(entry: str, config_name: str, overrides: list[str], monkeypatch: pytest.MonkeyPatch) -> dict:
    """verl's config of `verl/experimental/<entry>/config/<config_name>.yaml` (Hydra, over
    ppo_trainer.yaml) with `overrides`, resolved."""
    from hydra import compose, initialize_config_dir  # noqa: PLC0415 - verl's environment
    from omegaconf import OmegaConf  # noqa: PLC0415

    monkeypatch.chdir(verl_root())  # the config's searchpath, file://verl/trainer/config, is relative
    config_dir = verl_root() / "verl" / "experimental" / entry / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        cfg = compose(config_name, overrides=overrides)
    out = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(out, dict)
    return out


def composed_one_step(overrides: list[str], monkeypatch: pytest.MonkeyPatch) -> dict:
    """verl's one-step config (one_step_off_ppo_trainer.yaml over ppo_trainer.yaml) with `overrides`."""
    return composed("one_step_off_policy", "one_step_off_ppo_trainer", overrides, monkeypatch)


# The stock keys but paths (the script's shell expands them), on the CPU.
STOCK = [k for k in ONE_STEP.keys if not k.startswith(("data.", "trainer.logger", "actor_rollout_ref.model.path"))]
ON_CPU = "+floe.backend.device=cpu"


@pytest.mark.parametrize(("override", "field"), [
    ("++actor_rollout_ref.rollout.checkpoint_manager_class=my.Manager", "actor_rollout_ref.rollout.checkpoint_manager_class"),
    ("actor_rollout_ref.actor.calculate_sum_pi_squared=True", "actor_rollout_ref.actor.calculate_sum_pi_squared"),
    (None, "rollout.n_gpus_per_node"),  # the stock recipe as on its GPU box (no CPU key): a separate rollout pool
])
def test_one_step_keys_floe_cannot_honour_are_refused_by_name(monkeypatch, override, field):
    import floe  # noqa: PLC0415
    from floe.integrations.verl.one_step import check_one_step  # noqa: PLC0415 - verl's environment

    check_one_step(composed_one_step([*STOCK, ON_CPU], monkeypatch))  # the stock recipe on the CPU passes
    cfg = composed_one_step([*STOCK, ON_CPU, override] if override else STOCK, monkeypatch)
    with pytest.raises(floe.InvalidInput) as info:
        check_one_step(cfg)
    assert info.value.field == field
