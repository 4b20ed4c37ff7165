"""The Tinker training protocol (tinker SDK 0.38) on `floe serve`: `/api/v1/*` routes
(`routes.py`), their state and operations (`service.py`), futures and per-run ordering
(`futures.py`), wire conversion (`convert.py`) and the protobuf schema (`schema.py`). Training
runs are LoRA adapters on one shared base model, or (with `[server] tinker_full_finetune`) one
full fine-tune run (`floe.backend.runs`)."""

from floe.server.protocols.tinker.routes import tinker_router

__all__ = ["tinker_router"]
