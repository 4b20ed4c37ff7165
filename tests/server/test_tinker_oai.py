"""Tinker's OpenAI-compatible routes (`/oai/api/v1`) against a real `floe serve` with two Tinker
keys, driven by the real `openai` SDK (the key as a Bearer token, as the SDK sends it); the
Tinker side is set up over raw HTTP (no tinker SDK needed, so this runs in the core suite;
it lives here, not in tests/tinker, whose suite runs in the SDK's env, which has no openai).

Covers: a base model id, a key's own `tinker://.../sampler_weights/...` path and `<base>;<path>`
(the checkpoint's samples, equal to the native Tinker sampler's), streaming equal to the whole
answer, and the cross-key attack: another key's checkpoint answers exactly like a path that
does not exist (404 model_not_found), streamed or not, until it is published."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from floe.models import make_tiny
from floe.server.protocols.tinker import schema
from tests.tinker.conftest import API_KEY, start_tinker_server

OTHER_KEY = "tml-floe-oai-other"
KEYS = f'tinker_api_keys = ["{API_KEY}", "{OTHER_KEY}"]\n'


def _post(client: httpx.Client, key: str, path: str, body: dict) -> httpx.Response:
    return client.post(f"/api/v1/{path}", json=body, headers={"X-API-Key": key})


def _answer(client: httpx.Client, key: str, request_id: str) -> dict:
    while (r := _post(client, key, "retrieve_future", {"request_id": request_id})).status_code == 408:
        pass
    assert r.status_code == 200, r.text
    return r.json()


def _checkpoint(server_url: str, key: str, model: Path, name: str) -> str:
    """A LoRA run of `key` on `model`, its fresh weights saved for sampling as `name`; the tinker:// path."""
    with httpx.Client(base_url=server_url, timeout=120) as client:
        sid = _post(client, key, "create_session", {"tags": [], "user_metadata": {}}).json()["session_id"]
        made = _post(client, key, "create_model", {"session_id": sid, "model_seq_id": 0, "base_model": str(model),
                                                   "lora_config": {"rank": 4}})
        assert made.status_code == 200, made.text
        model_id = made.json()["model_id"]
        _answer(client, key, made.json()["request_id"])
        saved = _post(client, key, "save_weights_for_sampler", {"model_id": model_id, "path": name, "seq_id": 1})
        assert saved.status_code == 200, saved.text
        return _answer(client, key, saved.json()["request_id"])["path"]


@pytest.fixture(scope="module")
def tinker_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("oai-models") / "a" / "tiny", hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, tinker_model: Path):
    server = start_tinker_server(tmp_path_factory.mktemp("oai"), tinker_model, KEYS)
    path = _checkpoint(server.url, API_KEY, tinker_model, "oai-a")
    mine = openai.OpenAI(base_url=f"{server.url}/oai/api/v1", api_key=API_KEY, max_retries=0, timeout=120)
    theirs = openai.OpenAI(base_url=f"{server.url}/oai/api/v1", api_key=OTHER_KEY, max_retries=0, timeout=120)
    yield server, path, mine, theirs
    mine.close()
    theirs.close()
    server.stop()


def test_models_lists_the_base_models(setup, tinker_model: Path) -> None:
    _, _, mine, _ = setup
    assert str(tinker_model) in [m.id for m in mine.models.list()]


def test_base_model_and_own_checkpoint_sample_and_stream(setup, tinker_model: Path) -> None:
    _, path, mine, _ = setup
    for model in (str(tinker_model), path, f"{tinker_model};{path}"):
        whole = mine.completions.create(model=model, prompt="ab", max_tokens=8, n=2, seed=3, logprobs=0)
        assert whole.model == model and len(whole.choices) == 2
        chunks = list(mine.completions.create(model=model, prompt="ab", max_tokens=8, n=2, seed=3, logprobs=0,
                                              stream=True))
        for choice in whole.choices:
            mine_chunks = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
            assert "".join(c.text for c in mine_chunks) == choice.text
            assert [t for c in mine_chunks for t in c.model_extra["token_ids"]] == choice.model_extra["token_ids"]
            assert [lp for c in mine_chunks if c.logprobs for lp in c.logprobs.token_logprobs] == \
                choice.logprobs.token_logprobs
        chat = mine.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                            seed=2)
        streamed = mine.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                                seed=2, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == chat.choices[0].message.content


