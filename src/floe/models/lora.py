"""LoRA adapters on one shared base model (peft), and the model views floe's zones run on.

`AdapterHost` owns one frozen base model wrapped once in a peft `PeftModel`; every adapter
(a training run's, or a frozen snapshot of it for sampling) is a named peft adapter on that
same module, so the base weights exist once however many adapters there are. Only one
adapter is active at a time: callers switch with `activate(name)` (or `base()` for no
adapter) while holding `AdapterHost.lock`, which every use of the model must hold.

Views, so that floe's own code runs unchanged on one adapter:
* `AdapterView` is what `floe.backend.policy.PolicyZone` and `floe.backend.scoring` are given
  for a run: `parameters()` / `state_dict()` / `load_state_dict()` are the adapter's alone
  (names without the adapter name), `get_output_embeddings()` returns the effective LM head
  (base weight + the active adapter's delta, so the shared-prefix and chunked-head paths see
  an adapted unembedding), and `save_pretrained` writes a peft adapter directory
  (`adapter_config.json` + `adapter_model.safetensors`) that `peft.PeftModel.from_pretrained`
  loads on the base model.
* `SamplingView` is what `floe.sampler.torch_engine.TorchEngine` is given: the adapted model's
  forward with the (frozen) base parameters.

Which modules an adapter trains follows Tinker's switches: attention (q/k/v/o projections),
MLP (gate/up/down), unembedding (lm_head). `LORA_ALPHA` is fixed (32, as Tinker-compatible
servers use), so the scale is alpha / rank. The core backend's `[lora]` (BackendConfig.lora,
`floe.backend.policy_lora`) names peft's keys directly instead: `backend_lora_config` builds its
peft config and `AdapterHost.add_config` adds it; `AdapterHost.merged_state_dict` gives the
merged weights its sampler is synced with.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from safetensors.torch import save_file
from transformers import PreTrainedModel

from floe.config import LoraConfig as FloeLoraConfig
from floe.errors import InvalidInput
from floe.locks import FairRLock
from floe.sampler.engine import copy_in_place

LORA_ALPHA = 32
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)
MAX_RANK = 256


@dataclass(frozen=True)
class LoraSpec:
    """One adapter's shape: rank, init seed and which module families it trains."""

    rank: int = 32
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True

    def check(self) -> None:
        """InvalidInput (naming the `lora_config` field) for a rank that is not an integer in
        1..MAX_RANK, a seed outside torch's seed range, a module switch that is not a
        bool, or no module family switched on."""
        if type(self.rank) is not int or not 1 <= self.rank <= MAX_RANK:
            raise InvalidInput("lora_config.rank", f"must be an integer in 1..{MAX_RANK}, got {self.rank!r}")
        if self.seed is not None and (type(self.seed) is not int or not -(2**63) <= self.seed < 2**64):
            # torch.manual_seed's range
            raise InvalidInput("lora_config.seed", f"must be an integer in [-2**63, 2**64) or absent, got {self.seed!r}")
        for name in ("train_attn", "train_mlp", "train_unembed"):
            if type(getattr(self, name)) is not bool:
                raise InvalidInput(f"lora_config.{name}", f"must be true or false, got {getattr(self, name)!r}")
        if not (self.train_attn or self.train_mlp or self.train_unembed):
            raise InvalidInput("lora_config", "at least one of train_attn, train_mlp, train_unembed must be true")

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "seed": self.seed, "train_attn": self.train_attn,
                "train_mlp": self.train_mlp, "train_unembed": self.train_unembed}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LoraSpec:
        return cls(int(data["rank"]), data.get("seed"), bool(data["train_attn"]), bool(data["train_mlp"]),
                   bool(data["train_unembed"]))


