"""ServerConfig: how `floe serve` listens and what it accepts (the `[server]` TOML table;
command-line flags override it)."""

from __future__ import annotations

from pydantic import Field

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
    served_model_name: str | None = Field(None, description="model id of the OpenAI endpoints; default: backend.model")
    log_level: str = "info"

    @property
    def max_request_bytes(self) -> int:
        return int(self.max_request_mb * (1 << 20))
