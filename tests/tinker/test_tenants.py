"""Keys sharing one server against a real `floe serve`: one key's backlog does not starve another
key (fair turns, a bound on queued work answered with the SDK's back-pressure status), access
to a published checkpoint ends for others' samplers when it is unpublished or deleted, and
refusals decidable from a request are answered at once naming the request's own fields."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from tests.tinker.conftest import API_KEY
from tests.tinker.wire import add_datum, request

pytestmark = pytest.mark.tinker

OTHER_KEY = "tml-floe-other"
KEYS = f'tinker_api_keys = ["{API_KEY}", "{OTHER_KEY}"]\n'


def _post(client: httpx.Client, key: str, path: str, body: dict | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        return client.post(f"/api/v1/{path}", content=body, headers={"X-API-Key": key})
    return client.post(f"/api/v1/{path}", json=body, headers={"X-API-Key": key})


def _answer(client: httpx.Client, key: str, request_id: str, polls: int | None = None) -> httpx.Response:
    """retrieve_future polled until it answers (not 408 try_again), at most `polls` times."""
    while (r := _post(client, key, "retrieve_future", {"request_id": request_id})).status_code == 408:
        if polls is not None:
            polls -= 1
            assert polls > 0, "no answer: the request is still waiting"
    return r


def _sampler(client: httpx.Client, key: str, model: Path) -> tuple[str, str]:
    """(session id, base-model sampler id) of a new session of `key`."""
    sid = _post(client, key, "create_session", {"tags": [], "user_metadata": {}}).json()["session_id"]
    made = _post(client, key, "create_sampling_session", {"session_id": sid, "sampling_session_seq_id": 0,
                                                          "base_model": str(model)})
    assert made.status_code == 200, made.text
    return sid, made.json()["sampling_session_id"]


def _sample_body(sampler: str, num: int, max_tokens: int, tokens: list[int] | None = None,
                 stop: list[int] | None = None) -> dict:
    params: dict = {"max_tokens": max_tokens, "stop": [] if stop is None else stop, "seed": 1}
    return {"sampling_session_id": sampler, "num_samples": num, "sampling_params": params,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens or [1, 2, 3]}]}}


def _fb_body(model_id: str, seq_id: int, tokens: list[int], targets: list[int]) -> bytes:
    msg = request("cross_entropy", model_id=model_id, seq_id=seq_id)
    add_datum(msg, tokens, {"target_tokens": targets})
    return msg.SerializeToString()


def _run(client: httpx.Client, key: str, session: str, model: Path) -> str:
    made = _post(client, key, "create_model", {"session_id": session, "model_seq_id": 0, "base_model": str(model),
                                               "lora_config": {"rank": 4}})
    assert made.status_code == 200, made.text
    assert _answer(client, key, made.json()["request_id"]).status_code == 200
    return made.json()["model_id"]


def test_one_keys_backlog_does_not_starve_another_key(tinker_server, tinker_model: Path) -> None:
    """B queues many long sample requests, then A sends one short one: A's turn comes after about
    one of B's per worker (fair turns, first-come model lock), so many of B's requests finish
    after A's; with one FIFO queue A waited for nearly all of them. Order only, no timings."""
    server = tinker_server(KEYS)
    backlog = 24
    with httpx.Client(base_url=server.url, timeout=60) as client:
        _, a = _sampler(client, API_KEY, tinker_model)
        _, b = _sampler(client, OTHER_KEY, tinker_model)
        b_ids = []
        for _ in range(backlog):
            sent = _post(client, OTHER_KEY, "asample", _sample_body(b, 16, 200))
            assert sent.status_code == 200, sent.text
            b_ids.append(sent.json()["request_id"])
        a_id = _post(client, API_KEY, "asample", _sample_body(a, 1, 2)).json()["request_id"]

    finished: list[str] = []
    lock = threading.Lock()

    def collect(key: str, rid: str) -> None:
        with httpx.Client(base_url=server.url, timeout=60) as own:
            assert _answer(own, key, rid).status_code == 200
        with lock:
            finished.append(rid)

    threads = [threading.Thread(target=collect, args=(OTHER_KEY, r)) for r in b_ids]
    threads.append(threading.Thread(target=collect, args=(API_KEY, a_id)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert len(finished) == backlog + 1
    after_a = backlog - finished.index(a_id)
    # Fair: A waits for at most the 8 workers' jobs and one more turn of B's; FIFO: A started only
    # after 17 of B's had finished, so at most 7 of B's could finish after it.
    assert after_a >= 11, f"only {after_a} of B's {backlog} requests finished after A's one request"


def test_queued_work_per_key_is_bounded_with_back_pressure(tinker_server, tinker_model: Path) -> None:
    """Requests a key has accepted but not started (here: forward_backward with gapped seq_ids,
    waiting for seq 1) count against [server] tinker_max_queued_per_key; the next one is refused
    at once with 429 (the SDK waits and resends); another key is not affected; when the run's
    session ends the waiting requests fail and no longer count."""
    server = tinker_server(KEYS + "tinker_max_queued_per_key = 3\nsequence_timeout_s = 600\n")
    with httpx.Client(base_url=server.url, timeout=60) as client:
        session, a = _sampler(client, API_KEY, tinker_model)
        model_id = _run(client, API_KEY, session, tinker_model)
        waiting = []
        for seq in (10, 11, 12):  # seq 1 never comes: these wait for their turn
            sent = _post(client, API_KEY, "forward_backward", _fb_body(model_id, seq, [1, 2, 3], [2, 3, 4]))
            assert sent.status_code == 200, sent.text
            waiting.append(sent.json()["request_id"])
        refused = _post(client, API_KEY, "forward_backward", _fb_body(model_id, 13, [1, 2, 3], [2, 3, 4]))
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"] == "too_many_requests"
        assert "tinker_max_queued_per_key" in refused.json()["message"]
        assert _post(client, API_KEY, "asample", _sample_body(a, 1, 2)).status_code == 429  # per key, any request
        _, b = _sampler(client, OTHER_KEY, tinker_model)
        other = _post(client, OTHER_KEY, "asample", _sample_body(b, 1, 2))
        assert other.status_code == 200 and _answer(client, OTHER_KEY, other.json()["request_id"]).status_code == 200

        assert _post(client, API_KEY, f"sessions/{session}/finish", {}).status_code == 200
        for rid in waiting:
            assert "closed" in _answer(client, API_KEY, rid).json()["error"]
        _, a2 = _sampler(client, API_KEY, tinker_model)
        again = _post(client, API_KEY, "asample", _sample_body(a2, 1, 2))
        assert again.status_code == 200 and _answer(client, API_KEY, again.json()["request_id"]).status_code == 200


def _status_of(call) -> int:
    """The HTTP status a failed SDK call raised with (0: it did not fail)."""
    import tinker  # noqa: PLC0415 - the SDK exists only in the tinker environment

    try:
        call()
    except tinker.APIStatusError as exc:
        return exc.status_code
    return 0


def test_a_sampler_on_a_checkpoint_ends_when_access_to_it_ends(tinker_server, tinker_service, tinker_model: Path) -> None:
    """B's sampling client on A's published sampler checkpoint stops when A unpublishes it (404,
    as for an unknown sampler, and it stays released after a re-publish); A's own sampler on it
    keeps sampling until A deletes the checkpoint; then both are refused (the weights are gone)."""
    from tinker import types  # noqa: PLC0415

    server = tinker_server(KEYS)
    a = tinker_service(server.url, API_KEY)
    b = tinker_service(server.url, OTHER_KEY)
    training = a.create_lora_training_client(base_model=str(tinker_model), rank=4).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3, 4]})
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = training.save_weights_for_sampler("shared").result().path
    rest_a = a.create_rest_client()
    rest_a.publish_checkpoint_from_tinker_path(path).result()
    prompt, params = types.ModelInput.from_ints([1, 2, 3]), types.SamplingParams(max_tokens=3, seed=1)
    own = a.create_sampling_client(model_path=path).result()
    theirs = b.create_sampling_client(model_path=path).result()
    want = own.sample(prompt, 1, params).result().sequences[0].tokens
    assert theirs.sample(prompt, 1, params).result().sequences[0].tokens == want

    rest_a.unpublish_checkpoint_from_tinker_path(path).result()
    assert _status_of(lambda: theirs.sample(prompt, 1, params).result()) == 404
    assert own.sample(prompt, 1, params).result().sequences[0].tokens == want  # the owner may still load it
    rest_a.publish_checkpoint_from_tinker_path(path).result()
    assert _status_of(lambda: theirs.sample(prompt, 1, params).result()) == 404  # released, not suspended
    again = b.create_sampling_client(model_path=path).result()
    assert again.sample(prompt, 1, params).result().sequences[0].tokens == want

    rest_a.delete_checkpoint_from_tinker_path(path).result()
    assert _status_of(lambda: again.sample(prompt, 1, params).result()) == 404
    assert _status_of(lambda: own.sample(prompt, 1, params).result()) == 404


