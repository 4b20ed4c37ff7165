"""Getting the starting model: a given path, or a tiny model floe builds and warm-starts.

A tiny model is built from its config and, when the recipe has [warm_start], trained with SFT
(`cross_entropy` through the ordinary client API) on the environment's demonstrations. The
result is cached under $FLOE_CACHE (default ~/.cache/floe) by a hash of everything that
shapes it, so the second run starts at once; a missing cache entry is rebuilt.
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

import floe
from floe.envs import EnvFamily, make_family
from floe.envs.demonstrations import demonstration
from floe.models import make_tiny
from floe.rl.config import Recipe, WarmStartConfig
from floe.rl.rollouts import Renderer
from floe.types import Batch, Group, Sample

Progress = Callable[[int, int, float], None]  # (step, total, loss)


def cache_root() -> Path:
    return Path(os.environ.get("FLOE_CACHE", Path.home() / ".cache" / "floe"))


def prepare_model(recipe: Recipe, progress: Progress | None = None) -> str:
    """The model path the run starts from, building and warm-starting it when needed."""
    if recipe.model.path is not None:
        return recipe.model.path
    assert recipe.model.tiny is not None
    spec = {
        "tiny": recipe.model.tiny.model_dump(),
        "warm_start": recipe.warm_start.model_dump() if recipe.warm_start else None,
        "env": recipe.env.model_dump() if recipe.warm_start else None,
        "version": 1,
    }
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    final = cache_root() / "models" / f"tiny-{key}"
    if (final / "config.json").is_file():
        return str(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        base = make_tiny(work / "base", **recipe.model.tiny.model_dump())
        if recipe.warm_start is None:
            result = base
        else:
            family = make_family(recipe.env.name, **recipe.env.options)
            threads = recipe.backend.get("num_threads")
            result = Path(sft_on_demonstrations(str(base), family, recipe.warm_start, work, progress, threads))
        (result / "floe_model_spec.json").write_text(json.dumps(spec, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(result, final)
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


def sft_on_demonstrations(
    model_path: str,
    family: EnvFamily,
    cfg: WarmStartConfig,
    work: Path,
    progress: Progress | None = None,
    num_threads: int | None = None,
) -> str:
    """Train `model_path` on fresh demonstrations each step; returns the exported HF dir."""
    client = floe.connect(
        floe.BackendConfig(
            model=model_path,
            state_dir=str(work / "states"),
            seed=cfg.seed,
            num_threads=num_threads,
            reference={"enabled": False},
            optimizer={"lr": cfg.lr, "schedule": "cosine", "warmup_steps": cfg.warmup_steps,
                       "total_steps": cfg.steps, "min_lr_ratio": 0.1, "betas": (0.9, 0.98)},
        )
    )
    renderer = Renderer(client.tokenizer())
    rng = random.Random(cfg.seed)
    for step in range(cfg.steps):
        batch = demonstration_batch(family, renderer, cfg.batch_size, rng.randrange(2**31))
        loss = client.forward_backward(batch, "cross_entropy", {"aggregation": "token_mean"}).metrics["loss"]
        client.optim_step()
        if progress:
            progress(step + 1, cfg.steps, loss)
    out = client.export_hf(str(work / "warm"))
    client.close()
    return out