def _module_names(model: torch.nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def lora_config(spec: LoraSpec, present: set[str]) -> LoraConfig:
    """The peft config of `spec` for a model whose linear layers have the (last-part) names
    `present`; InvalidInput when a requested module family does not exist there."""
    targets: list[str] = []
    for flag, names, family in ((spec.train_attn, ATTENTION_MODULES, "train_attn"),
                                (spec.train_mlp, MLP_MODULES, "train_mlp"),
                                (spec.train_unembed, UNEMBED_MODULES, "train_unembed")):
        if flag:
            found = [n for n in names if n in present]
            if not found:
                raise InvalidInput(f"lora_config.{family}", f"this model has none of the modules {list(names)}; set it false")
            targets.extend(found)
    return LoraConfig(r=spec.rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=targets, bias="none")


def backend_lora_config(lora: FloeLoraConfig, model: torch.nn.Module) -> LoraConfig:
    """The peft config of a BackendConfig's `[lora]` for `model` (before any adapter):
    InvalidInput naming the `lora.*` key for a target or excluded name no linear layer of the
    model has (a target only with missing_targets = "error", or when no target matches), and for an adapted LM head whose weight is tied to the input embeddings (the
    sampler's model keeps one tensor for both, so merged weights could not be synced)."""
    present = _module_names(model)
    targets = lora.target_modules
    if isinstance(targets, list):
        missing = [n for n in targets if n not in present]
        if missing and (lora.missing_targets == "error" or len(missing) == len(targets)):
            raise InvalidInput("lora.target_modules", f"this model has no linear layer named {missing}; "
                               f"its linear layers are {sorted(present)}")
        targets = [n for n in targets if n in present]
    if isinstance(lora.exclude_modules, str):  # peft's regular expression, matched against whole module paths
        paths = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        if not any(re.fullmatch(lora.exclude_modules, p) for p in paths):
            raise InvalidInput("lora.exclude_modules", f"the regular expression {lora.exclude_modules!r} matches no "
                               f"linear layer's whole path (peft's rule), e.g. {paths[0]!r}; for a name in every "
                               "block write '.*\\.<name>', or give a list of names")
    else:
        unknown = [n for n in lora.exclude_modules if n not in present]
        if unknown:
            raise InvalidInput("lora.exclude_modules", f"this model has no linear layer named {unknown}; "
                               f"its linear layers are {sorted(present)}")
    hf: Any = model
    head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    embed = hf.get_input_embeddings() if hasattr(hf, "get_input_embeddings") else None
    head_name = next((n.rsplit(".", 1)[-1] for n, m in model.named_modules() if m is head), None)
    if (head is not None and embed is not None and head.weight is embed.weight and isinstance(lora.target_modules, list)
            and head_name in targets):
        raise InvalidInput("lora.target_modules", f"{head_name!r} is tied to the input embeddings in this model; "
                           "an adapted head cannot be synced as merged weights; remove it")
    return LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0, bias="none",  # type: ignore[arg-type]  # peft: alpha / r in float
        target_modules=targets,
        exclude_modules=lora.exclude_modules if isinstance(lora.exclude_modules, str) else list(lora.exclude_modules) or None,
        init_lora_weights=True if lora.init == "kaiming" else "gaussian",
    )


class _EffectiveHead:
    """The LM head as scoring reads it: `.weight` (base + active adapter delta) and `.bias`."""

    def __init__(self, layer: Any):
        self._layer = layer

    @property
    def weight(self) -> torch.Tensor:
        layer = self._layer
        weight = layer.base_layer.weight
        if getattr(layer, "disable_adapters", False) or getattr(layer, "merged", False):
            return weight
        for name in layer.active_adapters:
            if name in layer.lora_A:
                weight = weight + layer.get_delta_weight(name).to(weight.dtype)
        return weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self._layer.base_layer.bias


