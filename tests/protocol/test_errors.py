"""Errors cross the wire unchanged: an operation's exception -> (status, JSON body) on the
server -> the same exception on the client; and every protocol error survives pickle."""

from __future__ import annotations

import pickle

import pytest

from floe.errors import FloeError, InvalidInput, StateError
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
