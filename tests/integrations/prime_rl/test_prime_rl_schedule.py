"""prime-rl's own code next to `floe prime-trainer` (marker prime_rl, scripts/ci/prime-rl.sh): prime-rl's
config classes parse the stock reverse-text recipe with floe's overlay and agree with what floe's trainer
reads; floe's defaults and refusals are prime-rl's; and every step's learning rate that floe applied is the
one prime-rl's scheduler gives its own optimizer (rel 1e-12), also after a restored state."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib
import torch

from floe.config import load_layers
from floe.errors import InvalidInput
from floe.integrations.prime_rl.config import parse_config
from floe.integrations.prime_rl.optim import ADAMW_DEFAULTS, SCHEDULER_DEFAULTS, parse_scheduler
from floe.integrations.prime_rl.schedule import PrimeRlSchedule, prime_rl_scheduler_module
from floe.integrations.prime_rl.trainer import run
from tests.integrations.prime_rl.orchestrator import serve_steps
from tests.integrations.prime_rl.test_trainer import PRIME_ADAMW, rl_toml

pytestmark = [pytest.mark.prime_rl, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[3]


def prime_rl_root() -> Path:
    """The unpacked prime-rl checkout the installed `prime_rl` package comes from (editable install)."""
    module = prime_rl_scheduler_module()
    assert module is not None and module.__file__ is not None
    return Path(module.__file__).resolve().parents[3]  # src/prime_rl/trainer/scheduler.py


def prime_rl_rates(trainer_config, steps: int) -> list[float]:
    """The rate of each of prime-rl's first `steps` training steps, as its train loop has them: its
    scheduler over a real AdamW, `param_groups[0]["lr"]` at `optimizer.step()`, then `scheduler.step()`."""
    module = prime_rl_scheduler_module()  # prime-rl's scheduler.py (without `dion`: see schedule.py)
    assert module is not None
    setup_scheduler = module.setup_scheduler
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=trainer_config.optim.lr)
    scheduler = setup_scheduler(optimizer, trainer_config.scheduler, trainer_config.max_steps, trainer_config.optim.lr)
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def trainer_config(optim: dict, scheduler: dict, max_steps: int):
    from prime_rl.configs.trainer import TrainerConfig

    return TrainerConfig.model_validate({"optim": optim, "scheduler": scheduler, "max_steps": max_steps})


def overlay_without_floe_table(tmp_path: Path) -> Path:
    """recipes/prime_rl/floe.toml less its [floe] table (floe's keys; prime-rl's classes forbid extra keys)."""
    import tomli_w

    data = tomllib.loads((ROOT / "recipes/prime_rl/floe.toml").read_text())
    data.pop("floe")
    path = tmp_path / "overlay.toml"
    path.write_bytes(tomli_w.dumps(data).encode())
    return path


def test_floe_defaults_are_prime_rls() -> None:
    from prime_rl.configs.trainer import AdamWConfig, SchedulerConfig, validate_scheduler
    from pydantic import TypeAdapter

    assert AdamWConfig().model_dump() == {"type": "adamw", **ADAMW_DEFAULTS}
    for kind, defaults in SCHEDULER_DEFAULTS.items():
        assert TypeAdapter(SchedulerConfig).validate_python({"type": kind}).model_dump() == {"type": kind, **defaults}
    # floe refuses exactly where prime-rl's validate_scheduler does
    cases = [({"type": "linear", "warmup_steps": 0, "decay_steps": 0}, 10), ({"type": "linear", "warmup_steps": 6, "decay_steps": 5}, 10),
             ({"type": "linear", "warmup_steps": 5, "decay_steps": 5}, 10), ({"type": "cosine", "warmup_steps": 10}, 10),
             ({"type": "cosine", "warmup_steps": 9}, 10), ({"type": "linear", "warmup_steps": 3, "decay_steps": 0}, 2)]
    for table, max_steps in cases:
        try:
            validate_scheduler(TypeAdapter(SchedulerConfig).validate_python(table), max_steps)
            prime_ok = True
        except ValueError:
            prime_ok = False
        try:
            parse_scheduler({"scheduler": table}, max_steps, 1e-6)
            floe_ok = True
        except InvalidInput:
            floe_ok = False
        assert floe_ok == prime_ok, (table, max_steps)


def test_reverse_text_recipe_with_the_overlay(tmp_path: Path) -> None:
    from prime_rl.configs.rl import RLConfig
    from pydantic_config import cli

    recipe = prime_rl_root() / "examples/basic/reverse-text/rl.toml"
    variants = [[], ["--trainer.scheduler.type", "cosine", "--trainer.scheduler.warmup-steps", "5",
                     "--trainer.scheduler.min-lr", "1e-7", "--trainer.optim.weight-decay", "0.0"]]
    for flags in variants:
        prime = cli(RLConfig, args=["@", str(recipe), "@", str(overlay_without_floe_table(tmp_path)), *flags])
        overrides = {flags[i][2:].replace("-", "_"): flags[i + 1] for i in range(0, len(flags), 2)}
        from floe.config import parse_override_value

        ours = parse_config(load_layers([recipe, ROOT / "recipes/prime_rl/floe.toml"],
                                        {k: parse_override_value(v) for k, v in overrides.items()}))
        assert ours.max_steps == prime.trainer.max_steps == 20
        assert ours.optim.as_prime_rl() == prime.trainer.optim.model_dump()
        assert ours.scheduler.as_prime_rl() == prime.trainer.scheduler.model_dump()
        assert "trainer.optim" not in " ".join(ours.ignored_trainer_keys)


VARIANTS = [  # (trainer.optim, trainer.scheduler, max_steps): the stock reverse-text keys first
    ({"lr": 3e-6}, {}, 20),
    ({"lr": 3e-6}, {"type": "linear", "warmup_steps": 4, "decay_steps": 6}, 20),
    ({"lr": 3e-6}, {"type": "linear", "warmup_steps": 5, "decay_steps": 0, "min_lr": 3e-7}, 20),
    ({"lr": 3e-6}, {"type": "linear", "warmup_steps": 0, "decay_steps": 8, "min_lr": 1e-7}, 20),
    ({"lr": 3e-6}, {"type": "cosine", "warmup_steps": 5}, 20),
    ({"lr": 1e-5}, {"type": "cosine", "warmup_steps": 3, "min_lr": 1e-6}, 12),
    ({"lr": 1e-5}, {"type": "cosine", "warmup_steps": 0, "min_lr": 1e-7}, 12),
]


@pytest.mark.parametrize(("optim", "scheduler", "max_steps"), VARIANTS)
def test_schedule_is_prime_rls(optim: dict, scheduler: dict, max_steps: int) -> None:
    cfg = parse_config(rl_toml(Path("/tmp"), max_steps=max_steps,
                               trainer={"optim": optim,
                                        "scheduler": scheduler}))
    expected = prime_rl_rates(trainer_config(optim, scheduler, max_steps), max_steps + 3)
    schedule = PrimeRlSchedule(cfg.optim, cfg.scheduler, cfg.max_steps)
    assert schedule.source == "prime-rl"
    got = []
    for step in range(1, max_steps + 4):
        got.append(schedule.lr)
        schedule.advance_to(step)
    assert got == pytest.approx(expected, rel=1e-12, abs=0)
    assert len(set(got)) > 1 or cfg.scheduler.type == "constant"
    for start in (1, max_steps // 2, max_steps):  # a restored optimizer step continues the schedule there
        assert PrimeRlSchedule(cfg.optim, cfg.scheduler, cfg.max_steps, steps=start).lr == pytest.approx(expected[start], rel=1e-12)


def test_trainer_applies_prime_rls_rates_and_resumes(make_client, tmp_path: Path) -> None:
    optim, scheduler, steps = {"lr": 1e-3}, {"type": "cosine", "warmup_steps": 2, "min_lr": 1e-5}, 5
    expected = prime_rl_rates(trainer_config(optim, scheduler, steps), 2 * steps)
    data = rl_toml(tmp_path, max_steps=steps,
                   trainer={"optim": optim, "scheduler": scheduler})
    cfg = parse_config(data)
    client = make_client(seed=0, optimizer=PRIME_ADAMW)
    errors: list[BaseException] = []
    thread = serve_steps(cfg.run_dir, client.fork(), steps, errors)
    lines: list[str] = []
    reports = run(cfg, client, log=lines.append)
    thread.join(60)
    assert not errors, errors
    assert "computed by prime-rl" in lines[0] and "from optimizer step 0" in lines[0]
    assert [r.lr for r in reports] == pytest.approx(expected[:steps], rel=1e-12, abs=0)  # the rates floe's optimizer ran at
    assert [r.next_lr for r in reports] == pytest.approx(expected[1:steps + 1], rel=1e-12, abs=0)  # prime-rl's optim/lr
    assert reports[0].lr == pytest.approx(1e-5, rel=1e-12) and reports[2].lr > 5e-4  # warm-up from min_lr
    client.save_state("after5")

    # a restored state: the next run's schedule starts at the restored optimizer step (5), so its steps
    # run at prime-rl's rates 5..9 of the same schedule (past max_steps, as prime-rl's scheduler continues)
    restored = make_client(seed=0, optimizer=PRIME_ADAMW)
    restored.load_state("after5")
    assert restored.info().step == steps
    cfg2 = parse_config({**data, "run": {"name": "run2"}})
    thread = serve_steps(cfg2.run_dir, restored.fork(), steps, errors)
    lines = []
    resumed = run(cfg2, restored, log=lines.append)
    thread.join(60)
    assert not errors, errors
    assert "from optimizer step 5" in lines[0]
    assert [r.lr for r in resumed] == pytest.approx(expected[steps:2 * steps], rel=1e-12, abs=0)