class AdapterHost:
    """One frozen base model and its named LoRA adapters; `lock` guards every use."""

    def __init__(self, base: PreTrainedModel, base_path: str):
        for p in base.parameters():
            p.requires_grad_(False)
        self.base_model = base
        self.base_parameters = list(base.parameters())  # taken before any adapter is injected
        self.linear_names = _module_names(base)
        self.base_path = base_path
        self.peft: PeftModel | None = None
        self.specs: dict[str, LoraSpec] = {}
        self.trainable: set[str] = set()
        self.lock = FairRLock()  # handed round-robin over tenants: one key's backlog cannot starve another's call

    @property
    def model(self) -> PreTrainedModel:
        """The HF model with LoRA layers injected (the base until the first adapter)."""
        return self.peft.base_model.model if self.peft is not None else self.base_model  # type: ignore[return-value]

    def add(self, name: str, spec: LoraSpec, trainable: bool) -> None:
        """A new adapter `name`; initialised like peft does (B = 0, so it starts as the base),
        A drawn from `spec.seed` (without touching the global RNG) when a seed is given."""
        spec.check()
        self.add_config(name, lora_config(spec, self.linear_names), spec, trainable)

    def add_config(self, name: str, config: LoraConfig, spec: LoraSpec, trainable: bool) -> None:
        """`add` with the peft `config` given (`backend_lora_config` builds one from a
        BackendConfig's `[lora]`); `spec` records the rank and seed."""
        with self.lock, torch.random.fork_rng(devices=[]):
            if spec.seed is not None:
                torch.manual_seed(spec.seed)
            if self.peft is None:
                self.peft = get_peft_model(self.base_model, config, adapter_name=name)
            else:
                self.peft.add_adapter(name, config)
            self.specs[name] = spec
            if trainable:
                self.trainable.add(name)
            self._apply_grad_flags()

    def remove(self, name: str) -> None:
        with self.lock:
            if self.peft is None or name not in self.specs:
                return
            if len(self.specs) == 1:  # peft cannot hold zero adapters: take the LoRA layers out
                self.base_model = self.peft.unload()
                self.peft = None
            else:
                self.peft.delete_adapter(name)
            del self.specs[name]
            self.trainable.discard(name)

    def activate(self, name: str) -> None:
        """Make `name` the adapter every forward uses (hold `lock`). Trainable adapters keep
        requires_grad (peft's switch would clear it on the inactive ones)."""
        assert self.peft is not None
        self.peft.base_model.set_adapter(name)
        self._apply_grad_flags()

    @contextmanager
    def base(self) -> Iterator[None]:
        """No adapter active inside the block (hold `lock`)."""
        if self.peft is None:
            yield
            return
        with self.peft.disable_adapter():
            yield

    def named_parameters(self, name: str) -> dict[str, torch.Tensor]:
        """The adapter's tensors by peft key without the adapter name, e.g.
        `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
        assert self.peft is not None
        marker = f".{name}."
        return {k.replace(marker, "."): p for k, p in self.peft.named_parameters() if marker in k and ".lora_" in k}

    def _apply_grad_flags(self) -> None:
        for name in self.specs:
            flag = name in self.trainable
            for p in self.named_parameters(name).values():
                p.requires_grad_(flag)

    def copy(self, source: str, target: str) -> None:
        """A frozen adapter `target` holding a copy of `source`'s current tensors."""
        with self.lock:
            self.add(target, self.specs[source], trainable=False)
            load_tensors(self.named_parameters(target), {k: v.detach() for k, v in self.named_parameters(source).items()})

    def view(self, name: str) -> AdapterView:
        return AdapterView(self, name)

    def sampling_view(self) -> SamplingView:
        return SamplingView(self)

    def save_adapter(self, name: str, directory: Path, tensors: Mapping[str, torch.Tensor] | None = None) -> None:
        """Write a peft adapter directory for `name` into `directory` (which exists): its live
        tensors, or `tensors` by the same names (a sharded policy passes the gathered ones)."""
        source = self.named_parameters(name) if tensors is None else tensors
        out = {k: v.detach().cpu().contiguous().clone() for k, v in source.items()}
        save_file(out, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
        assert self.peft is not None
        # peft's to_dict keeps sets (target_modules, exclude_modules); JSON has lists, and peft's
        # loader reads a set's str() as a regular expression that matches nothing
        config = {k: sorted(v) if isinstance(v, (set, frozenset)) else v
                  for k, v in self.peft.peft_config[name].to_dict().items()}
        config["base_model_name_or_path"] = self.base_path
        config["target_modules"] = sorted(config["target_modules"]) if config.get("target_modules") else None
        config["peft_type"] = "LORA"
        (directory / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str))


    def merged_state_dict(self, name: str) -> dict[str, torch.Tensor]:
        """The base model's state dict (its own names) with adapter `name` merged into every
        adapted layer: W' = W + scaling·B·A (`merge_weight`; scaling = lora_alpha / r). Tensors of
        layers the adapter does not touch are the base's own (not copied, ties kept); merged ones
        are new tensors of the base weight's dtype."""
        assert self.peft is not None
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for key, tensor, layer in merged_entries(self.model, name):
                if layer is None:
                    out[key] = tensor.detach()
                else:
                    out[key] = merge_weight(tensor, layer, name, layer.lora_A[name].weight, layer.lora_B[name].weight)
        return out


