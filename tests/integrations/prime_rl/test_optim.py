"""prime-rl's trainer.optim / trainer.scheduler for `floe prime-trainer` (integrations/prime_rl/optim.py,
schedule.py), the parts that need no prime-rl: defaults, refusals, the server-optimizer check (embedded
and over HTTP) and the refusal of a non-constant schedule where prime-rl is not importable.
The rates against prime-rl's own scheduler are in test_prime_rl_schedule.py (marker prime_rl)."""

from __future__ import annotations

from pathlib import Path

import pytest

from floe.errors import InvalidInput
from floe.integrations.prime_rl.config import parse_config
from floe.integrations.prime_rl.optim import PrimeOptim, PrimeScheduler, check_server_optimizer, parse_optim, parse_scheduler
from floe.integrations.prime_rl.schedule import PrimeRlSchedule, prime_rl_installed
from floe.integrations.prime_rl.trainer import run
from tests.integrations.prime_rl.test_trainer import PRIME_ADAMW, rl_toml


def test_defaults_are_prime_rls() -> None:
    assert parse_optim({}) == PrimeOptim(lr=1e-6, weight_decay=0.01, max_norm=1.0, betas1=0.9, betas2=0.999)
    assert parse_optim({"optim": {"type": "adamw", "lr": 3e-6}}).lr == 3e-6
    assert parse_scheduler({}, 20, 1e-6) == PrimeScheduler("constant", 0, 0, 0.0)
    assert parse_scheduler({"scheduler": {"type": "linear"}}, 20, 1e-6) == PrimeScheduler("linear", 10, 10, 0.0)
    assert parse_scheduler({"scheduler": {"type": "cosine", "min_lr": 1e-7}}, 20, 1e-6) == PrimeScheduler("cosine", 10, 0, 1e-7)
    with pytest.raises(InvalidInput) as e:  # a linear key on a cosine scheduler is prime-rl's extra key too
        parse_scheduler({"scheduler": {"type": "cosine", "decay_steps": 1}}, 20, 1e-6)
    assert e.value.field == "trainer.scheduler.decay_steps"
    assert PrimeOptim().serve_optimizer() == {"betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01, "grad_clip": 1.0}


def test_server_optimizer_check_embedded(make_client) -> None:
    default = make_client(seed=0)  # floe's default optimizer: weight_decay 0.0
    with pytest.raises(InvalidInput) as e:
        check_server_optimizer(PrimeOptim(), default.info().capabilities["optimizer"])
    assert e.value.field == "trainer.optim.weight_decay"
    assert "weight_decay = 0.01" in str(e.value) and "has weight_decay = 0.0" in str(e.value)
    check_server_optimizer(PrimeOptim(weight_decay=0.0), default.info().capabilities["optimizer"])
    prime = make_client(seed=0, optimizer=PRIME_ADAMW)
    server = prime.info().capabilities["optimizer"]
    assert server["name"] == "adamw" and server["weight_decay"] == 0.01
    check_server_optimizer(PrimeOptim(), server)
    for optim, field in [(PrimeOptim(max_norm=None), "trainer.optim.max_norm"), (PrimeOptim(max_norm=0.5), "trainer.optim.max_norm"),
                         (PrimeOptim(betas2=0.95), "trainer.optim.betas1"), (PrimeOptim(weight_decay=0.1), "trainer.optim.weight_decay")]:
        with pytest.raises(InvalidInput) as e:
            check_server_optimizer(optim, server)
        assert e.value.field == field
    with pytest.raises(InvalidInput) as e:  # eps is not a prime-rl key: torch's default, which the server must use
        check_server_optimizer(PrimeOptim(), {**server, "eps": 1e-6})
    assert e.value.field == "trainer.optim" and "1e-08" in str(e.value)
    with pytest.raises(InvalidInput) as e:
        check_server_optimizer(PrimeOptim(), None)
    assert e.value.field == "floe.url"


def test_server_optimizer_check_over_http(prime_server) -> None:
    client = prime_server.client()
    try:
        server = client.info().capabilities["optimizer"]  # JSON: betas arrive as a list
        assert server["betas"] == [0.9, 0.999] and server["weight_decay"] == 0.0
        check_server_optimizer(PrimeOptim(weight_decay=0.0), server)
        with pytest.raises(InvalidInput) as e:
            check_server_optimizer(PrimeOptim(), server)
        assert e.value.field == "trainer.optim.weight_decay"
    finally:
        client.close()


def test_refusals_come_before_anything_is_published(make_client, tmp_path: Path) -> None:
    cfg = parse_config(rl_toml(tmp_path))  # prime-rl's default AdamW: weight_decay 0.01
    client = make_client(seed=0)
    with pytest.raises(InvalidInput) as e:
        run(cfg, client, log=lambda _: None)
    assert e.value.field == "trainer.optim.weight_decay"
    assert not (tmp_path / "run1").exists() and client.info().step == 0


@pytest.mark.skipif(prime_rl_installed(), reason="prime-rl is importable here: its scheduler runs (prime_rl suite)")
def test_schedules_need_prime_rl(make_client, tmp_path: Path) -> None:
    data = rl_toml(tmp_path)
    data["trainer"]["scheduler"] = {"type": "cosine", "warmup_steps": 1}
    cfg = parse_config(data)
    with pytest.raises(InvalidInput) as e:
        run(cfg, make_client(seed=0, optimizer=PRIME_ADAMW), log=lambda _: None)
    assert e.value.field == "trainer.scheduler.type" and "prime-rl is not importable" in str(e.value)
    assert not (tmp_path / "run1").exists()
    # constant needs no code of prime-rl's: trainer.optim.lr at every step, from the restored step on
    schedule = PrimeRlSchedule(PrimeOptim(lr=3e-6), PrimeScheduler(), max_steps=20, steps=5)
    assert (schedule.source, schedule.steps, schedule.lr) == ("constant", 5, 3e-6)
    assert schedule.advance_to(7) == 3e-6 and schedule.steps == 7
    with pytest.raises(InvalidInput):
        schedule.advance_to(6)
