"""The remote backend: `floe serve` (FastAPI + uvicorn). Importing this package is cheap; the app
and CLI live in submodules. The wire format and remote errors shared with `floe.client.http`
live in `floe.protocol`.

  app.py         the FastAPI app: /api/{op} for every floe.protocol.ops.Op, health, info, metrics
  errors.py      ApiError (the server's own HTTP refusals) and exception -> HTTP answer
  settings.py    ServerConfig (the `[server]` table and CLI flags)
  auth.py        bearer-token check and the loopback rule
  ordering.py    per-client sequencing and idempotent retries
  batching.py    window batching of concurrent OpenAI sampling requests into one Backend.sample
  metrics.py     Prometheus metrics
  logs.py        JSON-lines logging
  protocols/     openai.py (+ openai_render.py): OpenAI-compatible /v1; tinker/: the Tinker protocol
  cli.py         `floe serve` (serve_main) and graceful shutdown
"""
