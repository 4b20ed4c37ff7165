"""The recipe: one pydantic model for everything `floe train` / `floe sft` / `floe eval` read.

A recipe is a TOML file (plus `@` overlays and `--section.key value` overrides, merged by
`floe.config.load_layers`), validated by `parse_recipe`. Every table forbids unknown keys, and
the choices are typed when the recipe loads, before any model is built:

* `[train.loss]` is one table: `name` picks the loss and the table holds that loss's keys; it
  is a discriminated union of the loss registry's config classes (floe.compute.losses.LOSSES);
* `env.name` must resolve (built-in, "pkg.module:Class" or entry point) and `env.options` is
  checked against that family's options model (floe.envs.registry).

`parse_recipe` words every error as `recipe.<key path>: <problem>; <what is allowed>`, e.g.
`recipe.train.loss.name: unknown loss 'ppoo'; choose one of cispo, ...`. See docs/recipes.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, Field, ValidationError, create_model, model_validator

from floe.compute.losses import LOSSES, LossConfig, loss_names
from floe.config import BackendConfig, StrictModel, apply_override, deep_merge, error_loc, load_layers
from floe.envs.registry import validate_options
from floe.errors import InvalidInput


class TinyModelConfig(StrictModel):
    """Dimensions of a tiny Qwen3 that floe builds itself (random init, char tokenizer): the
    keyword arguments of `floe.models.make_tiny`, with the same defaults (a test holds them equal;
    this module cannot import make_tiny, which loads torch)."""

    hidden_size: int = Field(64, gt=0)
    intermediate_size: int = Field(128, gt=0)
    num_hidden_layers: int = Field(2, gt=0)
    num_attention_heads: int = Field(4, gt=0)
    num_key_value_heads: int = Field(2, gt=0)
    head_dim: int | None = Field(None, gt=0, description="None = hidden_size // num_attention_heads")
    max_position_embeddings: int = Field(1024, gt=0)
    tie_word_embeddings: bool = False
    seed: int = 0

    def make_tiny_kwargs(self) -> dict[str, Any]:
        """The keyword arguments for make_tiny. head_dim and tie_word_embeddings are passed only
        when the recipe sets them, so existing recipes keep their warm-start cache keys."""
        later = {"head_dim", "tie_word_embeddings"} - self.model_fields_set
        return self.model_dump(exclude=later)


class ModelConfig(StrictModel):
    """Where the policy starts: an HF directory / hub id, or a tiny model floe builds."""

    path: str | None = None
    tiny: TinyModelConfig | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelConfig:
        if (self.path is None) == (self.tiny is None):
            raise ValueError("set exactly one of model.path or [model.tiny]")
        return self


class WarmStartConfig(StrictModel):
    """SFT before RL (and the hyperparameters of `floe sft`): on the environment's
    demonstrations, or on `[sft] data`; the result is cached by its config."""

    steps: int = Field(200, ge=1)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(3e-3, gt=0)
    warmup_steps: int = Field(10, ge=0)
    seed: int = 0


class SftDataConfig(StrictModel):
    """`[sft]`: the data `floe sft` trains on instead of the env's demonstrations (floe.rl.sft).

    `data` is a .jsonl / .json / .parquet file, a directory written by `datasets`'
    `save_to_disk`, or a Hugging Face hub dataset name (needs the `datasets` extra). Each row is a
    chat (`messages`: a list of {role, content}; the last assistant message is the target) or a
    prompt/completion pair (strings, or message lists)."""

    data: str | None = Field(None, description="None = the env's demonstrations")
    split: str = "train"
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    chat_template: bool = Field(True, description="render string prompts as a user message with the chat template; "
                                "false = plain text prompt + completion")


class EnvConfig(StrictModel):
    """The environment: a built-in name, "pkg.module:Class" or a `floe.envs` entry point, and its
    options (checked against the family's options model when the recipe loads)."""

    name: str = "reverse_text"
    options: dict[str, Any] = Field(default_factory=dict)


def _recipe_loss(name: str, config: type[LossConfig]) -> type[LossConfig]:
    """`config` plus the `name` tag that selects it in `[train.loss]`."""
    return create_model(  # type: ignore[call-overload,no-any-return]
        f"{config.__name__.removesuffix('Config')}Loss",
        __base__=config,
        __doc__=f"[train.loss] with name = {name!r}: {LOSSES[name].summary}",
        name=(Literal[name], ...),  # type: ignore[valid-type]
    )


DEFAULT_LOSS = "ppo"  # the loss of a recipe whose [train.loss] sets no name

# One recipe model per registered loss, in registry order.
RECIPE_LOSSES: dict[str, type[LossConfig]] = {n: _recipe_loss(n, d.config) for n, d in LOSSES.items()}
TrainLoss = Annotated[Union[tuple(RECIPE_LOSSES.values())], Field(discriminator="name")]  # type: ignore[valid-type]  # noqa: UP007


def loss_request(loss: LossConfig) -> tuple[str, dict[str, Any]]:
    """(loss name, loss_config) of a `[train.loss]` table, as `client.forward_backward` takes them."""
    return loss.name, loss.model_dump(exclude={"name"})  # type: ignore[attr-defined]


class AdvantageConfig(StrictModel):
    """Group-relative advantages: A = r - mean(group r) [/ (std + eps)]."""

    scale_std: bool = False
    drop_constant_groups: bool = True
    eps: float = Field(1e-6, gt=0)


class TrainConfig(StrictModel):
    steps: int = Field(40, ge=1)
    groups_per_step: int = Field(16, ge=1)
    samples_per_group: int = Field(8, ge=1)
    max_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    loss: TrainLoss = Field(default_factory=lambda: RECIPE_LOSSES[DEFAULT_LOSS](name=DEFAULT_LOSS))
    minibatches: int = Field(1, ge=1, description="optimizer steps per batch")
    max_off_policy_steps: int = Field(
        0, ge=0, description="0 = synchronous; k > 0 lets sampling run up to k steps ahead of training"
    )
    advantage: AdvantageConfig = AdvantageConfig()
    seed: int = 0

    @model_validator(mode="before")
    @classmethod
    def _loss_table(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if isinstance(data.get("loss"), str) or "loss_config" in data:
            field = "loss_config" if "loss_config" in data else "loss"
            raise InvalidInput(
                field,
                'the loss is one table now: [train.loss] name = "ppo" plus that loss\'s keys '
                "(e.g. clip_high = 0.28); move train.loss and train.loss_config into it",
            )
        if isinstance(data.get("loss"), dict) and "name" not in data["loss"]:
            # `--train.loss.clip_high 0.3` on a recipe without [train.loss] tunes the default loss.
            data = {**data, "loss": {"name": DEFAULT_LOSS, **data["loss"]}}
        return data


class EvalConfig(StrictModel):
    every: int = Field(10, ge=0, description="0 = only at the start and the end")
    size: int = Field(64, ge=1)
    greedy: bool = Field(True, description="greedy decoding; false samples at `temperature`")
    samples_per_task: int = Field(1, ge=1, description="episodes per held-out task (sampled eval)")
    temperature: float = Field(1.0, gt=0)
    max_tokens: int | None = None
    seed: int = 1234
    pass_reward: float = Field(1.0, description="an episode passes (pass@k, maj@k) when its reward is at least this")

    @model_validator(mode="after")
    def _several_samples_need_sampling(self) -> EvalConfig:
        if self.greedy and self.samples_per_task > 1:
            raise InvalidInput(
                "samples_per_task",
                f"{self.samples_per_task} episodes per task with greedy decoding are {self.samples_per_task} identical "
                "answers (pass@k would be pass@1); set eval.greedy = false to sample them at eval.temperature, "
                "or samples_per_task = 1",
            )
        return self


class OutputConfig(StrictModel):
    run_dir: str = "runs/run"
    checkpoint_every: int = Field(10, ge=0, description="0 = only at the end")
    keep_checkpoints: int = Field(2, ge=1)
    rollouts_per_step: int = Field(4, ge=0, description="readable rollouts written per step")
    progress: bool = True
    wandb: bool = False
    wandb_project: str = "floe"
    tensorboard: bool = False


# [backend] keys that choose a remote backend instead of an embedded one (not BackendConfig's).
REMOTE_KEYS = ("url", "token")


class Recipe(StrictModel):
    """Everything a run needs. `backend` is a BackendConfig without `model` (set by [model]);
    its `state_dir` defaults to <output.run_dir>/states. `backend.url` (+ `backend.token`, or
    $FLOE_TOKEN) runs against `floe serve` instead: the server applies its own [model] and
    [backend] (start it with the same recipe)."""

    model: ModelConfig
    warm_start: WarmStartConfig | None = None
    sft: SftDataConfig = SftDataConfig()
    backend: dict[str, Any] = Field(default_factory=dict)
    env: EnvConfig = EnvConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    output: OutputConfig = OutputConfig()

    @model_validator(mode="after")
    def _backend_has_no_model(self) -> Recipe:
        if "model" in self.backend:
            raise InvalidInput("backend.model", "set the model in [model] (model.path or [model.tiny]), not in [backend]")
        for key in REMOTE_KEYS:
            if key in self.backend and not isinstance(self.backend[key], str):
                raise InvalidInput(f"backend.{key}", f"must be a string, got {self.backend[key]!r}")
        url = self.backend.get("url")
        if url is not None and not url.startswith(("http://", "https://")):
            raise InvalidInput("backend.url", f"{url!r} needs a scheme: http://{url} (the address of a floe serve)")
        if "token" in self.backend and "url" not in self.backend:
            raise InvalidInput("backend.token", "only used with backend.url (a remote backend)")
        local = {k: v for k, v in self.backend.items() if k not in REMOTE_KEYS}
        try:
            BackendConfig.model_validate({"model": "x", **local})  # fail early on bad keys
        except ValidationError as e:
            raise _backend_error(e.errors()[0]) from None
        return self

    @model_validator(mode="after")
    def _env_resolves(self) -> Recipe:
        validate_options(self.env.name, self.env.options)  # InvalidInput naming env.name / env.options.<key>
        return self

    @property
    def state_dir(self) -> str:
        """backend.state_dir when the recipe sets it, else <output.run_dir>/states."""
        return self.backend.get("state_dir") or str(Path(self.output.run_dir) / "states")

    @property
    def url(self) -> str | None:
        """backend.url: the `floe serve` this recipe runs against; None = an embedded backend."""
        return self.backend.get("url")

    def backend_config(self, model_path: str) -> BackendConfig:
        """The embedded backend's config for the prepared model (the [backend] table less url/token)."""
        local = {k: v for k, v in self.backend.items() if k not in REMOTE_KEYS}
        return BackendConfig.model_validate({**local, "model": model_path, "state_dir": self.state_dir})

    def public_dump(self) -> dict[str, Any]:
        """The recipe as JSON values, with backend.token masked: what config.json and loggers get."""
        data = self.model_dump(mode="json")
        if "token" in data["backend"]:
            data["backend"]["token"] = "***"
        return data


def _backend_error(err: Any) -> InvalidInput:
    """A BackendConfig validation error as InvalidInput with the recipe's path (backend.<key>)."""
    loc = [str(p) for p in err["loc"]]
    path = ".".join(["backend", *map(str, error_loc(BackendConfig, err["loc"]))])
    if err["type"] == "extra_forbidden":
        model = _model_at(BackendConfig, loc[:-1])
        allowed = sorted(model.model_fields) if model is not None else []
        if model is BackendConfig:
            allowed = sorted({*allowed, *REMOTE_KEYS} - {"model"})
        return InvalidInput(path, f"unknown key; allowed keys: {', '.join(allowed) or 'see docs/api.md'}")
    if err["type"] == "missing":
        return InvalidInput(path, "required key is missing")
    return InvalidInput(path, err["msg"])


# Keys whose value may differ when a run is resumed (`floe train --resume`); any other change is
# refused, naming the key (docs/recipes.md lists these). Dotted paths; a table covers its keys.
RESUMABLE_KEYS = (
    "train.steps",
    "eval.every",
    "output.checkpoint_every",
    "output.keep_checkpoints",
    "output.rollouts_per_step",
    "output.progress",
    "output.wandb",
    "output.wandb_project",
    "output.tensorboard",
    "backend.num_threads",
    "backend.placement",
    "backend.url",
    "backend.token",
)


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a.b": value} for every leaf of nested tables (lists and other values are leaves)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


# Tables whose keys are free-form (not model fields): a key present on one side only is a change.
FREE_TABLES = ("backend.", "env.options.")


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (old value, new value)} for every key that differs between two recipe dumps
    (JSON values, as config.json holds them). Outside FREE_TABLES a key only one side has is no
    change: every model field is always dumped, so it was added to (or dropped from) floe since."""
    a, b = flatten(old), flatten(new)
    keys = sorted(a.keys() | b.keys())
    return {
        k: (a.get(k), b.get(k))
        for k in keys
        if (k in a and k in b and a[k] != b[k]) or ((k in a) != (k in b) and k.startswith(FREE_TABLES))
    }


def is_resumable(key: str) -> bool:
    """True when `key` (dotted) may change on resume (RESUMABLE_KEYS)."""
    return any(key == k or key.startswith(k + ".") for k in RESUMABLE_KEYS)


MODEL_CHOICES = ("path", "tiny")


def merge_recipe_layers(files: list[str], overrides: dict[str, Any]) -> dict[str, Any]:
    """Recipe files merged left to right, then the overrides, as `floe.config.load_layers` does,
    except that `[model]` holds one choice: a later file or override that sets `model.path`
    replaces an earlier `[model.tiny]`, and one that sets `model.tiny` replaces `model.path`."""
    data: dict[str, Any] = {}
    for file in files:
        layer = load_layers([file])
        data = deep_merge(_without_replaced_model(data, layer.get("model")), layer)
    for key, value in overrides.items():
        parts = key.split(".")
        if parts[0] == "model" and len(parts) > 1 and parts[1] in MODEL_CHOICES and value is not None:
            data = _without_replaced_model(data, {parts[1]: value})
        data = apply_override(data, key, value)
    return data


def _without_replaced_model(data: dict[str, Any], layer_model: Any) -> dict[str, Any]:
    """`data` less the model choice that `layer_model` (a later layer's [model]) replaces."""
    if not isinstance(layer_model, dict) or not isinstance(data.get("model"), dict):
        return data
    chosen = [k for k in MODEL_CHOICES if layer_model.get(k) is not None]
    if len(chosen) != 1:
        return data
    return {**data, "model": {k: v for k, v in data["model"].items() if k not in MODEL_CHOICES or k == chosen[0]}}


def parse_recipe(data: dict[str, Any], where: str = "recipe") -> Recipe:
    """Validate merged recipe layers into a `Recipe`.

    Raises InvalidInput for the first problem, its field the key path (``recipe.train.loss.name``)
    and its message what is allowed: the loss names for an unknown loss, a table's keys for an
    unknown key, the family's options for an unknown env option.
    """
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise _recipe_error(e.errors()[0], where) from None


def _recipe_error(err: Any, where: str) -> InvalidInput:
    loc = list(err["loc"])
    shown = error_loc(Recipe, loc)  # without the union's tag: train.loss.key, not train.loss.<name>.key
    path = ".".join([where, *map(str, shown)])
    ctx = err.get("ctx") or {}
    cause = ctx.get("error")
    if isinstance(cause, InvalidInput):  # raised by a validator with a field relative to `path`
        return InvalidInput(f"{path}.{cause.field}", cause.message)
    kind = err["type"]
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        found = f"unknown loss {ctx['tag']!r}" if "tag" in ctx else "missing"
        return InvalidInput(f"{path}.name", f"{found}; choose one of {loss_names()}")
    if kind == "model_attributes_type" and shown == ["train", "loss"]:
        return InvalidInput(path, f'must be a table with a name, e.g. [train.loss] name = "ppo"; losses: {loss_names()}')
    if kind == "extra_forbidden":
        model = _model_at(Recipe, loc[:-1])
        allowed = ", ".join(sorted(model.model_fields)) if model is not None else "see docs/recipes.md"
        return InvalidInput(path, f"unknown key; allowed keys: {allowed}")
    if kind == "missing":
        return InvalidInput(path, "required key is missing")
    return InvalidInput(path, err["msg"])


def _model_at(model: type[BaseModel], loc: list[Any]) -> type[BaseModel] | None:
    """The model class of the table at `loc` inside `model` (None where it is a plain dict)."""
    current: type[BaseModel] | None = model
    choices: dict[str, type[BaseModel]] = {}
    for part in loc:
        if part in choices:  # a discriminated union's tag
            current, choices = choices[part], {}
            continue
        if current is None or part not in current.model_fields:
            return None
        current, choices = _table_type(current.model_fields[part].annotation)
    return current


def _table_type(annotation: Any) -> tuple[type[BaseModel] | None, dict[str, type[BaseModel]]]:
    """(the model a field holds, or None; the union members by tag when it holds a union)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, {}
    if get_origin(annotation) is Annotated:
        return _table_type(get_args(annotation)[0])
    members = [a for a in get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
    if len(members) == 1:
        return members[0], {}
    tagged = {get_args(m.model_fields["name"].annotation)[0]: m for m in members if "name" in m.model_fields}
    return None, tagged
