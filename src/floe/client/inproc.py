"""In-process transport: calls the Backend directly (the default placement)."""

from __future__ import annotations

from typing import Any

from floe.backend import Backend
from floe.client.transport import OPERATIONS
from floe.config import BackendConfig


class InprocTransport:
    def __init__(self, config: BackendConfig):
        self.backend = Backend(config)

    def call(self, op: str, **kwargs: Any) -> Any:
        if op not in OPERATIONS:
            raise ValueError(f"unknown operation {op!r}")
        return getattr(self.backend, op)(**kwargs)

    def tokenizer(self) -> Any:
        return self.backend.tokenizer

    def fork(self) -> "InprocTransport":
        # The backend orders work per zone itself; an in-process stream needs no new state.
        return self

    def close(self) -> None:
        pass
