# The README's commands. `make train` runs the main job, `make test` the test suite; both set
# up .venv first (scripts/setup.sh), so they work on a fresh clone.
.PHONY: setup train test lint

setup:
	@bash scripts/setup.sh

# torch's AVX2 kernels (and MKL's AVX2 reproducibility mode) on every x86-64 CPU, so the README's
# numbers repeat exactly on any of them; plain `floe train` uses the machine's best kernels
# (README: what varies).
train: setup
	ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 .venv/bin/floe train recipes/reverse_text.toml

# Two pytest-xdist workers, one test file each at a time (module fixtures built once): the
# suite's own process uses about one core (subprocess and server start-ups, waits), so the
# second core is used; README "## Tests" has the numbers. The ten slowest tests are listed.
test: setup
	.venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=10

lint: setup
	.venv/bin/ruff check src tests benchmarks docs/examples
	.venv/bin/pyright
