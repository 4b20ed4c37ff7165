"""One local Ray cluster for a stack suite's framework runs, started once and joined by each run.

verl's `main_ppo` and SkyRL's `main_base` call `ray.init()` only when Ray is not initialised, and
`ray.init()` joins the cluster named by $RAY_ADDRESS instead of starting one (Ray's own rule):
so the runs of a suite join one `ray start --head` cluster instead of starting and stopping
their own (about 12 s of start-up and 2 s of shutdown per run on this 2-core machine). Each run
is still its own Ray job: its workers, actors and placement groups end with its driver.

The cluster is started with the environment the runs would give their own cluster (its workers
inherit it, as they inherit a driver's when the driver starts the cluster), on this node only,
with `--block`, so that terminating that one process stops every process of the cluster and no
other Ray cluster on the machine; and with a temp dir of its own, because `ray start` records
its address in the temp dir's `ray_current_cluster`, where any other plain `ray.init()` on the
machine (another suite, another user) would find and join it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.server.conftest import free_port

START_TIMEOUT_S = 180.0


@contextmanager
def ray_cluster(env: dict[str, str], log_path: Path, num_cpus: int | None = None) -> Iterator[str]:
    """A local Ray head (`python -m ray.scripts.scripts start --head --block`) with `env` and
    `num_cpus` logical CPUs (None: Ray's count of this machine's cores, as a plain `ray.init()`),
    named by this process's $RAY_ADDRESS (which the runs' environments copy) until it is stopped
    on exit; yields its address. AssertionError with the log's tail when it is not up within
    START_TIMEOUT_S."""
    address = f"127.0.0.1:{free_port()}"
    temp_dir = tempfile.mkdtemp(prefix="floe-ray-")  # short: Ray's unix sockets live under it (108-byte paths)
    # Each pytest-xdist worker runs a cluster of its own: without disjoint worker-port ranges two
    # raylets hand out the same port (Ray's default range is 10002-19999), and a driver's core
    # worker then dies on "Address already in use" (seen once in CI's SkyRL suite).
    low = 10002 + 2000 * int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--disable-usage-stats",
           f"--port={address.split(':')[1]}", "--include-dashboard=false",
           f"--temp-dir={temp_dir}", f"--min-worker-port={low}", f"--max-worker-port={low + 1999}"]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    with open(log_path, "wb") as log:
        # RAY_AUTH_MODE=disabled: `ray start` (Ray >= 2.60) turns on token authentication, which the
        # runs' drivers (and the clusters their own `ray.init` starts) do not use
        head = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**env, "RAY_AUTH_MODE": "disabled"},
                                start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "Ray runtime started" not in log_path.read_text(errors="replace"):
            assert head.poll() is None, f"ray start exited {head.returncode}:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"ray start not up in {START_TIMEOUT_S:.0f} s:\n{log_path.read_text()[-3000:]}"
            time.sleep(0.5)
        os.environ["RAY_ADDRESS"] = address
        yield address
    finally:
        os.environ.pop("RAY_ADDRESS", None)
        head.terminate()  # `ray start --block` stops the processes it started, then exits
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, 9)
            head.wait(10)
        shutil.rmtree(temp_dir, ignore_errors=True)
