#!/usr/bin/env bash
# CI only (a CPU machine): import-only stand-ins for the GPU-only packages that prime-rl's
# orchestrator and env server import at module load, so that they start without a GPU. floe
# never ships or installs these for users; on a GPU machine prime-rl's own environment has the
# real packages.
#
#   bash scripts/prime_rl/cpu_stubs.sh DIR     then PYTHONPATH=DIR for prime-rl's processes
#
# The chain, at prime-rl 559b447: orchestrator/orchestrator.py -> orchestrator/watcher.py ->
# transports/weights/__init__.py imports every weight transport: filesystem.py -> trainer/lora.py
# -> trainer/models/__init__.py (every custom model: ring_flash_attn -> flash_attn, fla =
# flash-linear-attention, tilelang kernels, torchao's MoE expert parallel) and nccl.py (vllm's
# pynccl, pynvml). None of them is called by the orchestrator with the filesystem rollout
# transport and weight broadcast that floe's overlay selects.
#
# DIR/sitecustomize.py (Python imports it at start-up from PYTHONPATH) puts a finder first on
# sys.meta_path that answers exactly the names in STUBBED (and their submodules) with empty
# modules whose attributes are inert stand-ins (a stand-in called, indexed or subclassed gives
# another one: module-level decorators such as `@tilelang.jit(...)` load; nothing computes).
# Distribution metadata makes transformers see flash_attn 2.8.3 (ring_flash_attn checks it) and
# torchao 0.17.0: peft raises for a torchao below its 0.16 minimum, and the floe serve that
# `floe prime-rl` starts (the same environment) builds peft LoRA adapters (alphabet-sort); with
# it, peft asks whether a layer's weight is a torchao tensor (a stand-in class: never) and wraps
# the plain layer, and transformers uses torchao only for torchao quantization configs.
set -euo pipefail
STUBS=${1:?usage: cpu_stubs.sh DIR}
mkdir -p "$STUBS"
cat > "$STUBS/sitecustomize.py" <<'PY'
"""Import-only stand-ins for GPU-only packages (scripts/prime_rl/cpu_stubs.sh; CI on CPU only)."""

import importlib.abc
import importlib.machinery
import sys
import types

STUBBED = {"flash_attn", "ring_flash_attn", "fla", "tilelang", "vllm", "pynvml", "torchao"}


class _StandIn(type):
    """An inert name: attribute access, calls and indexing give another stand-in."""

    def __getattr__(cls, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _StandIn(attr, (), {})

    def __call__(cls, *args, **kwargs):
        return _StandIn(cls.__name__, (), {})

    def __getitem__(cls, key):
        return _StandIn(cls.__name__, (), {})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name, "import stub (scripts/prime_rl/cpu_stubs.sh)")
        module.__path__ = []

        def __getattr__(attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _StandIn(attr, (), {})

        module.__getattr__ = __getattr__
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _StubFinder())
PY
dist() {  # name version: an installed-distribution record for importlib.metadata
  mkdir -p "$STUBS/$1-$2.dist-info"
  printf 'Metadata-Version: 2.1\nName: %s\nVersion: %s\n' "$1" "$2" > "$STUBS/$1-$2.dist-info/METADATA"
  printf '%s\n' "$1" > "$STUBS/$1-$2.dist-info/top_level.txt"
}
dist flash_attn 2.8.3
rm -rf "$STUBS"/torchao-*.dist-info
dist torchao 0.17.0
