"""SkyRL 0.4.0 on Python 3.11: the one-line TypedDict shim, installed as a ``.pth`` file.

SkyRL declares Python >= 3.12; on 3.11 its pydantic models fail to import with "Please use
typing_extensions.TypedDict instead of typing.TypedDict on Python < 3.12". The fix must run
before ``python -m skyrl...`` imports SkyRL, and in every Ray worker too, so it is a ``.pth``
file in the environment's site-packages (Python runs ``import`` lines of ``.pth`` files at
start-up). Install it once per environment::

    python -m floe.integrations.skyrl.py311            # writes floe-skyrl-py311.pth

On Python >= 3.12 nothing is written (nothing is needed). The line imports only the standard
library and ``typing_extensions``, never floe, so start-up stays cheap.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

from floe.atomic import atomic_write_text

PTH_NAME = "floe-skyrl-py311.pth"
PTH_LINE = (
    "import sys, typing; sys.version_info < (3, 12) and "
    "setattr(typing, 'TypedDict', __import__('typing_extensions').TypedDict)\n"
)


def install(site_packages: Path | None = None) -> Path | None:
    """Write the shim into ``site_packages`` (default: this interpreter's purelib).

    Returns the written path, or None on Python >= 3.12 where no shim is needed. Idempotent.
    """
    if sys.version_info >= (3, 12):
        return None
    target = Path(site_packages or sysconfig.get_paths()["purelib"]) / PTH_NAME
    atomic_write_text(target, PTH_LINE)
    return target


def main() -> None:
    """Command line: install the shim for the running interpreter and say where."""
    path = install()
    print(f"floe: SkyRL Python 3.11 shim {'written to ' + str(path) if path else 'not needed on this Python'}")


if __name__ == "__main__":
    main()
