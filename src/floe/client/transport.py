"""The one interface every transport implements: run a named operation, return its result.

The operations and their keyword arguments are floe.protocol.ops.OPS (the Client's methods).
A transport moves typed requests and results (floe.types) and nothing else; in-process, HTTP
and Ray transports are interchangeable behind `Client`.
"""

from __future__ import annotations

from typing import Any, Protocol


class Transport(Protocol):
    def call(self, op: str, **kwargs: Any) -> Any:
        """Run operation `op` and return its typed result; raises floe errors unchanged."""
        ...

    def tokenizer(self) -> Any:
        """The model's tokenizer (a transformers tokenizer), for the text edges."""
        ...

    def fork(self) -> Transport:
        """An independent ordered stream to the same backend (e.g. a sampler thread's)."""
        ...

    def close(self) -> None:
        """Release what the transport holds (connections); the backend itself stays up."""
        ...
