"""Crash and restart: a server killed with SIGKILL mid-step and restarted from its latest
saved state lets the same client continue; no operation is applied twice, and the result
equals an uninterrupted run."""

from __future__ import annotations

import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import floe
from floe import Group, Sample, SamplingParams
from floe.server.cli import latest_state, load_serve_config, parse_serve_args
from tests.killed_writer import WRITER

PROMPTS = [[5, 6, 7], [8, 9]]


def rollout_and_backward(client: floe.Client) -> float:
    res = client.sample(PROMPTS, n=3, params=SamplingParams(max_tokens=5))  # unseeded: uses the saved RNG
    batch = [Group(g.prompt, [Sample(s.tokens, logprobs=s.logprobs, advantage=float(j) - 1.0) for j, s in enumerate(g.samples)])
             for g in res.groups]
    return client.forward_backward(batch, loss="ppo").metrics["loss"]


def finish_step(client: floe.Client, step: int) -> int:
    applied = client.optim_step().step
    client.sync_weights()
    client.save_state(f"step-{step}")
    return applied


def test_sigkill_then_resume_latest_continues_without_double_application(start_server, server_model: Path, tmp_path: Path) -> None:
    state_dir = tmp_path / "remote-states"
    server = start_server("--resume-latest", state_dir=state_dir)  # nothing saved yet: starts fresh
    port = int(server.url.rsplit(":", 1)[1])
    client = server.client(timeout=120)
    losses, applied = [], []
    for step in (1, 2):
        losses.append(rollout_and_backward(client))
        applied.append(finish_step(client, step))
    rollout_and_backward(client)  # step 3 is half done: gradients pending on the server...
    server.proc.kill()  # ...when it dies
    server.proc.wait()

    restarted = start_server("--resume-latest", state_dir=state_dir, port=port, wait=False)
    info = client.info()  # the same client: retries (connection refused) until the new server answers
    assert restarted.alive()
    assert (info.step, info.sampler_version, info.capabilities["pending_forward_backward_calls"]) == (2, 2, 0)
    for step in (3, 4):  # the client re-sends from its own checkpoint (step 2)
        losses.append(rollout_and_backward(client))
        applied.append(finish_step(client, step))
    assert applied == [1, 2, 3, 4]
    client.export_hf(str(tmp_path / "remote"))
    client.close()

    with floe.connect(floe.BackendConfig(model=str(server_model), state_dir=str(tmp_path / "local-states"), seed=0)) as local:
        want = []
        for step in (1, 2, 3, 4):
            want.append(rollout_and_backward(local))
            finish_step(local, step)
        local.export_hf(str(tmp_path / "local"))
    assert losses == pytest.approx(want, abs=1e-6)
    wr, wl = load_file(str(tmp_path / "remote" / "model.safetensors")), load_file(str(tmp_path / "local" / "model.safetensors"))
    assert all(torch.allclose(wr[k], wl[k], rtol=0, atol=1e-6) for k in wl)
    assert latest_state(tmp_path / "local-states") == "step-4"


def test_resume_from_unknown_state_fails_fast(server_model: Path, tmp_path: Path) -> None:
    config = tmp_path / "b.toml"
    config.write_text(f'model = "{server_model}"\nstate_dir = "{tmp_path}"\n')
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-m", "floe.server", str(config), "--resume-from", "nope"], capture_output=True, text=True, timeout=120, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert proc.returncode == 2 and "no saved state 'nope'" in proc.stderr
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)  # robust to a loaded machine
    assert cpu < 20, cpu  # refused before loading any model (about 5 s: imports)


