"""The protocols `floe serve` speaks besides floe's native operations (floe.server.app), each
a FastAPI router the app includes: openai.py (OpenAI-compatible sampling under /v1; answers
built by openai_render.py) and tinker/ (the Tinker protocol)."""
