"""The backend and its zones: policy (training), sampler (generation), reference (frozen)."""

from floe.backend.backend import Backend

__all__ = ["Backend"]
