"""`floe prime-trainer`'s loop on prime-rl's file formats: an orchestrator stand-in (orchestrator.py)
writes 3 steps of rollouts, each after the previous step's STABLE marker, as prime-rl's does;
the trainer trains them, publishes step_0..step_3 in order, and its loss equals both floe's
native API and prime-rl's own formula on the same batch."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

import floe
from floe.config import LoraConfig
from floe.errors import InvalidInput, StateError
from floe.integrations.prime_rl.batch import to_floe_batch
from floe.integrations.prime_rl.checkpoint import read_checkpoint
from floe.integrations.prime_rl.config import parse_config
from floe.integrations.prime_rl.formats import (
    STABLE,
    broadcast_dir,
    read_marker,
    read_micro_batches,
    rollout_path,
    unpublish,
)
from floe.integrations.prime_rl.lora import PRIME_DEFAULTS, server_lora
from floe.integrations.prime_rl.trainer import run
from tests.conftest import backend_of
from tests.integrations.prime_rl.orchestrator import make_samples, pack, serve_steps, write_step

KL_TAU = 0.05
# floe serve's [optimizer] as prime-rl's default AdamW trains (optim.PrimeOptim().serve_optimizer()).
PRIME_ADAMW = {"weight_decay": 0.01, "grad_clip": 1.0, "betas": (0.9, 0.999), "eps": 1e-8}


def rl_toml(tmp_path: Path, **over) -> dict:
    data = {"output_dir": str(tmp_path), "run": {"name": "run1"}, "max_steps": 3,
            "rollout_transport": {"type": "filesystem"},
            "trainer": {"loss": {"kl_tau": KL_TAU},  # prime-rl's DPPO masks at their 0.2 defaults
                        "model": {"compile": {}}},
            "floe": {"poll_s": 0.05, "wait_timeout_s": 120}}
    data.update(over)
    return data


def test_three_steps_published_in_order_with_native_loss(make_client, tmp_path: Path) -> None:
    cfg = parse_config(rl_toml(tmp_path))
    run_dir = tmp_path / "run1"
    assert cfg.run_dir == run_dir and cfg.ignored_trainer_keys == ["trainer.model.compile"]
    trainer_client = make_client(seed=0, optimizer=PRIME_ADAMW)
    orchestrator_client = trainer_client.fork()
    seen: list[tuple[int, float]] = []
    errors: list[BaseException] = []

    def orchestrator() -> None:  # prime-rl's loop: wait for v{n-1}'s STABLE, sample with it, ship step n
        try:
            for step in range(1, 4):
                marker = broadcast_dir(run_dir, step - 1) / STABLE
                while not marker.exists():
                    time.sleep(0.02)
                seen.append((step - 1, time.monotonic()))
                assert orchestrator_client.info().sampler_version == read_marker(marker.parent).weights_version
                write_step(run_dir, step, orchestrator_client)
        except BaseException as e:  # noqa: BLE001 - re-raised by the test thread
            errors.append(e)

    thread = threading.Thread(target=orchestrator)
    thread.start()
    lines: list[str] = []
    reports = run(cfg, trainer_client, log=lines.append)
    thread.join(60)
    assert not errors, errors
    assert [r.step for r in reports] == [1, 2, 3]
    assert [s for s, _ in seen] == [0, 1, 2]
    stables = [broadcast_dir(run_dir, s) / STABLE for s in range(4)]
    assert all(p.exists() for p in stables)
    mtimes = [p.stat().st_mtime_ns for p in stables]
    assert mtimes == sorted(mtimes)
    versions = [read_marker(p.parent).weights_version for p in stables]
    assert versions == [versions[0] + s for s in range(4)]
    assert trainer_client.info().step == 3 and trainer_client.info().sampler_version == versions[-1]
    assert "lr schedule constant" in lines[0] and "not applied" in lines[1]
    # prime-rl's default scheduler (constant) at its default lr: every step ran at trainer.optim.lr
    assert [r.lr for r in reports] == [1e-6] * 3 and [r.next_lr for r in reports] == [1e-6] * 3

    # Step 1 ran on the initial weights: a fresh backend on the same model must give the same loss
    # through floe's native API, and prime-rl's formula on floe's forward log-probs must agree.
    micro_batches = read_micro_batches(rollout_path(run_dir, 1, 0))
    native = make_client(seed=0)
    groups, n_tokens = [], 0
    for mb in micro_batches:
        start = 0
        for length in mb.sequence_lengths:
            ids, mask = mb.input_ids[start:start + length], mb.loss_mask[start:start + length]
            live = [t for t, m in enumerate(mask) if m]
            if live:
                a, b = live[0], live[-1] + 1
                n_tokens += len(live)
                lps = mb.inference_logprobs[start + a:start + b]
                groups.append(floe.Group(ids[:a], [floe.Sample(
                    tokens=ids[a:b], logprobs=lps, advantage=mb.advantages[start + a:start + b],
                    weights=[1.0 if m else 0.0 for m in mask[a:b]], ref_logprobs=lps, temperature=1.0)]))
            start += length
    batch = floe.Batch(groups)
    fwd = native.forward(batch, temperature=1.0)
    expected = 0.0
    for group, lp in zip(batch.groups, fwd.logprobs):
        s = group.samples[0]
        logp = torch.tensor(lp[0], dtype=torch.float64)
        log_r = logp - torch.tensor(s.logprobs, dtype=torch.float64)
        w = torch.tensor(s.weights, dtype=torch.float64)
        adv = torch.tensor(s.advantage, dtype=torch.float64)
        diff = torch.exp(logp) - torch.exp(torch.tensor(s.logprobs, dtype=torch.float64))
        keep = ~torch.where(adv > 0, diff > 0.2, diff < -0.2)  # prime-rl's DPPO trust region
        expected += float((w * (-keep.double() * adv * torch.exp(log_r) + KL_TAU * log_r**2)).sum())  # prime-rl default_loss_fn
    expected /= n_tokens  # / rl_scale
    fb = native.forward_backward(batch, loss="dppo", loss_config={
        "divergence": "binary_tv", "delta_low": 0.2, "delta_high": 0.2, "aggregation": "token_mean",
        "kl": {"coef": 2 * KL_TAU, "estimator": "k2"}})
    assert reports[0].rl_scale == n_tokens
    assert reports[0].loss == pytest.approx(fb.metrics["loss"], abs=1e-6)
    assert reports[0].loss == pytest.approx(expected, abs=1e-5)
    assert abs(reports[0].loss) > 1e-4  # the comparison is not between zeros


def test_packing_round_trip_and_refusals(make_client) -> None:
    client = make_client(seed=0)
    samples = make_samples(client, seed=7)
    loss = parse_config(rl_toml(Path("/tmp"))).loss
    step = to_floe_batch(pack(samples), loss)
    assert step.samples == 4 and step.batch.num_samples == 4
    assert step.rl_scale == sum(sum(s.mask) for s in samples)
    # the multi-turn samples keep their env tokens at weight 0 inside the trained span
    multi = step.batch.groups[-1].samples[-1]
    assert 0.0 in multi.weights and multi.weights[0] > 0 and multi.weights[-1] > 0
    bad = pack(samples)
    bad[0].ce_weights = [1.0] * len(bad[0].input_ids)
    with pytest.raises(InvalidInput) as e:
        to_floe_batch(bad, loss)
    assert e.value.field == "micro_batches[0].ce_weights"
    bad = pack(samples)
    bad[1].temperatures = [0.7 if i % 2 else 1.0 for i in range(len(bad[1].input_ids))]
    with pytest.raises(InvalidInput) as e:
        to_floe_batch(bad, loss)
    assert e.value.field == "micro_batches[1].temperatures"


@pytest.mark.parametrize(("over", "field"), [
    ({"rollout_transport": {"type": "tcp"}}, "rollout_transport.type"),
    ({"rollout_transport": {"type": "zmq", "port": 0}}, "rollout_transport.port"),
    ({"rollout_transport": {"type": "zmq", "hwm": 10, "hots": "x"}}, "rollout_transport.hots"),
    ({"trainer": {"rollout_transport": {"type": "filesystem", "host": "x"}}}, "trainer.rollout_transport.host"),
    ({"ckpt": {"intervall": 2}}, "ckpt.intervall"),
    ({"ckpt": {"interval": 0}}, "ckpt.interval"),
    ({"trainer": {"ckpt": {"skip_optimizer": True}}}, "trainer.ckpt.skip_optimizer"),
    ({"ckpt": {"skip_optimizer": False}}, "ckpt.skip_optimizer"),  # a trainer-only key
    ({"resume": {"step": 0}}, "resume.step"),
    ({"resume": {"step": 2, "dir": "x/step_2"}}, "resume.step"),
    ({"resume": {"dir": "x/latest"}}, "resume.dir"),
    ({"resume": 3}, "resume"),
    ({"run": {}}, "run.name"),
    ({"max_steps": 0}, "max_steps"),
    ({"floe": {"urll": "x"}}, "floe.urll"),
    ({"trainer": {"optim": {"type": "muon"}}}, "trainer.optim.type"),
    ({"trainer": {"optim": {"lr": 2.0}}}, "trainer.optim.lr"),
    ({"trainer": {"optim": {"betas": [0.9, 0.95]}}}, "trainer.optim.betas"),
    ({"trainer": {"optim": {"max_norm": 0}}}, "trainer.optim.max_norm"),
    ({"trainer": {"scheduler": {"type": "wsd"}}}, "trainer.scheduler.type"),
    ({"trainer": {"scheduler": {"type": "cosine", "decay_steps": 2}}}, "trainer.scheduler.decay_steps"),
    ({"trainer": {"scheduler": {"type": "cosine", "warmup_steps": 3}}}, "trainer.scheduler.warmup_steps"),
    ({"trainer": {"scheduler": {"type": "linear", "warmup_steps": 0, "decay_steps": 0}}}, "trainer.scheduler.warmup_steps"),
    ({"trainer": {"scheduler": {"type": "linear", "warmup_steps": 2, "decay_steps": 2}}}, "trainer.scheduler.decay_steps"),
    ({"trainer": {"model": {"lora": {"rank": 0}}}}, "trainer.model.lora.rank"),
    ({"trainer": {"model": {"lora": {"rank": 8, "dropout": 0.1}}}}, "trainer.model.lora.dropout"),
    ({"trainer": {"model": {"lora": {"modules_to_save": ["lm_head"]}}}}, "trainer.model.lora.modules_to_save"),
    ({"trainer": {"model": {"lora": {"target_modules": [".*_proj"]}}}}, "trainer.model.lora.target_modules"),
    ({"trainer": {"model": {"lora": {"rnak": 8}}}}, "trainer.model.lora.rnak"),
    ({"trainer": {"loss": {"dppo_mask_low": -0.1}}}, "trainer.loss.dppo_mask_low"),
])
def test_config_refusals(tmp_path: Path, over: dict, field: str) -> None:
    with pytest.raises(InvalidInput) as e:
        parse_config(rl_toml(tmp_path, **over))
    assert e.value.field == field


def test_overlay_and_cli(tmp_path: Path, capsys) -> None:
    from floe.cli import main
    from floe.config import load_layers

    root = Path(__file__).resolve().parents[3]
    cfg = parse_config(load_layers([root / "recipes/prime_rl/floe.toml"], {"max_steps": 2}))
    assert (cfg.loss.name, cfg.url, cfg.run_dir.name, cfg.max_steps) == ("dppo", "http://127.0.0.1:7000", "floe-run", 2)  # no [floe] url: floe prime-rl starts floe serve
    rl = tmp_path / "rl.toml"
    rl.write_text('max_steps = 2\n[run]\nname = "x"\n[rollout_transport]\ntype = "tcp"\n')
    assert main(["prime-trainer", "@", str(rl)]) == 2
    assert "rollout_transport.type" in capsys.readouterr().err


def test_lora_recipe_trains_the_servers_adapter_and_a_mismatch_stops_first(make_client, tmp_path: Path) -> None:
    # alphabet-sort's trainer.model.lora (rank 32, alpha 64, prime-rl's default targets): the adapter
    # of floe serve's [backend.lora] (lora.server_lora, as floe prime-rl starts it); the run checks
    # the server's adapter, then trains only the adapter's A and B; a server without it is refused
    # before anything is published.
    lora = {"rank": 4, "alpha": 8}
    cfg = parse_config(rl_toml(tmp_path / "a", max_steps=2, trainer={"loss": {"kl_tau": KL_TAU}, "model": {"lora": lora}}))
    assert cfg.lora == LoraConfig(rank=4, alpha=8.0, target_modules=PRIME_DEFAULTS["target_modules"], missing_targets="ignore")
    backend = server_lora(cfg.lora, {"seed": 0, "optimizer": PRIME_ADAMW})
    with pytest.raises(InvalidInput) as e:
        server_lora(cfg.lora, {"lora": {"rank": 8, "alpha": 8.0}})
    assert e.value.field == "floe.backend.lora"

    plain = make_client(seed=0, optimizer=PRIME_ADAMW)
    with pytest.raises(InvalidInput) as e:
        run(cfg, plain, log=lambda line: None)
    assert e.value.field == "trainer.model.lora" and "[backend.lora] rank = 4, alpha = 8.0" in e.value.message
    assert not (cfg.run_dir / "broadcasts").exists()

    client = make_client(**backend)
    policy = backend_of(client).policy
    start = {k: v.clone() for k, v in policy.model.state_dict().items()}  # the trained tensors: the adapter alone
    assert {k.split(".")[-2] for k in start} == {"lora_A", "lora_B"}
    assert {k.split(".")[-3] for k in start} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    reports, lines = _train(cfg, client, 2)
    assert [r.step for r in reports] == [1, 2] and any("LoRA adapter (rank 4, alpha 8.0)" in line for line in lines)
    after = policy.model.state_dict()
    assert any(not torch.equal(after[k], start[k]) for k in start if "lora_B" in k)  # B left 0: the adapter trained
    with pytest.raises(InvalidInput) as e:  # and the other way round: the server's adapter, no recipe LoRA
        run(parse_config(rl_toml(tmp_path / "b")), make_client(**backend), log=lambda line: None)
    assert e.value.field == "trainer.model.lora"


def _train(cfg, client: floe.Client, steps: int, first: int = 1) -> tuple[list, list[str]]:
    """cfg's run through the orchestrator stand-in (steps first..steps); returns (reports, log lines)."""
    errors: list[BaseException] = []
    thread = serve_steps(cfg.run_dir, client.fork(), steps, errors, first=first)
    lines: list[str] = []
    try:
        reports = run(cfg, client, log=lines.append)
    finally:
        thread.join(60)
    assert not errors, errors
    return reports, lines


