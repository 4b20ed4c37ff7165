"""ServerConfig: how `floe serve` listens and what it accepts (the `[server]` TOML table;
command-line flags override it)."""

from __future__ import annotations

from pydantic import Field, field_validator

from floe.config import StrictModel


class ServerConfig(StrictModel):
    host: str = "127.0.0.1"
    port: int = Field(7000, ge=0, le=65535)
    token: str | None = Field(None, description="bearer token; required unless host is loopback")
    max_request_mb: float = Field(256, gt=0, description="larger request bodies get 413, on every route")
    body_timeout_s: float = Field(120, gt=0, description="a request body must arrive within this time (then 408)")
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="Host names clients may use besides loopback names and the listening address ('*' = any); "
        "others get 421 (DNS rebinding)",
    )
    allowed_origins: list[str] = Field(
        default_factory=list,
        description="browser origins (scheme://host[:port]) allowed to send state-changing requests; others get 403",
    )
    header_timeout_s: float = Field(30, gt=0, description="a connection must send a complete request head within "
                                    "this time (of opening, or of its previous response); else it is closed")
    max_connections: int = Field(256, ge=1, description="open connections; at the limit a new one replaces the one "
                                 "waiting longest for a request head, or is closed when all are mid-request")
    pause_hold_s: float = Field(300, gt=0, description="how long a sampling request waits while sampling is paused "
                                "(POST /pause), then 503")
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
        description="X-API-Key values of the Tinker protocol's tenants (/api/v1), each starting 'tml-' (the SDK "
        "requires it); each key owns its runs, samplers, sessions and checkpoints",
    )
    tinker_base_models: list[str] = Field(
        default_factory=list,
        description="more base models Tinker runs may name (local directories or hub ids), besides [backend] model "
        "(the default); each loads on first use",
    )
    tinker_max_live_runs: int = Field(16, ge=1, description="Tinker training runs kept in memory; the least recently "
                                      "used beyond it are offloaded to disk exactly and come back when used")
    tinker_max_live_samplers: int = Field(32, ge=1, description="Tinker samplers kept in memory (the rest wait on disk)")
    tinker_max_live_bases: int = Field(2, ge=1, description="base models kept in memory (their runs and samplers "
                                       "leave with them)")
    tinker_max_sessions: int = Field(64, ge=1, description="open Tinker sessions per key")
    tinker_max_runs: int = Field(1000, ge=1, description="open Tinker training runs per key (a finished "
                                 "session's runs do not count)")
    tinker_max_checkpoints: int = Field(5000, ge=1, description="Tinker checkpoints per key")
    tinker_max_samplers_per_session: int = Field(4096, ge=1, description="samplers per Tinker session")
    tinker_max_queued_per_key: int = Field(
        256, ge=1, description="Tinker requests one key may have accepted but not started (waiting for a worker or "
        "for their seq_id's turn); past it a request is refused with 429, which the tinker SDK waits on and resends")
    tinker_max_queued_mb_per_key: int = Field(
        1024, ge=1, description="MiB of forward_backward bodies one key's not yet started Tinker requests may hold "
        "(a gapped seq_id's body waits in memory for its turn); past it 429 as for tinker_max_queued_per_key (one "
        "request always fits)")
    tinker_max_samples_per_request: int = Field(1024, ge=1, description="num_samples of one Tinker sample request")
    tinker_max_sampled_tokens_per_request: int = Field(
        1 << 20, ge=1, description="num_samples x max_tokens of one Tinker sample request")
    tinker_max_stability_tokens: int = Field(
        1 << 23, ge=1, description="tokens of stability info kept per Tinker key (record_stability_info=true: each "
        "sampled sequence's tokens and sampler log-probs, which stable_reinforce trains with; 8 bytes a token); the "
        "key's oldest records go first")
    tinker_session_timeout_s: float = Field(
        600, gt=0, description="a Tinker session without a heartbeat for this long ends (its runs and samplers are "
        "freed; checkpoints stay)")
    tinker_long_poll_s: float = Field(
        20, gt=0, lt=45, description="how long one retrieve_future waits for a result before answering 408 try_again "
        "(the SDK polls again at once, quietly); under the SDK's 45 s read timeout")
    tinker_min_ttl_s: int = Field(
        3600, ge=1, description="the shortest checkpoint ttl_seconds accepted (the SDK documents 1 hour); lower it "
        "only to test expiry: expired checkpoints are swept at least this often")
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
