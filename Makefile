# The README's commands. `make train` runs the main job, `make test` the test suite; both set
# up .venv first (scripts/setup.sh), so they work on a fresh clone.
.PHONY: setup train test lint

setup:
	@bash scripts/setup.sh

train: setup
	.venv/bin/floe train recipes/reverse_text.toml

test: setup
	.venv/bin/python -m pytest -q

lint: setup
	.venv/bin/ruff check src tests benchmarks docs/examples
	.venv/bin/pyright
