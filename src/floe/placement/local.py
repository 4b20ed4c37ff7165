"""The local placement: every zone in this process, on `config.device`.

The construction order (and so the use of torch's RNG) is the one the Backend always had:
policy model, sampler engine (a copy of the policy model), reference model (a checkpoint, or a
copy of the policy model), then the zones; weights sync by in-place copy. With `[lora]` the
policy is a `LoraPolicyZone` on the loaded model (its adapter injected after the sampler's and
the reference's copies were taken, so both hold the base; A is drawn from `config.seed`).
"""

from __future__ import annotations

import copy
from typing import Any

from transformers import PreTrainedTokenizerBase

from floe.backend.policy import PolicyZone
from floe.backend.policy_lora import LoraPolicyZone
from floe.backend.reference import ReferenceZone
from floe.backend.sampler import SamplerZone
from floe.backend.sync import InPlaceCopy
from floe.config import BackendConfig
from floe.models import load_model
from floe.models.loading import context_length
from floe.models.lora import AdapterHost
from floe.placement.zones import Zones
from floe.sampler import EngineSource, build_engine
from floe.sampler.registry import engine_start_seconds


def build_local(config: BackendConfig, tokenizer: PreTrainedTokenizerBase) -> Zones:
    """`Zones` with every zone in this process (see the module docstring)."""
    policy_model = load_model(
        config.model, config.dtype, config.device, config.trust_remote_code, config.attn_implementation
    )
    engine = build_engine(config.sampler.engine, EngineSource(policy_model, config.model, tokenizer, config.trust_remote_code))
    ref_model = None
    if config.reference.enabled:
        if config.reference.checkpoint:
            ref_model = load_model(
                config.reference.checkpoint, config.dtype, config.device, config.trust_remote_code,
                config.attn_implementation,
            )
        else:
            ref_model = copy.deepcopy(policy_model)
    vocab_size = int(policy_model.config.vocab_size)
    max_context = context_length(policy_model.config)
    policy: PolicyZone
    if config.lora is not None:  # the sampler's and reference's copies above are of the base model
        policy = LoraPolicyZone(AdapterHost(policy_model, config.model), config.lora, config.seed, config.optimizer,
                                config.compute)
    else:
        policy = PolicyZone(policy_model, config.optimizer, config.compute)
    sampler = SamplerZone(engine, config.sampler.engine.name, config.seed)
    reference = (
        ReferenceZone(ref_model, config.compute, config.reference.checkpoint or config.model)
        if ref_model is not None
        else None
    )
    device = str(config.device)

    def memory() -> dict[str, Any]:
        out: dict[str, Any] = {"policy": {"where": device}, "sampler": {"where": device}}
        if reference is not None:
            out["reference"] = {"where": device}
        return out

    return Zones(
        policy=policy, sampler=sampler, reference=reference, weight_sync=InPlaceCopy(),
        vocab_size=vocab_size, max_context=max_context, colocated=False,
        describe=lambda: {"kind": "local", "device": device}, memory=memory,
        engine_start_seconds=lambda: engine_start_seconds(engine), _close=sampler.close,
    )
