"""The recipe: one pydantic model for everything `floe train` / `floe sft` / `floe eval` read.

A recipe is a TOML file (plus `@` overlays and `--section.key value` overrides, merged by
`floe.config.load_layers`). Every table forbids unknown keys. See docs/recipes.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from floe.config import BackendConfig, StrictModel


class TinyModelConfig(StrictModel):
    """Dimensions of a tiny Qwen3 that floe builds itself (random init, char tokenizer)."""

    hidden_size: int = Field(128, gt=0)
    intermediate_size: int = Field(384, gt=0)
    num_hidden_layers: int = Field(4, gt=0)
    num_attention_heads: int = Field(4, gt=0)
    num_key_value_heads: int = Field(2, gt=0)
    max_position_embeddings: int = Field(512, gt=0)
    seed: int = 0


class ModelConfig(StrictModel):
    """Where the policy starts: an HF directory / hub id, or a tiny model floe builds."""

    path: str | None = None
    tiny: TinyModelConfig | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> "ModelConfig":
        if (self.path is None) == (self.tiny is None):
            raise ValueError("set exactly one of model.path or [model.tiny]")
        return self


class WarmStartConfig(StrictModel):
    """SFT on the environment's demonstrations before RL; the result is cached by its config."""

    steps: int = Field(200, ge=1)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(3e-3, gt=0)
    warmup_steps: int = Field(10, ge=0)
    seed: int = 0


class EnvConfig(StrictModel):
    name: str = "reverse_text"
    options: dict[str, Any] = Field(default_factory=dict)


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
    loss: str = "ppo"
    loss_config: dict[str, Any] = Field(default_factory=dict)
    minibatches: int = Field(1, ge=1, description="optimizer steps per batch")
    max_off_policy_steps: int = Field(
        0, ge=0, description="0 = synchronous; k > 0 lets sampling run up to k steps ahead of training"
    )
    advantage: AdvantageConfig = AdvantageConfig()
    seed: int = 0


class EvalConfig(StrictModel):
    every: int = Field(10, ge=0, description="0 = only at the start and the end")
    size: int = Field(64, ge=1)
    greedy: bool = Field(True, description="greedy decoding; false samples at `temperature`")
    samples_per_task: int = Field(1, ge=1, description="episodes per held-out task (sampled eval)")
    temperature: float = Field(1.0, gt=0)
    max_tokens: int | None = None
    seed: int = 1234


class OutputConfig(StrictModel):
    run_dir: str = "runs/run"
    checkpoint_every: int = Field(10, ge=0, description="0 = only at the end")
    keep_checkpoints: int = Field(2, ge=1)
    rollouts_per_step: int = Field(4, ge=0, description="readable rollouts written per step")
    progress: bool = True
    wandb: bool = False
    wandb_project: str = "floe"
    tensorboard: bool = False


class Recipe(StrictModel):
    """Everything a run needs. `backend` is a BackendConfig without `model` (set by [model]);
    its `state_dir` defaults to <output.run_dir>/states."""

    model: ModelConfig
    warm_start: WarmStartConfig | None = None
    backend: dict[str, Any] = Field(default_factory=dict)
    env: EnvConfig = EnvConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    output: OutputConfig = OutputConfig()

    @model_validator(mode="after")
    def _backend_has_no_model(self) -> "Recipe":
        if "model" in self.backend:
            raise ValueError("set the model in [model], not backend.model")
        BackendConfig.model_validate({"model": "x", **self.backend})  # fail early on bad keys
        return self

    @property
    def state_dir(self) -> str:
        """backend.state_dir when the recipe sets it, else <output.run_dir>/states."""
        return self.backend.get("state_dir") or str(Path(self.output.run_dir) / "states")

    def backend_config(self, model_path: str) -> BackendConfig:
        return BackendConfig.model_validate({**self.backend, "model": model_path, "state_dir": self.state_dir})
