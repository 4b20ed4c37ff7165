"""ServerConfig: how `floe serve` listens and what it accepts (the `[server]` TOML table;
command-line flags override it)."""

from __future__ import annotations

from pydantic import Field, field_validator

from floe.config import StrictModel


class ServerConfig(StrictModel):
    host: str = "127.0.0.1"
    port: int = Field(7000, ge=0, le=65535)
    token: str | None = Field(None, description="bearer token; required unless host is loopback")
    max_request_mb: float = Field(256, gt=0, description="larger request bodies get 413")
    sequence_timeout_s: float = Field(30, gt=0, description="how long request k waits for k-1 (then 425)")
    result_window: int = Field(16, ge=1, description="results kept per client for retried requests")
    max_clients: int = Field(1024, ge=1, description="clients whose sequence state is kept (LRU)")
    graceful_timeout_s: float = Field(120, gt=0, description="how long shutdown waits for in-flight requests")
    served_model_name: str | None = Field(
        None, description="model id of the OpenAI endpoints; default: the model's directory name (or hub id)"
    )
    openai_batch_window_ms: float = Field(
        5, ge=0, le=1000, description="OpenAI requests arriving within this window are sampled together; 0 = off"
    )
    openai_batch_max_sequences: int = Field(256, ge=1, description="rows (prompts x n) of one batched OpenAI sample call")
    tinker_api_keys: list[str] = Field(
        default_factory=list,
        description="X-API-Key values the Tinker protocol (/api/v1) accepts, each starting 'tml-' (the SDK "
        "requires it); none = only a loopback server answers it",
    )
    tinker_chunk_datums: int = Field(
        1024, ge=1, description="datums per forward_backward request the tinker SDK sends (its client config)"
    )
    tinker_full_finetune: bool = Field(
        False,
        description="Tinker runs train every weight of their own model copy instead of a LoRA adapter (the SDK "
        "always sends a lora_config: its rank and seed do not apply); one such run at a time",
    )
    log_level: str = "info"

    @field_validator("tinker_api_keys")
    @classmethod
    def _tinker_key_prefix(cls, keys: list[str]) -> list[str]:
        bad = [k for k in keys if not k.startswith("tml-") or len(k) < 8]
        if bad:
            raise ValueError("each key must start with 'tml-' and have at least 4 more characters (the tinker SDK refuses others)")
        return keys

    @property
    def max_request_bytes(self) -> int:
        return int(self.max_request_mb * (1 << 20))
