"""Which floe backend a verl run uses: the recipe's optional `floe` block (pure; no verl import).

    floe:                      # add with Hydra's `+floe.<key>=...`; every key optional
      url: null                # a `floe serve` URL; null: the plugin starts its own backend
      token: null              # that server's bearer token (default: $FLOE_TOKEN)
      timeout_s: 600           # HTTP timeout of one call, seconds
      backend: {}              # BackendConfig keys for the plugin's own backend (e.g. num_threads)
      rollout_chunk_tokens: 32 # verl's fully-async partial rollouts: tokens per floe `sample` call
                               # of a response; a sync interrupts a response between two chunks

With no `url` (the default) the plugin runs `floe serve` on loopback for the length of the
run, on `actor_rollout_ref.model.path`, with the actor's optimizer mapped onto floe's
(table below) and a fresh token; verl's trainer and rollout processes all talk to it. With a
`url` the server's own configuration rules (its model and optimizer settings are whatever it
was started with; each optim_step's learning rate is still the recipe's schedule, schedule.py).

| verl key (actor_rollout_ref.actor.optim.*)  | floe BackendConfig.optimizer                  |
|---------------------------------------------|-----------------------------------------------|
| optimizer = AdamW, optimizer_impl = torch.optim (others refused) | AdamW                    |
| lr, betas, weight_decay, clip_grad (or the deprecated grad_clip, which verl copies over it) | lr, betas, weight_decay, grad_clip |
| override_optimizer_config.{lr, betas, weight_decay, eps} (win, as in verl's build_optimizer); amsgrad / maximize false only; foreach / fused / capturable / differentiable no effect on a number; other keys refused | the same keys |
| lr_scheduler_type (constant, cosine), lr_warmup_steps(_ratio), min_lr_ratio, num_cycles, zero_indexed_step | verl's own scheduler in the plugin (schedule.py), stepped once per training step; each optim_step carries its rate |

The device, dtype, memory and engine keys of the recipe (`trainer.device`, the FSDP dtype,
offload, `rollout.name` and its vLLM settings, ...) become the rest of that BackendConfig
(hardware.py); `floe.backend` keys are applied last, on top of both.

Unknown keys in the block, and verl settings floe cannot honour, raise InvalidInput naming
the key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from floe.config import BackendConfig, parse_config
from floe.errors import InvalidInput
from floe.integrations.hardware import with_overrides
from floe.integrations.verl.hardware import VerlHardware, verl_hardware

_BLOCK_KEYS = {"url", "token", "timeout_s", "backend", "rollout_chunk_tokens"}
DEFAULT_CHUNK_TOKENS = 32
OPTIM = "actor_rollout_ref.actor.optim"


@dataclass(frozen=True)
class FloeTarget:
    """Where the plugin's floe backend is: `url` (+ `token`) of a running server, or, when
    `url` is None, the BackendConfig dict (`backend`) of the server the plugin starts;
    `hardware`: what the recipe's device, precision and engine keys ask for (hardware.py)."""

    url: str | None
    token: str | None
    timeout_s: float
    backend: dict[str, Any] | None
    hardware: VerlHardware
    # verl's fully-async partial rollouts (fully_async.py): a response is generated this many
    # tokens per floe `sample` call, so verl's abort at a sync returns the tokens so far
    rollout_chunk_tokens: int = DEFAULT_CHUNK_TOKENS


# torch.optim.AdamW keyword arguments `override_optimizer_config` may set: floe's optimizer keys
# of the same names; variants floe's AdamW lacks (accepted only false); how, not what, AdamW computes
_ADAMW_MAPPED = ("lr", "weight_decay", "betas", "eps")
_ADAMW_OFF = ("amsgrad", "maximize")
_ADAMW_IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")


def _number(value: Any, key: str, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            positive and value <= 0):
        raise InvalidInput(key, f"must be a finite number{' > 0' if positive else ''}, got {value!r}")
    return float(value)


def _betas(value: Any, key: str) -> tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise InvalidInput(key, f"must be two numbers, got {value!r}")
    return (_number(value[0], key), _number(value[1], key))


