"""The one interface every transport implements: run a named operation, return its result.

Operations and their keyword arguments are exactly the Client's methods. A transport moves
typed requests and results (floe.types) and nothing else; in-process, HTTP and Ray
transports are interchangeable behind `Client`.
"""

from __future__ import annotations

from typing import Any, Protocol

OPERATIONS = (
    "sample",
    "forward",
    "forward_backward",
    "optim_step",
    "sync_weights",
    "save_state",
    "load_state",
    "list_states",
    "export_hf",
    "info",
)


class Transport(Protocol):
    def call(self, op: str, **kwargs: Any) -> Any:
        """Run operation `op` and return its typed result; raises floe errors unchanged."""

    def tokenizer(self) -> Any:
        """The model's tokenizer (a transformers tokenizer), for the text edges."""

    def fork(self) -> "Transport":
        """An independent ordered stream to the same backend (e.g. a sampler thread's)."""

    def close(self) -> None: ...