def test_token_ids_outside_the_vocabulary_are_refused_at_once_naming_the_request_field(tinker_server,
                                                                                        tinker_model: Path) -> None:
    """A token id outside the base model's vocabulary (prompt, stop, a datum's input or target)
    is decidable from the request: 422 invalid_input at once, naming the field as the SDK sends
    it; nothing is queued, and a refused forward_backward's seq_id passes (the SDK sends the next
    one; the gap timeout here is 600 s, so waiting for it would not answer)."""
    server = tinker_server("sequence_timeout_s = 600\ntinker_long_poll_s = 1\n")
    with httpx.Client(base_url=server.url, timeout=60) as client:
        session, sampler = _sampler(client, API_KEY, tinker_model)
        two_chunks = _sample_body(sampler, 1, 2)
        two_chunks["prompt"]["chunks"] = [{"type": "encoded_text", "tokens": [1, 2]},
                                          {"type": "encoded_text", "tokens": [3, 4, 5, 10**6]}]
        cases = [(_sample_body(sampler, 1, 2, tokens=[10**9]), "prompt.chunks[0].tokens[0]"),
                 (_sample_body(sampler, 1, 2, tokens=[1, -1]), "prompt.chunks[0].tokens[1]"),
                 (_sample_body(sampler, 1, 2, tokens=[1, 2**70]), "prompt.chunks[0].tokens[1]"),
                 (two_chunks, "prompt.chunks[1].tokens[3]"),
                 (_sample_body(sampler, 1, 2, stop=[5, 10**9]), "sampling_params.stop[1]")]
        for body, field in cases:
            refused = _post(client, API_KEY, "asample", body)
            assert refused.status_code == 422, (field, refused.text)
            assert refused.json()["error"] == "invalid_input" and refused.json()["field"] == field, refused.text
            assert "vocabulary" in refused.json()["message"]

        model_id = _run(client, API_KEY, session, tinker_model)
        for tokens, targets, field in (([1, 10**6, 3], [2, 3, 4], "data[0].model_input.chunks[0].tokens[1]"),
                                       ([1, 2, 3], [2, 3, -4], "data[0].loss_fn_inputs.target_tokens[2]"),
                                       ([1, 2, 3], [2, 10**6, 4], "data[0].loss_fn_inputs.target_tokens[1]")):
            refused = _post(client, API_KEY, "forward_backward", _fb_body(model_id, 1, tokens, targets))
            assert refused.status_code == 422, (field, refused.text)
            assert refused.json()["field"] == field, refused.text
        fine = _post(client, API_KEY, "forward_backward", _fb_body(model_id, 2, [1, 2, 3], [2, 3, 4]))
        assert fine.status_code == 200, fine.text
        assert _answer(client, API_KEY, fine.json()["request_id"], polls=120).status_code == 200


def test_the_sdk_waits_out_back_pressure_and_every_sample_arrives(tinker_server, tinker_service, tinker_model: Path) -> None:
    """With a small tinker_max_queued_per_key, a burst of SDK samples (more than the workers take
    at once) meets 429s, which the SDK treats as back-pressure: it pauses and sends again, and
    every sample arrives."""
    import asyncio  # noqa: PLC0415

    from tinker import types  # noqa: PLC0415

    server = tinker_server("tinker_max_queued_per_key = 2\n")
    sampler = tinker_service(server.url, API_KEY).create_sampling_client(
        base_model=str(tinker_model)).result()
    params = types.SamplingParams(max_tokens=100, stop=[], seed=1)

    async def burst() -> list:
        return await asyncio.gather(*(sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 8, params)
                                      for _ in range(16)))

    results = asyncio.run(burst())
    assert all(len(r.sequences) == 8 and len(r.sequences[0].tokens) == 100 for r in results)
    log = server.log_path.read_text()
    assert '"path": "/api/v1/asample", "status": 429' in log  # the burst did meet the bound
