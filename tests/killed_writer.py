"""A real floe.atomic writer in a child process, killed at a chosen point (tests of crashed saves)."""

# A child that rewrites `final` through atomic_directory (copying `source` in) and is SIGKILLed
# at its `kill_at`-th os.replace (2 = between the two renames of an overwrite), or, with
# kill_at = 0, waits for `go` to appear before finishing (a live concurrent writer).
WRITER = r"""
import os, shutil, signal, sys, time
from pathlib import Path
import floe.atomic as atomic
final, source, kill_at, go = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
real, calls = os.replace, [0]
def replace(a, b):
    calls[0] += 1
    if calls[0] == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(a, b)
atomic.os.replace = replace
with atomic.atomic_directory(final, replace=True) as tmp:
    for f in source.iterdir():
        shutil.copy(f, tmp / f.name)
    (tmp / "writer.txt").write_text(str(os.getpid()))
    print("inside", flush=True)
    while kill_at == 0 and not go.exists():
        time.sleep(0.05)
print("done", flush=True)
"""
