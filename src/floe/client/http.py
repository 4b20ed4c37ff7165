"""HTTP transport: the Client's operations against a remote `floe serve`, over httpx.

Each transport has a client id (a uuid) and numbers its calls 1, 2, 3, ... (headers
X-Floe-Client, X-Floe-Seq), so the server runs them in order and answers a retried call from
its cache instead of running it twice. Connection failures and 502/503/504 are retried with
exponential backoff, the same request id and the same bytes, until the call's `timeout`
(seconds, all attempts included) runs out; the first retry of a transport logs one warning
(logger "floe.client"), so a caller sees why a call is slow. Server-side InvalidInput and StateError are raised
here unchanged (same field, same message), so client code behaves as with an embedded backend.
A call that fails with RemoteUnavailable moves the transport to a fresh stream (new client id,
sequence from 1): the server may never have seen that number, and later calls would wait for it.
"""

from __future__ import annotations

import base64
import itertools
import logging
import os
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from floe.protocol import wire
from floe.protocol.errors import RemoteUnavailable, raise_remote_error

RETRY_STATUSES = frozenset({502, 503, 504})
log = logging.getLogger("floe.client")


class HttpTransport:
    """The operations of floe.protocol.ops.OPS as `POST /api/<op>` to a `floe serve` at `url`.

    token: the bearer token (default: $FLOE_TOKEN). timeout: seconds one call may take, all
    retries included (default 600); connect_timeout: seconds per connection attempt (10);
    backoff_initial / backoff_max: seconds between retries, doubling (0.1 up to 5).
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout: float = 600.0,
        connect_timeout: float = 10.0,
        backoff_initial: float = 0.1,
        backoff_max: float = 5.0,
        client_id: str | None = None,
    ):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.client_id = client_id or uuid.uuid4().hex
        token = token if token is not None else os.environ.get("FLOE_TOKEN")
        self._token = token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers)
        self._seq = itertools.count(1)
        self._seq_lock = threading.Lock()
        self._tokenizer: Any = None
        self._warned_retry = False  # the retry warning is logged once per transport

    def call(self, op: str, **kwargs: Any) -> Any:
        """Run `op` on the server; raises what the backend raised (InvalidInput, StateError),
        RemoteError for other refusals, RemoteUnavailable when the server stays unreachable."""
        body = wire.encode_request(op, kwargs)
        client_id, seq = self.next_request_id()
        headers = {"Content-Type": wire.MEDIA_TYPE, wire.CLIENT_HEADER: client_id, wire.SEQ_HEADER: str(seq)}
        try:
            response = self.request("POST", f"/api/{op}", content=body, headers=headers)
        except RemoteUnavailable:
            # The server may never have seen this sequence number; later calls would wait for it
            # forever. Continue on a fresh stream (new client id); this call's outcome is unknown.
            self._restart_stream(client_id)
            raise
        return wire.decode_result(op, response.content)

    def next_request_id(self) -> tuple[str, int]:
        """(client id, sequence number) of the next request, taken together under one lock so
        no request ever pairs one stream's id with another stream's number."""
        with self._seq_lock:
            return self.client_id, next(self._seq)

    def _restart_stream(self, failed_client_id: str) -> None:
        """Continue on a new stream after a call of stream `failed_client_id` was lost (once per
        stream: a second lost call of the same stream does not restart the new one)."""
        with self._seq_lock:
            if self.client_id == failed_client_id:
                self.client_id = uuid.uuid4().hex
                self._seq = itertools.count(1)

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One HTTP request with retries of transient failures; raises the server's error."""
        deadline = time.monotonic() + self.timeout
        delay = self.backoff_initial
        for attempt in itertools.count(1):
            remaining = deadline - time.monotonic()
            timeout = httpx.Timeout(max(remaining, 0.001), connect=min(self.connect_timeout, max(remaining, 0.001)))
            try:
                response = self._http.request(method, path, timeout=timeout, **kwargs)
            except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as e:
                failure = f"{type(e).__name__}: {e}"
            else:
                if response.status_code not in RETRY_STATUSES:
                    if response.is_success:
                        return response
                    raise_remote_error(response.status_code, _json_or_none(response))
                failure = f"HTTP {response.status_code}"
            if time.monotonic() + delay >= deadline:
                raise RemoteUnavailable(f"{method} {self.url}{path} failed {attempt} times within {self.timeout:g}s; last: {failure}")
            if not self._warned_retry:
                self._warned_retry = True
                log.warning("cannot reach %s (%s), retrying until %gs", self.url, failure, self.timeout)
            time.sleep(delay)
            delay = min(delay * 2, self.backoff_max)
        raise AssertionError("unreachable")

    def tokenizer(self) -> Any:
        """The server's tokenizer, rebuilt locally from its files (fetched once)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer  # noqa: PLC0415 - only clients that need text pay for it

            files = self.request("GET", "/tokenizer").json()["files"]
            with tempfile.TemporaryDirectory() as tmp:
                for name, item in files.items():
                    target = Path(tmp) / Path(name).name
                    if item["encoding"] == "base64":
                        target.write_bytes(base64.b64decode(item["data"]))
                    else:
                        target.write_text(item["data"], encoding="utf-8")
                self._tokenizer = AutoTokenizer.from_pretrained(tmp)
        return self._tokenizer

    def fork(self) -> HttpTransport:
        """A new ordered stream (its own client id and sequence) to the same server."""
        return HttpTransport(
            self.url, self._token, timeout=self.timeout, connect_timeout=self.connect_timeout,
            backoff_initial=self.backoff_initial, backoff_max=self.backoff_max,
        )

    def close(self) -> None:
        self._http.close()


def _json_or_none(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None
