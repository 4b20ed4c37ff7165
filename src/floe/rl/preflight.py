"""Checks of a recipe against the machine and its data, run before any model loads.

`floe train`, `floe sft` and `floe eval` (and `Trainer.run`) call `check_recipe` after the
recipe validates, so a user error fails in seconds with one line naming the field and the fix,
instead of a traceback after a warm start:

* ``backend.device``: a CUDA (or MPS) device this torch build cannot use;
* ``model.path``: a missing directory, a directory that is not a Hugging Face model, or a hub
  id that is neither in the local cache nor reachable (HF_HUB_OFFLINE set, or the hub does not
  answer within `HUB_TIMEOUT_S`) -- `check_model_source`;
* optional extras the recipe needs (wandb, tensorboard) -- `require_extra`;
* data files with too few rows for ``eval.size``, ``train.groups_per_step`` or
  ``warm_start.batch_size``.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

from floe.envs import EnvFamily, make_family
from floe.errors import InvalidInput
from floe.rl.config import Recipe

HUB_TIMEOUT_S = 10.0
DISTRIBUTION = "floe-rl"  # the package index name: pip install 'floe-rl[extra]'
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?")


def check_recipe(recipe: Recipe, *, model: bool = True, where: str = "recipe") -> EnvFamily:
    """Run every check (module docstring) and return the recipe's env family.

    ``model=False`` skips the device and model checks (the caller brings its own client, or the
    recipe names a remote backend, whose server owns both). Raises InvalidInput.
    """
    if model and recipe.url is None:
        check_device(recipe.backend.get("device", "cpu"), f"{where}.backend.device")
        if recipe.model.path is not None:
            check_model_source(recipe.model.path, f"{where}.model.path")
    if recipe.output.wandb:
        require_extra("wandb", "wandb", f"{where}.output.wandb")
    if recipe.output.tensorboard:
        require_extra("tensorboard", "tensorboard", f"{where}.output.tensorboard")
    family = make_family(recipe.env.name, **recipe.env.options)
    _check_rows(family, "eval", recipe.eval.size, recipe.eval.seed, f"{where}.eval.size")
    _check_rows(family, "train", recipe.train.groups_per_step, recipe.train.seed, f"{where}.train.groups_per_step")
    if recipe.warm_start is not None and recipe.model.tiny is not None:
        _check_rows(family, "train", recipe.warm_start.batch_size, recipe.warm_start.seed, f"{where}.warm_start.batch_size")
    return family


def _check_rows(family: EnvFamily, split: str, count: int, seed: int, field: str) -> None:
    """Draw ``count`` tasks of ``split`` once, so a data file with too few rows fails now."""
    try:
        family.tasks(split, count, seed)
    except ValueError as e:
        if isinstance(e, InvalidInput):
            raise
        raise InvalidInput(field, f"{e}; lower {field.split('.', 1)[-1]} or give a data file with more rows") from None


def check_device(device: str, field: str) -> None:
    """InvalidInput when ``device`` names an accelerator this torch build cannot use."""
    kind = device.split(":", 1)[0]
    if kind not in ("cuda", "mps"):
        return
    import torch  # noqa: PLC0415 - only a recipe that asks for an accelerator pays for torch here

    if kind == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, but no GPU is visible"
            raise InvalidInput(field, f"{device!r} is not available: torch {torch.__version__} is {build}; "
                                      "use --backend.device cpu, or install a CUDA build of torch")
        index = device.split(":", 1)[1] if ":" in device else "0"
        if not index.isdigit() or int(index) >= torch.cuda.device_count():
            raise InvalidInput(field, f"{device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif not torch.backends.mps.is_available():
        raise InvalidInput(field, f"{device!r} is not available on this machine; use --backend.device cpu")


def check_model_source(path: str, field: str) -> None:
    """InvalidInput unless ``path`` is a model directory, or a hub id that is cached locally or
    that the hub answers for within HUB_TIMEOUT_S (no download happens here)."""
    local = Path(path).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise InvalidInput(field, f"{path} is not a Hugging Face model directory (it has no config.json)")
        return
    if path.startswith((".", "/", "~")) or not _REPO_ID.fullmatch(path):
        raise InvalidInput(field, f"no such model directory: {path}; give an existing directory or a hub id like Qwen/Qwen3-0.6B")
    from huggingface_hub import try_to_load_from_cache  # noqa: PLC0415 - only for hub ids

    if isinstance(try_to_load_from_cache(path, "config.json"), str):
        return
    if _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(os.environ.get("TRANSFORMERS_OFFLINE")):
        raise InvalidInput(field, f"{path!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
                                  "download it first (hf download) or give a local directory")
    from huggingface_hub import HfApi, constants  # noqa: PLC0415
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError  # noqa: PLC0415

    try:
        HfApi().model_info(path, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        raise InvalidInput(field, f"{path!r} is gated on the hub; accept its terms and log in (hf auth login)") from None
    except RepositoryNotFoundError:
        raise InvalidInput(field, f"no model {path!r} on the Hugging Face hub (or it is private: log in); "
                                  "check the name or give a local directory") from None
    except Exception as e:  # noqa: BLE001 - any network failure means the same to the user
        reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise InvalidInput(field, f"cannot reach the Hugging Face hub ({constants.ENDPOINT}) to fetch {path!r}: {reason}; "
                                  "check the network, or give a local directory") from None


def require_extra(module: str, extra: str, field: str) -> None:
    """InvalidInput naming the pip command when ``module`` is not installed."""
    if importlib.util.find_spec(module) is None:
        raise InvalidInput(field, f"needs the {module} package, which is not installed: pip install '{DISTRIBUTION}[{extra}]'")


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")
