"""What the Tinker service keeps, with the real tinker 0.38 SDK, its RestClient and the `tinker`
CLI against `floe serve` (issue 19, item 10): the REST surface (runs, checkpoints per run and
per key, checkpoint info, weights info, `tinker checkpoint download`, TTL, publish /
unpublish, sessions), and runs, checkpoints, sessions and their metadata surviving the client
that made them and a server restart: graceful (a training client continues its run) and
killed (listings survive, the run is reported corrupted and refuses with a clear error)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.tinker.conftest import API_KEY

pytestmark = pytest.mark.tinker

OTHER_KEY = "tml-floe-other"
ALIAS = "tiny-alias"
KEYS = f'tinker_api_keys = ["{API_KEY}", "{OTHER_KEY}"]\nserved_model_name = "{ALIAS}"\n'
SEQS = [[5, 9, 14, 20, 7, 33, 12], [40, 41, 42, 8, 9], [3, 17, 25, 26, 27, 28, 29, 30]]
PROBE = [5, 9, 14, 20, 7, 33, 12, 40, 41]


def _datums(types):
    return [types.Datum(model_input=types.ModelInput.from_ints(s[:-1]),
                        loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)}) for s in SEQS]


def _step(training) -> float:
    from tinker import types  # noqa: PLC0415

    fb = training.forward_backward(_datums(types), "cross_entropy")
    opt = training.optim_step(types.AdamParams(learning_rate=2e-2))
    loss = fb.result().metrics["loss:sum"]
    opt.result()
    return loss


def _scores(sampler) -> list[float]:
    from tinker import types  # noqa: PLC0415

    return sampler.compute_logprobs(types.ModelInput.from_ints(PROBE)).result()[1:]


def _sampled(sampler) -> list[tuple[list[int], list[float]]]:
    from tinker import types  # noqa: PLC0415

    out = sampler.sample(types.ModelInput.from_ints(PROBE[:3]), num_samples=2,
                         sampling_params=types.SamplingParams(max_tokens=5, seed=4)).result()
    return [(list(s.tokens), list(s.logprobs)) for s in out.sequences]


def _clients(url: str, key: str = API_KEY, **session):
    import tinker  # noqa: PLC0415

    return tinker.ServiceClient(base_url=url, api_key=key, **session), tinker.RestClient(base_url=url, api_key=key)


def _cli(url: str, *args: str, key: str = API_KEY, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "TINKER_BASE_URL": url, "TINKER_API_KEY": key}
    return subprocess.run([str(Path(sys.executable).parent / "tinker"), *args], check=False, env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=180)


def _peft_logprobs(model: Path, adapter_dir: Path) -> list[float]:
    from peft import PeftModel  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(model)), str(adapter_dir)).eval()
    with torch.no_grad():
        logp = torch.log_softmax(peft(input_ids=torch.tensor([PROBE])).logits[0].float(), -1)
    return [float(logp[i - 1, PROBE[i]]) for i in range(1, len(PROBE))]


def _listing(rest) -> dict:
    """What the RestClient lists for a key, without the clock fields that requests move."""
    runs = rest.list_training_runs().result()
    out: dict = {"runs": {}, "checkpoints": {}, "sessions": rest.list_sessions().result().sessions}
    for run in runs.training_runs:
        out["runs"][run.training_run_id] = run.model_dump(exclude={"last_request_time"})
        out["checkpoints"][run.training_run_id] = [c.model_dump() for c in rest.list_checkpoints(run.training_run_id)
                                                   .result().checkpoints]
    out["user_checkpoints"] = sorted(c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints)
    out["session_details"] = {sid: rest.get_session(sid).result().model_dump() for sid in out["sessions"]}
    return out


def test_rest_surface_listings_download_ttl_publish_and_errors(tinker_server, tinker_model: Path,
                                                              tmp_path: Path) -> None:
    import tinker  # noqa: PLC0415

    server = tinker_server(KEYS + "tinker_min_ttl_s = 1\n")
    service, rest = _clients(server.url, user_metadata={"recipe_name": "rest"}, display_name="rest-session")
    training = service.create_lora_training_client(base_model=ALIAS, rank=4, seed=3,
                                                   user_metadata={"renderer_name": "role_colon"}).result()
    run = training.model_id
    _step(training)
    state = training.save_state("s1", user_metadata={"note": "one step"}).result().path
    weights = training.save_weights_for_sampler("w1").result().path
    snapshot = training.save_weights_and_get_sampling_client().result()
    scores = _scores(snapshot)

    # Runs and checkpoints, per run and per key; info of a run, a checkpoint and its weights.
    info = rest.get_training_run(run).result()
    assert (info.base_model, info.is_lora, info.lora_rank, info.corrupted) == (ALIAS, True, 4, False)
    assert info.user_metadata == {"renderer_name": "role_colon"}
    assert (info.last_checkpoint.tinker_path, info.last_sampler_checkpoint.tinker_path) == (state, weights)
    assert [r.training_run_id for r in rest.list_training_runs().result().training_runs] == [run]
    listed = {c.tinker_path: c for c in rest.list_checkpoints(run).result().checkpoints}
    assert set(listed) == {state, weights} and listed[state].checkpoint_type == "training"
    assert listed[state].user_metadata == {"note": "one step"} and listed[state].size_bytes > 0
    assert sorted(c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints) == sorted(listed)
    assert rest.get_weights_info_by_tinker_path(state).result().model_dump() == {
        "base_model": ALIAS, "optimizer_config": {"type": "adamw"}, "is_lora": True, "lora_rank": 4,
        "train_unembed": True, "train_mlp": True, "train_attn": True}
    assert rest.get_training_run_by_tinker_path(state).result().training_run_id == run
    sessions = rest.list_sessions().result().sessions
    assert len(sessions) == 1
    session = rest.get_session(sessions[0]).result()
    assert session.training_run_ids == [run] and len(session.sampler_ids) == 1
    assert (session.user_metadata, session.display_name) == ({"recipe_name": "rest"}, "rest-session")

    # The CLI: listings, then download of a training checkpoint (through a temporary export
    # it deletes), a directory peft loads on the base model with the server's log-probs.
    cli_runs = _cli(server.url, "--format", "json", "run", "list")
    assert cli_runs.returncode == 0, cli_runs.stderr
    assert [r["training_run_id"] for r in json.loads(cli_runs.stdout)["runs"]] == [run]
    cli_ckpts = _cli(server.url, "--format", "json", "checkpoint", "list", "--run-id", run)
    assert cli_ckpts.returncode == 0, cli_ckpts.stderr
    assert sorted(c["tinker_path"] for c in json.loads(cli_ckpts.stdout)["checkpoints"]) == sorted(listed)
    download = _cli(server.url, "checkpoint", "download", state, "--output", str(tmp_path / "dl"))
    assert download.returncode == 0, download.stdout + download.stderr
    (got,) = (tmp_path / "dl").iterdir()
    assert (got / "adapter_model.safetensors").is_file()
    assert _peft_logprobs(tinker_model, got) == pytest.approx(scores, abs=1e-5)
    assert not [c for c in rest.list_user_checkpoints().result().checkpoints if c.checkpoint_type == "external"]

    # TTL: set and removed; below the server's minimum refused; an expired checkpoint is gone
    # from listings, from loading and (the sweep) from disk.
    rest.set_checkpoint_ttl_from_tinker_path(state, 7200).result()
    expires = {c.tinker_path: c.expires_at for c in rest.list_checkpoints(run).result().checkpoints}[state]
    assert expires is not None and 7100 < expires.timestamp() - time.time() <= 7200
    rest.set_checkpoint_ttl_from_tinker_path(state, None).result()
    assert {c.tinker_path: c.expires_at for c in rest.list_checkpoints(run).result().checkpoints}[state] is None
    short = training.save_state("short", ttl_seconds=1).result().path
    short_dir = server.state_dir / ".tinker" / "runs" / run / "weights" / "short"
    assert short_dir.is_dir()
    deadline = time.monotonic() + 15
    while short_dir.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not short_dir.exists()
    assert short not in [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints]
    with pytest.raises(tinker.NotFoundError, match="no checkpoint"):
        service.create_training_client_from_state(short).result()

    # Publish: another key loads a published checkpoint (and gets its weights, not the owner's
    # run metadata), not an unpublished one, and never sees the owner's runs.
    other, other_rest = _clients(server.url, OTHER_KEY)
    with pytest.raises(tinker.NotFoundError):
        other.create_training_client_from_state(state).result()
    published = _cli(server.url, "checkpoint", "publish", state)
    assert published.returncode == 0, published.stdout + published.stderr
    assert {c.tinker_path: c.public for c in rest.list_checkpoints(run).result().checkpoints}[state] is True
    loaded = other.create_training_client_from_state(state).result()
    assert _scores(loaded.save_weights_and_get_sampling_client().result()) == pytest.approx(scores, abs=1e-6)
    assert not other_rest.get_training_run(loaded.model_id).result().user_metadata
    mine = service.create_training_client_from_state(state).result()  # the owner's own load keeps it
    assert rest.get_training_run(mine.model_id).result().user_metadata == {"renderer_name": "role_colon"}
    assert [r.training_run_id for r in other_rest.list_training_runs().result().training_runs] == [loaded.model_id]
    with pytest.raises(tinker.NotFoundError):
        other_rest.list_checkpoints(run).result()
    with pytest.raises(tinker.NotFoundError):
        other_rest.unpublish_checkpoint_from_tinker_path(state).result()  # only the owner changes it
    rest.unpublish_checkpoint_from_tinker_path(state).result()
    with pytest.raises(tinker.NotFoundError):
        other.create_training_client_from_state(state).result()
    with pytest.raises(tinker.NotFoundError):
        other.create_sampling_client(model_path=weights).result()

    # No error message shows a server path: refusals answered at once and through futures.
    root = str(server.state_dir)
    errors = []
    with pytest.raises(Exception) as too_short:
        rest.set_checkpoint_ttl_from_tinker_path(state, 0).result()
    errors.append(str(too_short.value))
    weights_dir = server.state_dir / ".tinker" / "runs" / run / "sampler_weights" / "w1"
    weights_dir.rename(weights_dir.with_name("moved"))  # files lost behind the registry's back
    with pytest.raises(Exception) as missing:
        service.create_sampling_client(model_path=weights).result()
    errors.append(str(missing.value))
    (server.state_dir / ".tinker" / "runs" / run / "weights" / "s1" / "state.json").unlink()
    with pytest.raises(Exception) as broken:
        service.create_training_client_from_state(state).result()
    errors.append(str(broken.value))
    with pytest.raises(Exception) as wrong_base:
        service.create_lora_training_client(base_model="/nope/model", rank=4).result()
    errors.append(str(wrong_base.value))
    assert all(root not in e and ".tinker" not in e for e in errors), errors
    assert "no sampler weights" in errors[1] and ALIAS in errors[3]
    service.close("success").result()
    other.close("success").result()


def test_runs_checkpoints_and_sessions_survive_clients_and_restarts(tinker_server, tinker_model: Path) -> None:
    from tinker_cookbook import checkpoint_utils  # noqa: PLC0415

    import tinker  # noqa: PLC0415

    server = tinker_server(KEYS)
    port = int(server.url.rsplit(":", 1)[1])

    # A client that made a run and a checkpoint and went away: both stay.
    gone, _ = _clients(server.url, user_metadata={"recipe_name": "gone"})
    first = gone.create_lora_training_client(base_model=str(tinker_model), rank=4, seed=1).result()
    _step(first)
    first_state = first.save_state("first").result().path
    gone.close("success").result()

    # The main client: the cookbook's metadata (renderer name in the run's user_metadata).
    service, rest = _clients(server.url, user_metadata={"recipe_name": "persist"}, display_name="persist")
    metadata: dict[str, str] = {}
    checkpoint_utils.add_renderer_name_to_user_metadata(metadata, "role_colon")
    training = service.create_lora_training_client(base_model=ALIAS, rank=4, seed=2, user_metadata=metadata).result()
    losses = [_step(training), _step(training)]
    state = training.save_state("two", user_metadata={"step": "2"}).result().path
    snapshot = training.save_weights_and_get_sampling_client().result()
    before = (_scores(snapshot), _sampled(snapshot))
    listing = _listing(rest)
    assert set(listing["runs"]) == {first.model_id, training.model_id} and len(listing["sessions"]) == 2
    assert listing["runs"][first.model_id]["corrupted"] is False

    # Graceful restart (SIGTERM): everything is listed as before; the same training client
    # continues its run exactly as a run loaded from its last state does; its sampler samples.
    assert server.stop(signal.SIGTERM) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it is done
    assert "run offloaded" in server.log_path.read_text() and "shutdown complete" in server.log_path.read_text()
    server = tinker_server(KEYS, state_dir=server.state_dir, port=port)
    assert _listing(rest) == listing
    assert training.get_info().model_name == ALIAS
    assert checkpoint_utils.get_renderer_name_from_checkpoint(service, state) == "role_colon"
    assert (_scores(snapshot), _sampled(snapshot)) == before
    continued = _step(training)
    after_restart = training.save_weights_for_sampler("after-restart").result().path
    reference = service.create_training_client_from_state_with_optimizer(state).result()
    assert _step(reference) == continued and continued < losses[-1]
    reference_weights = reference.save_weights_for_sampler("reference").result().path
    ours, theirs = (_adapter(server.state_dir, p) for p in (after_restart, reference_weights))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    loaded_gone = service.create_training_client_from_state(first_state).result()  # the gone client's state loads
    assert loaded_gone.get_info().model_name == str(tinker_model)
    late = training.save_weights_and_get_sampling_client().result()  # in memory only
    _scores(late)

    # Killed (SIGKILL): listings survive; the live run is reported corrupted, and its client's
    # next request fails with an error that says to load a checkpoint; checkpoints still load.
    listing = _listing(rest)
    server.stop(signal.SIGKILL)
    server = tinker_server(KEYS, state_dir=server.state_dir, port=port)
    after_kill = _listing(rest)
    assert after_kill["checkpoints"] == listing["checkpoints"] and after_kill["sessions"] == listing["sessions"]
    assert after_kill["runs"][training.model_id]["corrupted"] is True
    assert after_kill["runs"][first.model_id]["corrupted"] is False  # closed cleanly before
    assert {k: {**v, "corrupted": True} for k, v in listing["runs"].items() if k != first.model_id} == {
        k: v for k, v in after_kill["runs"].items() if k != first.model_id}
    started = time.monotonic()
    with pytest.raises(tinker.RequestFailedError, match="create_training_client_from_state") as lost:
        _step(training)
    assert "crash or kill" in str(lost.value) and str(server.state_dir) not in str(lost.value)
    assert time.monotonic() - started < 10  # at once, not after waiting for request numbers that never come
    assert (_scores(snapshot), _sampled(snapshot)) == before  # its weights went to disk at the graceful stop
    with pytest.raises(tinker.RequestFailedError, match="save weights for a sampler again"):
        _scores(late)
    resumed = service.create_training_client_from_state_with_optimizer(state).result()
    assert _step(resumed) == continued
    service.close("success").result()


def _adapter(state_dir: Path, path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file  # noqa: PLC0415

    run, kind, name = path.removeprefix("tinker://").split("/")
    return load_file(str(state_dir / ".tinker" / "runs" / run / kind / name / "adapter_model.safetensors"))
