"""Getting the starting model: a given path, or a tiny model floe builds and warm-starts.

A tiny model is built from its config and, when the recipe has [warm_start], trained with SFT
(`cross_entropy` through the ordinary client API) on the environment's demonstrations. The
result is cached under $FLOE_CACHE (default ~/.cache/floe) by a hash of everything that
shapes it, so the second run starts at once; a missing cache entry is rebuilt. Cache entries
are written with `floe.atomic.atomic_directory`, so a crash never leaves a half-built model.

"Everything that shapes it" includes the code: the spec holds a digest of floe's own source
(`source_digest`) and torch's version, so an entry built by another floe (or torch) is never
reused; before, the key held only the recipe's keys, and a cache built by older code kept
giving its older model (and its rewards) while an empty cache gave the current one. The warm
start is deterministic for given code, torch build, thread count and CPU: an empty cache and
a cached entry give the same model bit for bit. Another CPU computes the same fp32 sums with
other kernels, so its 220 SFT steps end in a slightly different model (README: what varies).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import floe
from floe.atomic import atomic_directory, recover
from floe.envs import EnvFamily, make_family
from floe.envs.demonstrations import demonstration
from floe.errors import InvalidInput
from floe.models import make_tiny
from floe.paths import cache_root
from floe.rl.config import Recipe, WarmStartConfig
from floe.rl.rollouts import Renderer
from floe.types import Batch, Group, Sample

Progress = Callable[[int, int, float], None]  # (step, total, loss)


def connect_recipe(recipe: Recipe, progress: Progress | None = None) -> floe.Client:
    """A client for the recipe's backend: `floe serve` at backend.url (token: backend.token or
    $FLOE_TOKEN; the server holds the model), else an embedded backend on `prepare_model`'s model.
    The embedded backend's InvalidInput("config.<key>") is raised as "recipe.backend.<key>", the
    key the recipe set."""
    if recipe.url is not None:
        return floe.connect(recipe.url, token=recipe.backend.get("token") or os.environ.get("FLOE_TOKEN"))
    config = recipe.backend_config(prepare_model(recipe, progress))
    try:
        return floe.connect(config)
    except InvalidInput as e:
        if not e.field.startswith("config."):
            raise
        raise InvalidInput(f"recipe.backend.{e.field.removeprefix('config.')}", e.message) from None


_SOURCE_DIGEST: str | None = None


def source_digest() -> str:
    """SHA-256 (16 hex digits) of floe's own source files (paths and bytes), computed once."""
    global _SOURCE_DIGEST
    if _SOURCE_DIGEST is None:
        root = Path(floe.__file__).parent
        digest = hashlib.sha256()
        for path in sorted(root.rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
        _SOURCE_DIGEST = digest.hexdigest()[:16]
    return _SOURCE_DIGEST


def model_spec(recipe: Recipe) -> dict[str, Any]:
    """Everything that shapes the starting model of a tiny-model recipe (its cache key)."""
    import torch  # noqa: PLC0415 - the warm start runs on it; its kernels shape the result

    assert recipe.model.tiny is not None
    return {
        "tiny": recipe.model.tiny.make_tiny_kwargs(),
        "warm_start": recipe.warm_start.model_dump() if recipe.warm_start else None,
        "env": recipe.env.model_dump() if recipe.warm_start else None,
        "version": 2,
        "built_by": {"floe_source": source_digest(), "torch": torch.__version__},
    }


def cache_entry(spec: dict[str, Any]) -> Path:
    """The cache directory of a model spec (`model_spec`)."""
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "models" / f"tiny-{key}"


def prepare_model(recipe: Recipe, progress: Progress | None = None) -> str:
    """The model path the run starts from, building and warm-starting it when needed.
    ([warm_start] applies to a tiny model; a model.path is used as it is: `floe sft` trains one.)"""
    if recipe.model.path is not None:
        return recipe.model.path
    spec = model_spec(recipe)
    final = cache_entry(spec)
    recover(final)
    if (final / "config.json").is_file():
        return str(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}.work-", dir=final.parent))  # scratch, same filesystem
    try:
        base = make_tiny(work / "base", **recipe.model.tiny.make_tiny_kwargs())
        if recipe.warm_start is None:
            result = base
        else:
            family = make_family(recipe.env.name, **recipe.env.options)
            threads = recipe.backend.get("num_threads")
            result = Path(sft_on_demonstrations(str(base), family, recipe.warm_start, work, progress, threads))
        (result / "floe_model_spec.json").write_text(json.dumps(spec, indent=2))
        # replace=True: an entry without config.json is an unusable leftover of this same key.
        with atomic_directory(final, replace=True) as tmp:
            for item in result.iterdir():
                os.replace(item, tmp / item.name)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return str(final)


def demonstration_batch(family: EnvFamily, renderer: Renderer, count: int, seed: int) -> Batch:
    """SFT examples: each task's prompt and its demonstrated answer (+ end-of-turn token)."""
    groups = []
    eos = renderer.tokenizer.eos_token_id
    for task in family.tasks("train", count, seed):
        env = family.make_env(task)
        prompt = renderer.render(env.initial_messages())
        answer = renderer.tokenizer.encode(demonstration(family.name, task), add_special_tokens=False) + [eos]
        groups.append(Group(prompt, [Sample(answer)]))
    return Batch(groups)


# (renderer, rng) -> the batch of one SFT step; drawing from `rng` in step order keeps runs exact.
BatchSource = Callable[[Renderer, random.Random], Batch]

# [backend] keys `floe sft` passes on to its backend (the optimizer is the SFT's own).
SFT_BACKEND_KEYS = ("device", "dtype", "num_threads", "trust_remote_code", "attn_implementation", "compute", "tokenizer")


def sft_on_demonstrations(
    model_path: str,
    family: EnvFamily,
    cfg: WarmStartConfig,
    work: Path,
    progress: Progress | None = None,
    num_threads: int | None = None,
    out: Path | None = None,
) -> str:
    """Train `model_path` on fresh demonstrations each step; returns the exported HF dir.

    `work` holds the run's scratch (backend states); the model is exported to `out` (default
    `work/warm`) with `client.export_hf`, which refuses a directory that is not new, empty or
    an earlier floe export (InvalidInput).
    """

    def batches(renderer: Renderer, rng: random.Random) -> Batch:
        return demonstration_batch(family, renderer, cfg.batch_size, rng.randrange(2**31))

    return sft_train(model_path, batches, cfg, work, progress, {"num_threads": num_threads}, out)


def sft_train(
    model_path: str,
    batches: BatchSource,
    cfg: WarmStartConfig,
    work: Path,
    progress: Progress | None = None,
    backend: dict[str, Any] | None = None,
    out: Path | None = None,
) -> str:
    """`cfg.steps` steps of `cross_entropy` (token_mean) with AdamW on a cosine schedule (warmup
    `cfg.warmup_steps`, floor 0.1 lr), each on `batches(renderer, rng)` (rng seeded with
    `cfg.seed`); exports the model (see sft_on_demonstrations) and returns its directory.
    `backend` adds BackendConfig keys (device, dtype, num_threads, ...)."""
    client = floe.connect(
        floe.BackendConfig(
            **(backend or {}),
            model=model_path,
            state_dir=str(work / "states"),
            seed=cfg.seed,
            reference={"enabled": False},
            optimizer={"lr": cfg.lr, "schedule": "cosine", "warmup_steps": cfg.warmup_steps,
                       "total_steps": cfg.steps, "min_lr_ratio": 0.1, "betas": (0.9, 0.98)},
        )
    )
    try:
        renderer = Renderer(client.tokenizer())
        rng = random.Random(cfg.seed)
        for step in range(cfg.steps):
            batch = batches(renderer, rng)
            loss = client.forward_backward(batch, "cross_entropy", {"aggregation": "token_mean"}).metrics["loss"]
            client.optim_step()
            if progress:
                progress(step + 1, cfg.steps, loss)
        return client.export_hf(str(out or work / "warm"))
    finally:
        client.close()
