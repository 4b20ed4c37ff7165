"""Checks of a recipe against the machine and its data, run before any model loads.

`floe train`, `floe sft` and `floe eval` (and `Trainer.run`) call `check_recipe` after the
recipe validates, so a user error fails in seconds with one line naming the field and the fix,
instead of a traceback after a warm start:

* ``backend.url`` / ``backend.token``: a `floe serve` that does not answer /health within
  `SERVER_TIMEOUT_S`, or that refuses the token -- `check_server` (probed before anything else);
* ``backend.sampler.engine.name``: an engine whose optional stack (vllm) is not installed;
* ``backend.device``: a CUDA (or MPS) device this torch build cannot use;
* ``model.path``: a missing directory, a directory that is not a Hugging Face model, or a hub
  id that is neither in the local cache nor reachable (HF_HUB_OFFLINE set, or the hub does not
  answer within `HUB_TIMEOUT_S`) -- `check_model_source` (`floe.models.loading`); it and
  `floe.devices.check_device` are shared with the Backend's start-up checks (the CLI runs the
  device check already right after the recipe, before importing the model stack);
* optional extras the recipe needs (wandb, tensorboard) -- `require_extra`;
* data files with too few rows for ``eval.size``, ``train.groups_per_step`` or
  ``warm_start.batch_size``.
"""

from __future__ import annotations

import importlib.util
import os

from floe.envs import EnvFamily, make_family
from floe.errors import InvalidInput
from floe.rl.config import Recipe

SERVER_TIMEOUT_S = 5.0  # seconds `check_server` waits for a floe serve to answer
DISTRIBUTION = "floe-rl"  # the package index name: pip install 'floe-rl[extra]'


def check_recipe(recipe: Recipe, *, model: bool = True, where: str = "recipe") -> EnvFamily:
    """Run every check (module docstring) and return the recipe's env family.

    ``model=False`` skips the server, engine, device and model checks (the caller brings its own
    client); a recipe that names a remote backend gets the server checks instead of the others
    (its server owns the model). Raises InvalidInput.
    """
    if model and recipe.url is not None:
        check_server(recipe.url, recipe.backend.get("token") or os.environ.get("FLOE_TOKEN"), where)
    if model and recipe.url is None:
        engine = recipe.backend.get("sampler", {}).get("engine", {}).get("name", "torch")
        if engine == "vllm":
            require_extra("vllm", "vllm", f"{where}.backend.sampler.engine.name")
        from floe.devices import check_device  # noqa: PLC0415 - torch loads only here
        from floe.models.loading import check_model_source  # noqa: PLC0415

        check_device(recipe.backend.get("device", "cpu"), f"{where}.backend.device", "--backend.device cpu")
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


def check_server(url: str, token: str | None, where: str = "recipe") -> None:
    """InvalidInput naming `<where>.backend.url` unless a `floe serve` at ``url`` answers GET
    /health within SERVER_TIMEOUT_S seconds, and `<where>.backend.token` when it then refuses
    ``token`` (GET /info answers 401). One try each: no retries, so a wrong URL fails at once."""
    import httpx  # noqa: PLC0415 - only recipes with a remote backend pay for it

    field = f"{where}.backend.url"
    base = url.rstrip("/")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with httpx.Client(base_url=base, headers=headers, timeout=SERVER_TIMEOUT_S) as http:
            health = http.get("/health")
            if health.status_code != 200:
                raise InvalidInput(field, f"{url} answered HTTP {health.status_code} on /health, not a floe serve; "
                                          "fix the URL")
            if http.get("/info").status_code == 401:
                raise InvalidInput(f"{where}.backend.token", f"the floe serve at {url} refused the token (HTTP 401); "
                                   "set backend.token (or $FLOE_TOKEN) to the token it was started with")
    except httpx.HTTPError as e:
        raise InvalidInput(field, f"cannot reach {url} ({_reason(e)}); start floe serve there or fix the URL") from None


def _reason(error: Exception) -> str:
    """A few words for why an HTTP request failed: connection refused, no answer, or the error's text."""
    import httpx  # noqa: PLC0415

    text = str(error)
    if "refused" in text.lower():
        return "connection refused"
    if isinstance(error, httpx.TimeoutException):
        return f"no answer within {SERVER_TIMEOUT_S:g} s"
    return (text.splitlines()[0][:160] if text else type(error).__name__)


def require_extra(module: str, extra: str, field: str) -> None:
    """InvalidInput naming the pip command when ``module`` is not installed."""
    if importlib.util.find_spec(module) is None:
        raise InvalidInput(field, f"needs the {module} package, which is not installed: pip install '{DISTRIBUTION}[{extra}]'")
