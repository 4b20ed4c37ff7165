"""`python -m floe.server CONFIG.toml ...`: the same as `floe serve`."""

import sys

from floe.server.cli import serve_main

if __name__ == "__main__":
    sys.exit(serve_main(sys.argv[1:]))