def test_a_checkpoint_samples_as_the_native_tinker_sampler_does(setup, tinker_model: Path) -> None:
    """Same seed, same prompt: the OpenAI route's tokens for a checkpoint are those the native
    Tinker sampler (`asample`) of the same checkpoint gives."""
    server, path, mine, _ = setup
    out = mine.completions.create(model=path, prompt=[1, 2, 3], max_tokens=6, seed=5, extra_body={"ignore_eos": True})
    with httpx.Client(base_url=server.url, timeout=120) as client:
        sid = _post(client, API_KEY, "create_session", {"tags": [], "user_metadata": {}}).json()["session_id"]
        sampler = _post(client, API_KEY, "create_sampling_session",
                        {"session_id": sid, "sampling_session_seq_id": 0, "model_path": path}).json()
        assert "sampling_session_id" in sampler, sampler
        rid = _post(client, API_KEY, "asample", {
            "sampling_session_id": sampler["sampling_session_id"], "num_samples": 1,
            "sampling_params": {"max_tokens": 6, "seed": 5, "stop": []},
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}}).json()["request_id"]
        while (r := _post(client, API_KEY, "retrieve_future", {"request_id": rid})).status_code == 408:
            pass
    assert r.status_code == 200
    native = schema.SampleResponse.FromString(r.content).sequences[0]
    assert out.choices[0].model_extra["token_ids"] == np.frombuffer(native.tokens, dtype=np.int32).tolist()
    assert out.choices[0].logprobs is None


@pytest.mark.parametrize("stream", [False, True])
def test_another_keys_checkpoint_is_not_found_like_a_missing_one(setup, tinker_model: Path, stream: bool) -> None:
    server, path, _, theirs = setup
    missing = path.rsplit("/", 1)[0] + "/never-made"
    errors = {}
    for name, model in (("theirs", path), ("missing", missing), ("theirs-with-base", f"{tinker_model};{path}")):
        with pytest.raises(openai.NotFoundError) as caught:
            out = theirs.completions.create(model=model, prompt="ab", max_tokens=2, stream=stream)
            if stream:
                list(out)
        errors[name] = caught.value
    for e in errors.values():
        assert e.status_code == 404 and e.code == "model_not_found" and e.param == "model"
    # Nothing tells a foreign checkpoint from a missing one but the path the caller gave.
    assert errors["theirs"].message.replace(path, "X") == errors["missing"].message.replace(missing, "X")
    # The raw route, with the key as X-API-Key too: the same 404.
    r = httpx.post(f"{server.url}/oai/api/v1/chat/completions", headers={"X-API-Key": OTHER_KEY},
                   json={"model": path, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_credentials_and_base_mismatch(setup, tinker_model: Path) -> None:
    server, path, _, _ = setup
    r = httpx.post(f"{server.url}/oai/api/v1/completions", json={"model": str(tinker_model), "prompt": "a"}, timeout=60)
    assert r.status_code == 401
    r = httpx.post(f"{server.url}/oai/api/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": f"some-other-base;{path}", "prompt": "a", "max_tokens": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    # A Tinker key still opens only the Tinker routes: /v1 (the operator's) refuses it.
    r = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"prompt": "a"}, timeout=60)
    assert r.status_code == 403


def test_oai_requests_count_against_the_keys_queue_bound(tmp_path: Path, tinker_model: Path) -> None:
    """The `/oai` routes take their turn in the key's queue like `asample`: with the key's
    [server] tinker_max_queued_per_key filled by requests waiting for their turn (forward_backward
    with gapped seq_ids, waiting for seq 1), an `/oai` completion is refused at once with 429,
    and another key's is answered; so no key steps around the bound through `/oai`."""
    from tests.tinker.wire import add_datum, request

    server = start_tinker_server(tmp_path, tinker_model, KEYS + "tinker_max_queued_per_key = 2\n"
                                 "sequence_timeout_s = 600\n")
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            sid = _post(client, API_KEY, "create_session", {"tags": [], "user_metadata": {}}).json()["session_id"]
            made = _post(client, API_KEY, "create_model", {"session_id": sid, "model_seq_id": 0,
                                                           "base_model": str(tinker_model), "lora_config": {"rank": 4}})
            _answer(client, API_KEY, made.json()["request_id"])
            for seq in (10, 11):  # seq 1 never comes: these wait for their turn
                msg = request("cross_entropy", model_id=made.json()["model_id"], seq_id=seq)
                add_datum(msg, [1, 2, 3], {"target_tokens": [2, 3, 4]})
                sent = client.post("/api/v1/forward_backward", content=msg.SerializeToString(),
                                   headers={"X-API-Key": API_KEY})
                assert sent.status_code == 200, sent.text
            body = {"model": str(tinker_model), "prompt": "ab", "max_tokens": 2}
            refused = client.post("/oai/api/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
            assert refused.status_code == 429, refused.text
            assert "tinker_max_queued_per_key" in refused.json()["error"]["message"]
            other = client.post("/oai/api/v1/completions", json=body, headers={"Authorization": f"Bearer {OTHER_KEY}"})
            assert other.status_code == 200 and len(other.json()["choices"]) == 1
    finally:
        server.stop()
