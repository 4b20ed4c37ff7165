"""The vLLM / prime-rl endpoints of `floe serve` over real HTTP: token-in/token-out generate with
log-probs equal to the policy's forward, /v1/models' max_model_len, /pause holding sampling
until /resume, /update_weights and /load_lora_adapter checking the published version, and
field-named refusals."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

import floe
from floe.integrations.prime_rl.formats import BroadcastMarker, publish
from floe.models import make_tiny
from tests.integrations.prime_rl.conftest import TOKEN
from tests.server.conftest import ServerProcess, free_port


def post(server, path: str, **kw) -> httpx.Response:
    return httpx.post(server.url + path, headers=server.headers(), timeout=60, **kw)


def test_generate_matches_policy_forward(prime_server) -> None:
    prompt = [5, 9, 13, 2, 7]
    r = post(prime_server, "/inference/v1/generate", json={
        "model": "tiny", "token_ids": prompt,
        "sampling_params": {"max_tokens": 6, "temperature": 0.8, "logprobs": 1, "stop_token_ids": [],
                            "skip_special_tokens": False, "seed": 3, "repetition_penalty": 1.0}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["prompt_token_ids"] == prompt
    choice = body["choices"][0]
    assert choice["finish_reason"] in ("stop", "length") and len(choice["token_ids"]) >= 1
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    client = prime_server.client()
    fwd = client.forward(floe.Batch([floe.Group(prompt, [floe.Sample(tokens=choice["token_ids"])])]), temperature=0.8)
    for got, want in zip([c["logprob"] for c in content], fwd.logprobs[0][0]):
        assert got == pytest.approx(want, abs=1e-4)
    models = httpx.get(prime_server.url + "/v1/models", headers=prime_server.headers()).json()
    assert models["data"][0]["max_model_len"] == client.info().max_context
    client.close()


@pytest.mark.parametrize(("body", "field"), [
    ({"token_ids": [5], "sampling_params": {"max_tokens": 2, "frequency_penalty": 0.5}}, "sampling_params.frequency_penalty"),
    ({"token_ids": [5], "sampling_params": {"max_tokens": 2, "beam_width": 2}}, "sampling_params.beam_width"),
    ({"token_ids": [], "sampling_params": {}}, "token_ids"),
    ({"token_ids": [5], "features": {"x": 1}}, "features"),
    ({"token_ids": [5], "sampling_params": {"max_tokens": 2}, "bogus": 1}, "bogus"),
])
def test_generate_refusals_name_the_field(prime_server, body, field) -> None:
    r = post(prime_server, "/inference/v1/generate", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["field"] == field


def test_pause_holds_sampling_until_resume(prime_server) -> None:
    assert post(prime_server, "/pause", params={"mode": "keep", "clear_cache": "false"}).json() == {"status": "paused"}
    done: list[float] = []

    def generate() -> None:
        r = post(prime_server, "/inference/v1/generate", json={"token_ids": [4, 5], "sampling_params": {"max_tokens": 2}})
        assert r.status_code == 200
        done.append(time.monotonic())

    t = threading.Thread(target=generate)
    t.start()
    time.sleep(1.0)
    assert not done  # held while paused
    resumed = time.monotonic()
    assert post(prime_server, "/resume").json() == {"status": "resumed"}
    t.join(30)
    assert done and done[0] >= resumed
    assert post(prime_server, "/pause", params={"mode": "abort"}).status_code == 400


def test_update_weights_checks_the_published_version(prime_server, tmp_path: Path) -> None:
    client = prime_server.client()
    info = client.info()
    ok = publish(tmp_path, BroadcastMarker(step=1, weights_version=info.sampler_version, policy_step=info.step, model=info.model))
    r = post(prime_server, "/update_weights", json={"weight_dir": str(ok)})
    assert r.status_code == 200 and r.json()["step"] == 1
    ahead = publish(tmp_path, BroadcastMarker(step=2, weights_version=info.sampler_version + 5, policy_step=0, model="m"))
    assert post(prime_server, "/update_weights", json={"weight_dir": str(ahead)}).status_code == 409
    r = post(prime_server, "/update_weights", json={"weight_dir": str(tmp_path / "nowhere")})
    assert r.status_code == 400 and r.json()["field"] == "weight_dir"
    assert post(prime_server, "/update_weights", json={}).status_code == 400
    assert httpx.post(prime_server.url + "/pause").status_code == 401  # admin calls need the token
    assert httpx.get(prime_server.url + "/health").json() == {"status": "ok"}
    assert client.info().sampler_version == info.sampler_version  # nothing changed
    client.close()


def test_generate_takes_the_orchestrators_sampling_params(prime_server) -> None:
    """prime-rl's orchestrator adds top_k=-1, min_p=0 and return_token_ids=true to every policy
    env's sampling (its resolve_env_config) and a per-group cache_salt, and verifiers' training
    client (at prime-rl's pinned commit) forwards them all in `sampling_params` (seen on the real
    orchestrator's run, scripts/prime_rl/run_orchestrator.sh): accepted, and the same tokens and
    log-probs as the request without them (each changes nothing in floe)."""
    prompt = [5, 9, 13, 2, 7]
    base = {"max_tokens": 6, "temperature": 0.9, "logprobs": 1, "stop_token_ids": [], "seed": 11,
            "skip_special_tokens": False}
    plain = post(prime_server, "/inference/v1/generate", json={"token_ids": prompt, "sampling_params": base})
    orch = post(prime_server, "/inference/v1/generate", json={
        "token_ids": prompt, "sampling_params": {**base, "top_k": -1, "min_p": 0.0, "return_token_ids": True,
                                                   "cache_salt": "group-7"}})
    assert plain.status_code == 200, plain.text
    assert orch.status_code == 200, orch.text
    want, got = plain.json()["choices"][0], orch.json()["choices"][0]
    assert got["token_ids"] == want["token_ids"]
    assert [c["logprob"] for c in got["logprobs"]["content"]] == pytest.approx(
        [c["logprob"] for c in want["logprobs"]["content"]], abs=1e-6)


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory):
    """floe serve training a LoRA adapter, as `floe prime-rl` starts it for trainer.model.lora."""
    tmp = tmp_path_factory.mktemp("prime-lora")
    model = make_tiny(tmp / "tiny", hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    config = tmp / "serve.toml"
    config.write_text(f'[backend]\nmodel = "{model}"\nstate_dir = "{tmp / "states"}"\nseed = 0\n\n'
                      '[backend.lora]\nrank = 4\nalpha = 8.0\ntarget_modules = ["q_proj", "v_proj"]\n')
    proc = ServerProcess(config, free_port(), tmp / "server.log", token=TOKEN).wait_ready()
    yield proc
    proc.stop(signal.SIGKILL)


def test_load_lora_adapter_names_the_trained_policy(lora_server, prime_server, tmp_path: Path) -> None:
    """prime-rl's LoRA sync: after the trainer's step the orchestrator posts /load_lora_adapter
    (its adapter name, the published step) and then samples with model = that name. floe serve
    checks the step like /update_weights and serves the merged policy under the name."""
    client = lora_server.client()
    prompt, name = [5, 9, 13, 2, 7], "r4-a8.0"
    batch = floe.Batch([floe.Group(prompt, [floe.Sample(tokens=[3, 4, 6]), floe.Sample(tokens=[8, 2])])])
    client.forward_backward(batch)  # cross-entropy: any step that moves the adapter
    client.optim_step(lr=1e-2)
    version = client.sync_weights().version
    body = {"model": name, "token_ids": prompt,
            "sampling_params": {"max_tokens": 5, "temperature": 1.0, "logprobs": 1, "seed": 4}}
    unknown = post(lora_server, "/inference/v1/generate", json=body)
    assert unknown.status_code == 404 and unknown.json()["field"] == "model"  # not loaded yet

    ahead = publish(tmp_path, BroadcastMarker(step=2, weights_version=version + 1, policy_step=1, model="m"))
    r = post(lora_server, "/load_lora_adapter", json={"lora_name": name, "lora_path": str(ahead)})
    assert r.status_code == 409 and r.json()["field"] == "lora_path"
    assert post(lora_server, "/inference/v1/generate", json=body).status_code == 404  # a refused load names nothing
    bad = post(lora_server, "/load_lora_adapter", json={"lora_name": "a/../b", "lora_path": str(ahead)})
    assert bad.status_code == 400 and bad.json()["field"] == "lora_name"

    step = publish(tmp_path, BroadcastMarker(step=1, weights_version=version, policy_step=1, model="m"))
    anonymous = httpx.post(lora_server.url + "/load_lora_adapter", json={"lora_name": name, "lora_path": str(step)})
    assert anonymous.status_code == 401  # it reads the server's disk: the operator's call only
    r = post(lora_server, "/load_lora_adapter", json={"lora_name": name, "lora_path": str(step)})
    assert r.status_code == 200, r.text
    assert r.json()["step"] == 1 and r.json()["lora_name"] == name
    models = httpx.get(lora_server.url + "/v1/models", headers=lora_server.headers()).json()["data"]
    assert [m["id"] for m in models] == ["tiny", name] and models[1]["parent"] == "tiny"
    r = post(lora_server, "/inference/v1/generate", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    fwd = client.forward(floe.Batch([floe.Group(prompt, [floe.Sample(tokens=choice["token_ids"])])]))
    assert [c["logprob"] for c in choice["logprobs"]["content"]] == pytest.approx(fwd.logprobs[0][0], abs=1e-4)
    base = client.forward(floe.Batch([floe.Group(prompt, [floe.Sample(tokens=choice["token_ids"])])]), zone="reference")
    assert max(abs(a - b) for a, b in zip(fwd.logprobs[0][0], base.logprobs[0][0])) > 1e-4  # the adapter trained
    client.close()

    # a backend that trains every weight has no adapter to load
    r = post(prime_server, "/load_lora_adapter", json={"lora_name": name, "lora_path": str(step)})
    assert r.status_code == 400 and "[backend.lora]" in r.json()["message"]
