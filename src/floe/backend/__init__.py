"""The backend and its zones: policy (training), sampler (generation), reference (frozen).

`Backend` is imported on first use (PEP 562), so `floe.backend.state` and the other light
modules of this package (the CLI's state listing, `floe serve --resume-from`'s check) import
without the model stack that `floe.backend.backend` pulls in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from floe.backend.backend import Backend

__all__ = ["Backend"]


def __getattr__(name: str) -> Any:
    if name == "Backend":
        from floe.backend.backend import Backend  # noqa: PLC0415 - on first use (module docstring)

        return Backend
    raise AttributeError(f"module 'floe.backend' has no attribute {name!r}")