def test_config_layers_backend_table_server_table_and_flags(tmp_path: Path) -> None:
    (tmp_path / "serve.toml").write_text('[backend]\nmodel = "m"\n[server]\nport = 7100\n')
    (tmp_path / "over.toml").write_text('[backend]\nseed = 5\n')
    files, overrides, args = parse_serve_args(
        [str(tmp_path / "serve.toml"), "@", str(tmp_path / "over.toml"), "--backend.dtype", "bfloat16", "--host", "0.0.0.0"]
    )
    backend, server = load_serve_config(files, overrides, args)
    assert (backend.model, backend.seed, backend.dtype) == ("m", 5, "bfloat16")
    assert (server.port, server.host) == (7100, "0.0.0.0")
    flags = parse_serve_args([str(tmp_path / "serve.toml")])[2]
    (tmp_path / "plain.toml").write_text('model = "m"\nsed = 1\n')
    with pytest.raises(floe.InvalidInput) as e:
        load_serve_config([str(tmp_path / "plain.toml")], {}, flags)
    assert e.value.field == "backend.sed"
    # Nothing is silently ignored: a stray table next to [backend] is an error.
    (tmp_path / "stray.toml").write_text('[backend]\nmodel = "m"\n[rl]\nsteps = 3\n')
    with pytest.raises(floe.InvalidInput) as e:
        load_serve_config([str(tmp_path / "stray.toml")], {}, flags)
    assert e.value.field == "rl"


def test_a_training_recipe_serves_its_prepared_model(tmp_path: Path, server_model: Path) -> None:
    (tmp_path / "recipe.toml").write_text(
        f'[model]\npath = "{server_model}"\n[backend]\nseed = 3\n[train]\nsteps = 2\n'
        f'[output]\nrun_dir = "{tmp_path / "run"}"\n'
    )
    files, overrides, args = parse_serve_args([str(tmp_path / "recipe.toml")])
    backend, _ = load_serve_config(files, overrides, args)
    assert (backend.model, backend.seed, backend.state_dir) == (str(server_model), 3, str(tmp_path / "run" / "states"))
    (tmp_path / "bad.toml").write_text(f'[model]\npath = "{server_model}"\n[train]\nstepz = 2\n')
    with pytest.raises(floe.InvalidInput) as e:
        load_serve_config([str(tmp_path / "bad.toml")], {}, args)
    assert e.value.field == "recipe.train.stepz"

def test_resume_latest_recovers_a_killed_overwrite_and_skips_a_damaged_newest_state(
    start_server, server_model: Path, tmp_path: Path
) -> None:
    """Issue 23 items 3 and 4: states a (step 1), b (step 2), c (step 3); b's overwrite was
    killed between its two renames (b is aside under a dot-name) and c is cut short. A server
    started with --resume-latest says it skipped c (and why), resumes b at step 2; loading c is
    a 409 StateError naming it, not a 500."""
    state_dir = tmp_path / "states"
    with floe.connect(floe.BackendConfig(model=str(server_model), state_dir=str(state_dir), seed=0)) as local:
        for step, name in ((1, "a"), (2, "b"), (3, "c")):
            rollout_and_backward(local)
            local.optim_step()
            local.save_state(name)
            time.sleep(0.01)
    copy = tmp_path / "copy-of-b"
    copy.mkdir()
    for f in (state_dir / "b").iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    killed = subprocess.run([sys.executable, "-c", WRITER, str(state_dir / "b"), str(copy), "2", str(tmp_path / "x")],
                            capture_output=True, text=True, timeout=60, check=False)
    assert killed.returncode == -9 and not (state_dir / "b").exists()
    weights = state_dir / "c" / "policy.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])

    server = start_server("--resume-latest", state_dir=state_dir)
    client = server.client(timeout=60)
    assert client.info().step == 2
    log = server.log_path.read_text()
    assert "skipped the state 'c'" in log and "policy.safetensors" in log and "damaged" in log
    with pytest.raises(floe.StateError) as e:
        client.load_state("c")
    assert "'c'" in str(e.value) and "damaged" in str(e.value) and "policy.safetensors" in str(e.value)
    assert client.info().step == 2  # nothing changed
    assert client.list_states() == ["a", "b", "c"]
    # the killed writer's temp dir is gone (.tinker: the Tinker service's own namespace)
    assert sorted(p.name for p in state_dir.iterdir() if p.name != ".tinker") == ["a", "b", "c"]
    client.close()
