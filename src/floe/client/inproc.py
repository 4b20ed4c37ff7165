"""In-process transport: calls the Backend directly (the default placement)."""

from __future__ import annotations

from typing import Any

from floe.backend import Backend
from floe.config import BackendConfig
from floe.errors import InvalidInput
from floe.protocol.ops import get_op


class InprocTransport:
    """Runs each operation as `Backend.<op>(**kwargs)` on a Backend built from `config`."""

    def __init__(self, config: BackendConfig, *, _shared: Backend | None = None):
        # A fork shares its parent's Backend and does not own it: closing a fork leaves it open.
        self._owner = _shared is None
        self.backend = Backend(config) if _shared is None else _shared

    def call(self, op: str, **kwargs: Any) -> Any:
        """Run `op`; InvalidInput("op") when it is not an operation in OPS."""
        get_op(op)
        method = getattr(self.backend, op, None)
        if not callable(method):
            raise InvalidInput("op", f"operation {op!r} is in floe.protocol.ops.OPS but the backend has no method for it")
        return method(**kwargs)

    def tokenizer(self) -> Any:
        return self.backend.tokenizer

    def fork(self) -> InprocTransport:
        # The backend orders work per zone itself; an in-process stream needs no new state.
        return InprocTransport(self.backend.config, _shared=self.backend)

    def close(self) -> None:
        if self._owner:
            self.backend.close()