def merged_entries(model: torch.nn.Module, name: str) -> Iterator[tuple[str, torch.Tensor, Any]]:
    """What merging adapter `name` into `model` (the HF model with LoRA layers injected) gives,
    in state-dict order: (the base model's name, the tensor `model` holds under it, the peft
    LoRA layer whose weight it is, or None for a tensor the adapter leaves alone). The adapter's
    own tensors are not entries. A sharded policy gathers these tensors before merging them."""
    adapted = {f"{module_name}.base_layer.weight": module for module_name, module in model.named_modules()
               if isinstance(module, LoraLayer) and name in module.lora_A}
    for key, tensor in model.state_dict().items():
        if ".lora_" not in key:
            yield key.replace(".base_layer.", "."), tensor, adapted.get(key)


def merge_weight(weight: torch.Tensor, layer: Any, name: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """W + scaling·B·A in `weight`'s dtype, for the peft lora.Linear `layer` (its scaling and
    fan_in_fan_out) with adapter `name`'s matrices `a` and `b` given whole (peft's
    `get_delta_weight` formula, computed in fp32 like peft does on the CPU)."""
    delta = b.float() @ a.float()
    if layer.fan_in_fan_out:
        delta = delta.T
    return weight + (delta * layer.scaling[name]).to(weight.dtype)


def load_tensors(own: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy a saved adapter's `tensors` into `own` in place; StateError before changing anything
    when names or shapes differ."""
    copy_in_place(own, tensors, "the saved adapter and this adapter")


class AdapterView:
    """The model of one adapter, as `PolicyZone` and `floe.backend.scoring` use a model.

    Every call must happen with the adapter active (`AdapterHost.activate`) under the host's
    lock; the view itself switches nothing."""

    def __init__(self, host: AdapterHost, name: str):
        self.host = host
        self.name = name

    @property
    def config(self) -> Any:
        return self.host.model.config

    def modules(self) -> Iterator[torch.nn.Module]:
        return self.host.model.modules()

    def parameters(self) -> Iterator[torch.Tensor]:
        return iter(self.host.named_parameters(self.name).values())

    def get_decoder(self) -> torch.nn.Module:
        return self.host.model.get_decoder()

    def get_output_embeddings(self) -> Any:
        head = self.host.model.get_output_embeddings()
        return _EffectiveHead(head) if hasattr(head, "base_layer") else head

    def set_attn_implementation(self, implementation: str) -> None:
        self.host.model.set_attn_implementation(implementation)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.host.model(*args, **kwargs)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.host.named_parameters(self.name).items()}

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        load_tensors(self.host.named_parameters(self.name), tensors)

    def save_pretrained(self, directory: str | Path, safe_serialization: bool = True) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.host.save_adapter(self.name, directory)


class SamplingView:
    """The adapted model as `TorchEngine` uses one: forward, config, and the frozen base
    parameters (so the engine's `requires_grad_(False)` never touches an adapter)."""

    def __init__(self, host: AdapterHost):
        self.host = host

    @property
    def config(self) -> Any:
        return self.host.model.config

    def parameters(self) -> Iterator[torch.Tensor]:
        return iter(self.host.base_parameters)

    @property
    def forward(self) -> Any:
        return self.host.model.forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.host.model(*args, **kwargs)
