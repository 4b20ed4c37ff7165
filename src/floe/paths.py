"""Where floe keeps files it can rebuild: the cache root, $FLOE_CACHE (default ~/.cache/floe).

Warm-started tiny models live under ``<cache>/models`` (floe.rl.warmstart) and the databases
text2sql generates under ``<cache>/text2sql`` (floe.envs.text2sql). Read at call time, so a
test or a user can point it elsewhere for one process.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$FLOE_CACHE, or ~/.cache/floe when it is unset or empty."""
    return Path(os.environ.get("FLOE_CACHE") or Path.home() / ".cache" / "floe").expanduser()
