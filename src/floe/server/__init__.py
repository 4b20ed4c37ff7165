"""The remote backend: `floe serve` (FastAPI + uvicorn) and the wire format shared with
`floe.client.http`. Importing this package is cheap; the app and CLI live in submodules.

  wire.py      binary wire format (safetensors + control JSON), pure functions, both sides
  errors.py    error <-> HTTP status/JSON mapping, both sides
  settings.py  ServerConfig (the `[server]` table and CLI flags)
  auth.py      bearer-token check and the loopback rule
  ordering.py  per-client sequencing and idempotent retries
  metrics.py   Prometheus metrics
  logs.py      JSON-lines logging
  openai.py    OpenAI-compatible sampling endpoints
  app.py       the FastAPI app
  cli.py       `floe serve` (serve_main) and graceful shutdown
"""
