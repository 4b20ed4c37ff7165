"""Every floe error class survives pickle (Ray moves exceptions between processes): the same
type, message and attributes. Classes are discovered by importing every floe module that needs
no optional stack, so a new error class without an example here fails, naming itself."""

from __future__ import annotations

import importlib
import pickle
import pkgutil

import pytest

import floe
from floe.errors import FloeError

# Modules that import an optional stack at import time; their errors (if any) are floe's own
# classes re-used, never new ones.
OPTIONAL = ("floe.integrations.verl.plugin", "floe.integrations.verl.bypass", "floe.integrations.verl.schedule",
            "floe.integrations.verl.throughput", "floe.integrations.verl.one_step", "floe.integrations.verl.fully_async",
            "floe.integrations.skyrl.dispatch", "floe.integrations.skyrl.entrypoint",
            "floe.integrations.skyrl.fully_async",
            "floe.integrations.skyrl.inference", "floe.sampler.vllm_engine", "floe.integrations.prime_rl",
            "floe.placement.ray")

EXAMPLES: dict[str, tuple] = {
    "FloeError": ("something failed",),
    "InvalidInput": ("batch.groups[0].prompt", "must not be empty"),
    "NotFound": ("model_id", "no training run 'x' for this key"),
    "StateError": ("load_state: no saved state at /s/x",),
    "WireError": ("body.tokens", "is missing"),
    "RemoteError": (401, "unauthorized", "missing bearer token"),
    "RemoteUnavailable": ("POST http://x/api/info failed 3 times within 1s",),
    "InvalidReward": ("reverse_text", "task-7", "step", "nan"),
    "WorkerFailed": ("sampler", 1, "the actor died (ray.kill or a crash)"),
}


def _all_error_classes() -> list[type[FloeError]]:
    for info in pkgutil.walk_packages(floe.__path__, "floe."):
        if not info.name.startswith(OPTIONAL):
            importlib.import_module(info.name)
    seen: list[type[FloeError]] = []
    todo = [FloeError]
    while todo:
        cls = todo.pop()
        seen.append(cls)
        todo.extend(c for c in cls.__subclasses__() if c.__module__.startswith("floe."))
    return seen


@pytest.mark.parametrize("cls", _all_error_classes(), ids=lambda c: c.__name__)
def test_every_floe_error_survives_pickle(cls: type[FloeError]) -> None:
    assert cls.__name__ in EXAMPLES, f"{cls.__module__}.{cls.__name__}: add constructor arguments to EXAMPLES"
    error = cls(*EXAMPLES[cls.__name__])
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is cls and str(back) == str(error)
    assert vars(back) == vars(error)
