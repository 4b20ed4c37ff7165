"""SkyRL's LR schedule on floe, step by step: FloeDispatch (the plugin's SkyRL WorkerDispatch)
on a real embedded floe backend and SkyRL's real config classes. Each optimizer step must run
at the rate SkyRL's own scheduler gives it (transformers.get_scheduler, as SkyRL's FSDP
strategy builds and steps it), floe's backend must apply that rate, and a checkpoint resume
must continue the schedule where the saved step left it.
Runs only in the SkyRL environment (scripts/ci/skyrl.sh, marker `skyrl`).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

import floe
from floe.models import make_tiny
from tests.integrations.skyrl.assets import skyrl_rates

pytestmark = pytest.mark.skyrl

LR, WARMUP, TOTAL = 2e-3, 3, 8


@pytest.mark.parametrize("scheduler", ["cosine", "linear", "constant_with_warmup", "polynomial"])
def test_each_optimizer_step_runs_at_skyrls_rate_and_resume_continues(tmp_path: Path, scheduler: str) -> None:
    from skyrl.train.config import SkyRLTrainConfig  # noqa: PLC0415 - SkyRL only exists in its own environment

    from floe.integrations.skyrl.dispatch import FloeDispatch  # noqa: PLC0415 - imports SkyRL
    from floe.integrations.skyrl.inference import FloeInferenceClient  # noqa: PLC0415
    from floe.integrations.skyrl.mapping import map_loss  # noqa: PLC0415

    cfg = SkyRLTrainConfig.from_cli_overrides([
        f"trainer.policy.optimizer_config.lr={LR}", f"trainer.policy.optimizer_config.num_warmup_steps={WARMUP}",
        f"trainer.policy.optimizer_config.scheduler={scheduler}",
    ])
    model = make_tiny(tmp_path / "tiny", hidden_size=32, num_hidden_layers=1)
    client = floe.connect(floe.BackendConfig(model=str(model), state_dir=str(tmp_path / "states")))
    calls: Counter[str] = Counter()
    trainer = SimpleNamespace(all_metrics={}, global_step=0)  # the two fields of SkyRL's trainer the dispatch writes
    inference = FloeInferenceClient(client, client.tokenizer(), str(model), calls)
    loss = map_loss({"policy_loss_type": "regular", "loss_reduction": "token_mean", "temperature": 1.0})
    dispatch = FloeDispatch(cfg, client, loss, calls, inference, trainer, TOTAL)  # type: ignore[arg-type]
    batch = floe.Batch([floe.Group([5, 6, 7], [floe.Sample([8, 9, 10])])])

    def step() -> float:
        client.forward_backward(batch, "cross_entropy")
        dispatch.optim_step("policy")
        return trainer.all_metrics["policy/policy_lr"]  # the rate floe's optim_step reports it applied

    want = skyrl_rates(scheduler, lr=LR, warmup=WARMUP, total=TOTAL)
    first = [step() for _ in range(5)]
    assert first == pytest.approx(want[:5], rel=1e-12, abs=0.0)
    dispatch.save_checkpoint("policy", str(tmp_path / "global_step_5" / "policy"))
    after_save = [step() for _ in range(3)]
    dispatch.load_checkpoint("policy", str(tmp_path / "global_step_5" / "policy"))
    assert client.info().step == 5
    resumed = [step() for _ in range(3)]
    assert after_save == resumed == pytest.approx(want[5:], rel=1e-12, abs=0.0)
    assert want[0] == 0.0 and max(want) == LR  # the warm-up starts at 0 and reaches lr
    client.close()