def test_resume_continues_a_crashed_run_exactly(make_client, tmp_path: Path) -> None:
    # prime-rl's [ckpt] + resume: a run that dies after step 2 of 3 and is resumed ends where an
    # uninterrupted run ends: same step-3 loss, rate and version, same final weights (AdamW's moments
    # and step come back with the floe state), and keep_last deleted the older checkpoint.
    # (the scheduler's position after a restore: test_prime_rl_schedule.py, with prime-rl's own scheduler)
    trainer = {"loss": {"kl_tau": KL_TAU}, "optim": {"lr": 3e-3}}
    whole = parse_config(rl_toml(tmp_path / "a", trainer=trainer))
    a = make_client(seed=0, optimizer=PRIME_ADAMW)
    reports_a, _ = _train(whole, a, 3)

    ckpt = {"interval": 1, "keep_last": 1}
    crashed = parse_config(rl_toml(tmp_path / "b", trainer=trainer, ckpt=ckpt,
                                   floe={"poll_s": 0.05, "wait_timeout_s": 3}))
    b = make_client(seed=0, optimizer=PRIME_ADAMW)
    errors: list[BaseException] = []
    thread = serve_steps(crashed.run_dir, b.fork(), 2, errors)  # the orchestrator dies after step 2
    with pytest.raises(StateError, match="rollouts/step_3/rank_0.bin"):
        run(crashed, b, log=lambda line: None)
    thread.join(60)
    assert not errors, errors
    root = crashed.run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_2"]  # keep_last = 1 deleted step_1
    marker = read_checkpoint(root / "step_2")
    assert (marker.step, marker.policy_step) == (2, 2)
    assert b.list_states() == [marker.state]  # step 1's floe state went with it
    after_two = b.forward(floe.Batch(_probe(read_micro_batches(rollout_path(crashed.run_dir, 2, 0)))),
                          temperature=1.0).logprobs
    b.close()

    resumed = parse_config(rl_toml(tmp_path / "b", trainer=trainer, ckpt=ckpt, resume={}))
    c = make_client(seed=1, optimizer=PRIME_ADAMW)  # a new server process would start from scratch
    unpublish(resumed.run_dir, 2)  # as floe prime-rl does before it starts the orchestrator
    reports_c, lines = _train(resumed, c, 3, first=3)
    assert "resumed step 2" in lines[0]
    assert [r.step for r in reports_c] == [3]
    last_a, last_c = reports_a[-1], reports_c[0]
    assert last_c.weights_version == last_a.weights_version and last_c.lr == last_a.lr
    assert last_c.loss == pytest.approx(last_a.loss, abs=1e-7) and abs(last_a.loss) > 1e-4
    assert last_c.grad_norm == pytest.approx(last_a.grad_norm, rel=1e-5)  # (the on-policy loss barely sees weights)
    probe = floe.Batch(_probe(read_micro_batches(rollout_path(crashed.run_dir, 2, 0))))
    final_a = a.forward(probe, temperature=1.0).logprobs
    final_c = c.forward(probe, temperature=1.0).logprobs
    diff = max(abs(x - y) for ga, gc in zip(final_a, final_c) for sa, sc in zip(ga, gc) for x, y in zip(sa, sc))
    moved = max(abs(x - y) for ga, g2 in zip(final_a, after_two) for sa, s2 in zip(ga, g2) for x, y in zip(sa, s2))
    assert diff < 1e-6 < moved / 100, (diff, moved)  # step 3 changed the policy; both runs changed it alike
    assert (resumed.run_dir / "checkpoints" / "step_3" / "trainer" / "floe.json").is_file()
    assert read_marker(broadcast_dir(resumed.run_dir, 2)).weights_version == reports_a[1].weights_version


def _probe(micro_batches) -> list[floe.Group]:
    """Each packed sample's tokens as one group (prompt = the first token): a fixed batch to compare policies."""
    groups = []
    for mb in micro_batches:
        start = 0
        for length in mb.sequence_lengths:
            ids = mb.input_ids[start:start + length]
            groups.append(floe.Group(ids[:1], [floe.Sample(tokens=ids[1:])]))
            start += length
    return groups
