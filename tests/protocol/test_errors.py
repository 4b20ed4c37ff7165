"""Errors cross the wire unchanged: an operation's exception -> (status, JSON body) on the
server -> the same exception on the client; and every protocol error survives pickle."""

from __future__ import annotations

import pickle

import pytest

from floe.errors import FloeError, InvalidInput, StateError, WorkerFailed
from floe.protocol.errors import RemoteError, RemoteUnavailable, WireError, error_body, raise_remote_error


@pytest.mark.parametrize("error", [
    RemoteError(401, "unauthorized", "missing bearer token"),
    RemoteUnavailable("POST http://x/api/info failed 3 times within 1s"),
    WireError("body.tokens", "is missing"),
])
def test_errors_survive_pickle(error: FloeError) -> None:
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error) and vars(back) == vars(error)


@pytest.mark.parametrize("error, status, expected", [
    (InvalidInput("batch.groups[0].prompt", "must not be empty"), 422, InvalidInput),
    (WireError("body.group_sizes", "is missing"), 400, InvalidInput),
    (StateError("load_state: no saved state at /s/x"), 409, StateError),
])
def test_operation_errors_come_back_as_themselves(error: Exception, status: int, expected: type) -> None:
    code, body = error_body(error)
    assert code == status
    with pytest.raises(expected) as e:
        raise_remote_error(code, body)
    assert str(e.value) == str(error)
    if isinstance(error, InvalidInput):
        assert (e.value.field, e.value.message) == (error.field, error.message)  # type: ignore[attr-defined]


def test_other_failures_become_remote_errors() -> None:
    code, body = error_body(RuntimeError("boom"))
    assert (code, body) == (500, {"error": "internal_error", "message": "RuntimeError: boom"})
    with pytest.raises(RemoteError) as e:
        raise_remote_error(code, body)
    assert (e.value.status, e.value.error, e.value.message) == (500, "internal_error", "RuntimeError: boom")
    with pytest.raises(RemoteError) as e:
        raise_remote_error(502, None)  # not JSON at all
    assert (e.value.status, e.value.error, e.value.message) == (502, "http_error", "HTTP 502")


def test_a_401_says_how_to_give_the_token() -> None:
    with pytest.raises(RemoteError) as e:
        raise_remote_error(401, {"error": "unauthorized", "message": "missing or wrong bearer token"})
    assert (e.value.status, e.value.error) == (401, "unauthorized")
    assert e.value.message == ("missing or wrong bearer token; set $FLOE_TOKEN or pass token= to floe.connect "
                               "(backend.token in a recipe) to the server's token")
    back = pickle.loads(pickle.dumps(e.value))
    assert type(back) is RemoteError and str(back) == str(e.value) and vars(back) == vars(e.value)
    with pytest.raises(RemoteError) as e:
        raise_remote_error(403, {"error": "forbidden", "message": "no"})
    assert e.value.message == "no"  # only a 401 is about the token


def test_worker_failed_keeps_its_type_zone_and_rank_over_the_wire() -> None:
    error = WorkerFailed("sampler", 1, "the worker (pid 42) died (SYSTEM_ERROR); close this backend")
    code, body = error_body(error)
    assert code == 409
    assert body == {"error": "state_error", "message": str(error), "zone": "sampler", "rank": 1}
    with pytest.raises(WorkerFailed) as e:
        raise_remote_error(code, body)
    assert (e.value.zone, e.value.rank, e.value.message, str(e.value)) == ("sampler", 1, error.message, str(error))
    assert isinstance(e.value, StateError)  # `except StateError` still catches it
    with pytest.raises(StateError) as plain:  # a state_error without a worker stays a plain StateError
        raise_remote_error(409, {"error": "state_error", "message": "x", "zone": "sampler"})
    assert type(plain.value) is StateError


def test_the_server_answer_for_worker_failed_carries_zone_and_rank() -> None:
    from floe.server.errors import to_api_error  # noqa: PLC0415 - the server's side of the same mapping

    error = WorkerFailed("policy", 1, "no answer within call_timeout_s = 5 s")
    api = to_api_error(error)
    assert api.status == 409 and api.body() == error_body(error)[1]
    with pytest.raises(WorkerFailed) as e:
        raise_remote_error(api.status, api.body())
    assert (e.value.zone, e.value.rank, str(e.value)) == ("policy", 1, str(error))
