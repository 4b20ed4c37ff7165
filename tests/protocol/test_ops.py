"""OPS is the one list of operations: every record has its Client method (same signature), its
AsyncClient coroutine, a wire round trip, a Backend method and a server route; and a record
added at run time is served through AsyncClient, the wire and a real server with no other
edit (Client's explicit methods are the one thing a new operation must add by hand, and the
check says so by name)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import floe
from floe.backend import Backend
from floe.backend.backend import as_batch
from floe.protocol import wire
from floe.protocol.codecs import BATCH
from floe.protocol.ops import OPS, define
from floe.types import Batch, Group, Sample

from .surface import missing_surface, serve_in_thread


@dataclasses.dataclass
class FakeResult:
    label: str
    num_sample_tokens: int
    step: int


def fake_op(batch: Batch | list[Group], label: str = "x") -> FakeResult: ...


class FakeBackend(Backend):
    """A real Backend with one more operation, which reads the batch and the policy's step."""

    def fake_op(self, batch: Batch | list[Group], label: str = "x") -> FakeResult:
        return FakeResult(label, as_batch(batch).num_sample_tokens, self.policy.step)


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = floe.BackendConfig(model=str(tiny_model), state_dir=str(tmp_path_factory.mktemp("states")))
    with serve_in_thread(FakeBackend(config)) as url:
        yield url


@pytest.fixture
def aclient(server: str) -> Iterator[floe.AsyncClient]:
    client = floe.connect_async(server, timeout=30)
    yield client
    asyncio.run(client.close())


@pytest.mark.parametrize("name", list(OPS))
def test_every_operation_has_its_surface(name: str, server: str, aclient: floe.AsyncClient) -> None:
    assert missing_surface(OPS[name], server, aclient) == []


def test_delete_state_is_an_operation() -> None:
    op = OPS["delete_state"]
    assert op.parameters == ("name",) and op.result is floe.StateResult and op.mutates


def test_a_registered_operation_is_served_without_other_edits(
    server: str, aclient: floe.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = Batch([Group([1, 2], [Sample([3, 4, 5]), Sample([6])])])
    assert httpx.post(f"{server}/api/fake_op", content=b"", timeout=30).status_code == 404  # not an operation yet
    assert not hasattr(aclient, "fake_op")

    monkeypatch.setitem(OPS, "fake_op", define(fake_op, zones={"policy"}, mutates=False, tensor_arg=("batch", BATCH)))

    # The wire carries it: the batch as tensors, the label as JSON, the result dataclass as JSON.
    body = wire.encode_request("fake_op", {"batch": batch, "label": "hi"})
    assert wire.decode_request("fake_op", body) == {"batch": batch, "label": "hi"}
    assert wire.decode_result("fake_op", wire.encode_result("fake_op", FakeResult("a", 2, 3))) == FakeResult("a", 2, 3)
    # The real server routes it to FakeBackend.fake_op.
    response = httpx.post(f"{server}/api/fake_op", content=body, headers={"Content-Type": wire.MEDIA_TYPE}, timeout=30)
    assert response.status_code == 200, response.text
    assert wire.decode_result("fake_op", response.content) == FakeResult("hi", 4, 0)
    # AsyncClient has a coroutine for it, with the operation's signature and defaults.
    assert asyncio.run(aclient.fake_op(batch)) == FakeResult("x", 4, 0)
    assert asyncio.run(aclient.fake_op(batch, label="async")) == FakeResult("async", 4, 0)
    with pytest.raises(TypeError):
        asyncio.run(aclient.fake_op(batch, colour="red"))
    # Everything but Client is derived; the check names exactly what is missing.
    assert missing_surface(OPS["fake_op"], server, aclient, FakeBackend) == ["Client has no method 'fake_op'"]


def test_an_operation_the_backend_lacks_is_refused_by_name(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def not_here(name: str) -> FakeResult: ...

    monkeypatch.setitem(OPS, "not_here", define(not_here, zones=set(), mutates=False))
    body = wire.encode_request("not_here", {"name": "a"})
    response = httpx.post(f"{server}/api/not_here", content=body, timeout=30)
    assert response.status_code == 501 and "'not_here'" in response.json()["message"]


def test_unknown_operations_are_refused_everywhere(server: str, aclient: floe.AsyncClient) -> None:
    with pytest.raises(floe.InvalidInput) as e:
        wire.encode_request("nope", {})
    assert e.value.field == "op" and "delete_state" in e.value.message
    response = httpx.post(f"{server}/api/nope", content=b"", timeout=30)
    assert response.status_code == 404 and "no operation 'nope'" in response.json()["message"]
    with pytest.raises(AttributeError):
        aclient.nope  # noqa: B018


def test_define_rejects_incomplete_records() -> None:
    def untyped(x) -> int: ...  # type: ignore[no-untyped-def]

    def no_result(x: int): ...  # type: ignore[no-untyped-def]

    def positional_only(x: int, /) -> int: ...

    for fn, words in [(untyped, "parameter 'x' needs a type annotation"), (no_result, "result type needs an annotation"),
                      (positional_only, "must be callable by keyword")]:
        with pytest.raises(ValueError, match=words):
            define(fn, zones=set(), mutates=False)
    with pytest.raises(ValueError, match="zones"):
        define(fake_op, zones={"gpu"}, mutates=False)
    with pytest.raises(ValueError, match="tensor argument 'prompts'"):
        define(fake_op, zones=set(), mutates=False, tensor_arg=("prompts", BATCH))