def _optimizer(optim: Mapping[str, Any]) -> dict[str, Any]:
    """floe's optimizer table from verl's `actor.optim` (FSDPOptimizerConfig and verl's
    `build_optimizer`: AdamW of torch.optim on lr, weight_decay, betas, then
    `override_optimizer_config` over them; the deprecated `grad_clip` replaces `clip_grad`)."""
    name = optim.get("optimizer", "AdamW")
    if name != "AdamW":
        raise InvalidInput(f"{OPTIM}.optimizer", f"floe's policy zone trains with AdamW, got {name!r}")
    impl = optim.get("optimizer_impl", "torch.optim")
    if impl != "torch.optim":
        raise InvalidInput(f"{OPTIM}.optimizer_impl", f"floe's policy zone trains with torch.optim's AdamW, got {impl!r}")
    out: dict[str, Any] = {}
    for key in ("lr", "weight_decay"):
        if optim.get(key) is not None:
            out[key] = _number(optim[key], f"{OPTIM}.{key}")
    clip_key = "grad_clip" if optim.get("grad_clip") is not None else "clip_grad"
    if optim.get(clip_key) is not None:
        out["grad_clip"] = _number(optim[clip_key], f"{OPTIM}.{clip_key}", positive=True)
    if optim.get("betas") is not None:
        out["betas"] = _betas(optim["betas"], f"{OPTIM}.betas")
    overrides = optim.get("override_optimizer_config") or {}
    for key, value in overrides.items():
        where = f"{OPTIM}.override_optimizer_config.{key}"
        if key in _ADAMW_IMPLEMENTATION:
            continue
        if key in _ADAMW_OFF:
            if value:
                raise InvalidInput(where, "floe's AdamW has no such variant; set it false")
        elif key not in _ADAMW_MAPPED:
            raise InvalidInput(where, f"not a torch.optim.AdamW argument floe's optimizer takes "
                                      f"({sorted(_ADAMW_MAPPED + _ADAMW_OFF)} and {list(_ADAMW_IMPLEMENTATION)})")
        elif key == "betas":
            out["betas"] = _betas(value, where)
        else:
            out[key] = _number(value, where, positive=key in ("lr", "eps"))
    scheduler_type(optim)
    for key, lo in (("lr_warmup_steps", None), ("lr_warmup_steps_ratio", 0.0), ("min_lr_ratio", 0.0), ("num_cycles", 0.0)):
        value = optim.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
                lo is not None and value < lo) or (key.endswith("ratio") and value > 1):
            raise InvalidInput(f"{OPTIM}.{key}", f"must be a finite number{' in [0, 1]' if key.endswith('ratio') else ''}"
                               f"{' >= 0' if key == 'num_cycles' else ''}, got {value!r}")
    # verl's schedule runs in the plugin (schedule.VerlSchedule) and sets each optim_step's rate.
    out["schedule"] = "constant"
    return out


def scheduler_type(optim: Mapping[str, Any]) -> str:
    """verl's `lr_scheduler_type` (or the deprecated `warmup_style`, which verl copies over it):
    "constant" or "cosine", the two verl's FSDP engine builds; InvalidInput naming the key."""
    key = "warmup_style" if optim.get("warmup_style") is not None else "lr_scheduler_type"
    kind = optim.get(key, "constant")
    if kind not in ("constant", "cosine"):
        raise InvalidInput(f"{OPTIM}.{key}", f"verl's FSDP engine schedules 'constant' or 'cosine', got {kind!r}")
    return str(kind)


def floe_target(config: Mapping[str, Any]) -> FloeTarget:
    """The floe backend a verl config (the whole resolved config, as plain dicts) asks for.

    Raises InvalidInput("floe.<key>") for an unknown key or a bad value in the `floe` block,
    and InvalidInput naming the verl key for optimizer settings floe cannot honour.
    """
    block = config.get("floe") or {}
    if not isinstance(block, Mapping):
        raise InvalidInput("floe", f"must be a mapping with keys {sorted(_BLOCK_KEYS)}, got {block!r}")
    unknown = sorted(set(block) - _BLOCK_KEYS)
    if unknown:
        raise InvalidInput(f"floe.{unknown[0]}", f"unknown key; the floe block has {sorted(_BLOCK_KEYS)}")
    timeout = block.get("timeout_s", 600)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise InvalidInput("floe.timeout_s", f"must be a number of seconds > 0, got {timeout!r}")
    chunk = block.get("rollout_chunk_tokens", DEFAULT_CHUNK_TOKENS)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise InvalidInput("floe.rollout_chunk_tokens", f"must be a whole number of tokens >= 1, got {chunk!r}")
    url = block.get("url")
    token = block.get("token")
    overrides = block.get("backend") or {}
    if not isinstance(overrides, Mapping):
        raise InvalidInput("floe.backend", f"must be a mapping of BackendConfig keys, got {overrides!r}")
    hardware = verl_hardware(config, overrides.get("device"))
    if url is not None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise InvalidInput("floe.url", f"must be an http(s):// URL of a `floe serve`, got {url!r}")
        if overrides:
            raise InvalidInput("floe.backend", "configures the plugin's own backend; a floe.url server has its own "
                               "configuration: drop one of them")
        return FloeTarget(url.rstrip("/"), token, float(timeout), None, hardware, chunk)
    if token is not None:
        raise InvalidInput("floe.token", "is for a floe.url server; the plugin's own backend gets a fresh token")
    aro = config.get("actor_rollout_ref") or {}
    model = (aro.get("model") or {}).get("path")
    if not isinstance(model, str) or not model:
        raise InvalidInput("actor_rollout_ref.model.path", "must name the model the floe backend trains")
    backend: dict[str, Any] = {"model": model, "optimizer": _optimizer((aro.get("actor") or {}).get("optim") or {}),
                               **hardware.backend}
    backend = with_overrides(backend, overrides, "floe.backend")
    # checked here, so a bad floe.backend key is named in full before a server starts (the
    # server would name it without the prefix, in its own log)
    parse_config(BackendConfig, backend, where="floe.backend")
    return FloeTarget(None, None, float(timeout), backend, hardware, chunk)
