"""prime-rl's `trainer.model.lora` as floe's `[backend.lora]`, and the check of a running server's.

prime-rl (prime_rl.configs.trainer.LoRAConfig at floe.integrations.prime_rl.PRIME_RL_COMMIT)
trains a LoRA adapter of the policy with these keys; floe's backend does the same with peft
(floe.config.LoraConfig), so the recipe's adapter is what floe trains:

  rank            -> rank (prime-rl's default 16)
  alpha           -> alpha (default 32.0): the update is (alpha / rank)·B·A in both
  dropout         -> must be 0 (prime-rl's default): floe computes RL log-probs without dropout
  target_modules  -> target_modules, missing_targets = "ignore": prime-rl's simple names match the
                     last part of a linear layer's name (peft's list matching); names the model
                     lacks match nothing in both (prime-rl's default lists several architectures'
                     projections). A regex pattern (prime-rl also takes those) is refused: peft's
                     list form matches names only
  modules_to_save -> must be empty (prime-rl's default): floe trains the adapter only

When `floe prime-rl` starts floe serve the adapter goes into its backend (`server_lora`); against a
running server (`[floe] url`) the trainer compares it with the server's
(`info().capabilities["lora"]`, `check_server_lora`) and stops with the `[backend.lora]` lines
that make them agree. The sampler serves the merged weights W + (alpha / rank)·B·A after each
sync; prime-rl's orchestrator asks for the adapter by its name (`r{rank}-a{alpha}`), which
floe serve answers after `/load_lora_adapter` (server/protocols/vllm_compat.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from floe.config import LoraConfig
from floe.errors import InvalidInput

FIELD = "trainer.model.lora"
PRIME_DEFAULTS: dict[str, Any] = {  # prime_rl.configs.trainer.LoRAConfig's defaults
    "rank": 16, "alpha": 32.0, "dropout": 0.0,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "experts",
                       "fc1_latent_proj", "fc2_latent_proj"],
    "modules_to_save": [],
}
_NAME = re.compile(r"[A-Za-z0-9_]+")


def parse_lora(table: Any) -> LoraConfig | None:
    """The adapter of `trainer.model.lora` (a table, prime-rl's defaults for missing keys), or
    None without one. Raises InvalidInput naming `trainer.model.lora.<key>` for an unknown key, a
    regex target, a non-zero dropout or modules_to_save."""
    if table is None:
        return None
    if not isinstance(table, Mapping):
        raise InvalidInput(FIELD, f"must be a table (rank, alpha, dropout, target_modules, modules_to_save), got {table!r}")
    unknown = sorted(set(table) - set(PRIME_DEFAULTS))
    if unknown:
        raise InvalidInput(f"{FIELD}.{unknown[0]}", f"is not a key of prime-rl's LoRA config; known: {sorted(PRIME_DEFAULTS)}")
    keys = {**PRIME_DEFAULTS, **table}
    if keys["modules_to_save"]:
        raise InvalidInput(f"{FIELD}.modules_to_save", f"is {keys['modules_to_save']!r}; floe trains the LoRA adapter "
                           "only (no fully trained modules beside it): remove it")
    targets = keys["target_modules"]
    if not isinstance(targets, list) or not all(isinstance(t, str) and _NAME.fullmatch(t) for t in targets):
        raise InvalidInput(f"{FIELD}.target_modules", f"must be a list of module names (like \"q_proj\"), got "
                           f"{targets!r}; floe matches names, not regex patterns")
    try:
        return LoraConfig(rank=keys["rank"], alpha=keys["alpha"], dropout=keys["dropout"], target_modules=targets,
                          missing_targets="ignore")
    except InvalidInput as e:  # floe's config names its own field (LoraConfig.rank): name the recipe's key
        raise InvalidInput(f"{FIELD}.{e.field.rsplit('.', 1)[-1]}", e.message) from None


def server_lora(lora: LoraConfig | None, backend: Mapping[str, Any]) -> dict[str, Any]:
    """The `[backend]` table of the floe serve `floe prime-rl` starts, with the recipe's adapter.
    An overlay `[floe.backend.lora]` must be the same adapter (InvalidInput `floe.backend.lora`)."""
    if lora is None:
        return dict(backend)
    own = backend.get("lora")
    if own is not None and LoraConfig.model_validate(own) != lora:
        raise InvalidInput("floe.backend.lora", f"is {own!r} but the recipe's {FIELD} is {_toml(lora)}: keep one of them")
    return {**backend, "lora": lora.model_dump(mode="json")}


def check_server_lora(lora: LoraConfig | None, server: Mapping[str, Any] | None) -> None:
    """InvalidInput when a running server's adapter (`info().capabilities["lora"]`, None = every
    weight trains) is not the recipe's; the message gives the `[backend.lora]` that agrees."""
    have = None if server is None else LoraConfig.model_validate(server)
    if have == lora:
        return
    if lora is None:
        raise InvalidInput(FIELD, f"is not set, but the server trains a LoRA adapter ({_toml(have)}): set the same "
                           f"{FIELD} or start floe serve without [backend.lora]")
    raise InvalidInput(FIELD, f"trains the adapter {_toml(lora)}; the server's is "
                       f"{'none (every weight trains)' if have is None else _toml(have)}: start floe serve with "
                       f"[backend.lora] {_toml(lora)}")


def _toml(lora: LoraConfig | None) -> str:
    if lora is None:
        return "none"
    ignore = ', missing_targets = "ignore"' if lora.missing_targets == "ignore" else ""
    return f"rank = {lora.rank}, alpha = {lora.alpha}, target_modules = {json.dumps(lora.target_modules)}{ignore}"
