"""verl's MFU and tokens/s of the actor update, from floe's measured backend time.

verl's own workers log `mfu` per update (`engine_workers._postprocess_output`):

    estimated, promised = FlopsCounter(hf_config).estimate_flops(batch_seqlens, delta_time)
    mfu = estimated / promised / world_size

`estimated` is verl's model TFLOP/s (verl.utils.flops_counter: 6·N·Σs + 6·L·H·d_h·Σs² over
the sequences' lengths s, N counting the embedding and the LM head) and `promised` the peak
TFLOP/s of one device from verl's table (`get_device_flops`). `ActorThroughput.metrics` is the
same computation over one training step's updates (`estimate_flops`'s own estimator,
`ESTIMATE_FUNC[model_type]`, 0 for a model type verl does not know as verl gives; not its peak
lookup, which asks the trainer process's own accelerator), with floe's numbers in verl's places:
`batch_seqlens` = every mini-batch's sequences (prompt + response, epochs included),
`delta_time` = the backend's measured `seconds` of the step's forward_backward calls, the
peak that of the floe policy's device (not the trainer's), `world_size` = the policy's devices.

The peak, TFLOP/s of one policy device: the backend's `compute.peak_tflops` when set; else
verl's table at the backend's GPU name (what verl's own workers on that GPU would divide by);
else 0, which makes `mfu` 0 as verl logs it for a device missing from its table. A CPU backend
has no peak: verl's table holds one constant for every CPU, which is no CPU's measured peak,
so floe does not use it (set `compute.peak_tflops` for a CPU MFU).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from verl.utils.flops_counter import ESTIMATE_FUNC, get_device_flops


def promised_tflops(capabilities: Mapping[str, Any]) -> float:
    """Peak TFLOP/s of one floe policy device for verl's mfu (module docstring); 0.0 = unknown."""
    if capabilities.get("peak_flops_source") == "compute.peak_tflops":
        return float(capabilities["peak_flops"]) / 1e12
    name = str(capabilities.get("device_name", ""))
    if name in ("", "cpu", "unknown"):
        return 0.0
    peak = float(get_device_flops(unit="T", device_name=name))
    return peak if math.isfinite(peak) else 0.0


def verl_tflops(hf_config: Any, seqlens: Sequence[int], seconds: float) -> float:
    """verl's FlopsCounter estimate, TFLOP/s: `estimate_flops(seqlens, seconds)[0]` for a text model."""
    estimate = ESTIMATE_FUNC.get(hf_config.model_type)
    return float(estimate(hf_config, sum(seqlens), list(seqlens), seconds)) if estimate else 0.0


class ActorThroughput:
    """The actor update's throughput metrics in verl's names (module docstring)."""

    def __init__(self, hf_config: Any, capabilities: Mapping[str, Any]):
        self.hf_config = hf_config
        self.peak_tflops = promised_tflops(capabilities)
        self.devices = int(capabilities.get("policy_devices", 1))

    def metrics(self, seqlens: Sequence[int], seconds: float, tokens: float) -> dict[str, list[float]]:
        """`mfu` (verl's key; the trainer logs it as perf/mfu/actor) and floe's
        `floe/tflops` (verl's estimated TFLOP/s, all devices), `floe/peak_tflops` (per device,
        0 = unknown), `floe/update_seconds` (backend seconds of the step's forward_backward
        calls), `floe/update_tokens` (their sequence tokens, as the backend counted them) and
        `floe/tokens_per_second` (update_tokens / update_seconds)."""
        if not seqlens or seconds <= 0:
            return {}
        estimated = verl_tflops(self.hf_config, seqlens, seconds)
        mfu = estimated / self.peak_tflops / self.devices if self.peak_tflops > 0 else 0.0
        return {
            "mfu": [float(mfu)],
            "floe/tflops": [float(estimated)],
            "floe/peak_tflops": [self.peak_tflops],
            "floe/update_seconds": [seconds],
            "floe/update_tokens": [tokens],
            "floe/tokens_per_second": [tokens / seconds],
        }
