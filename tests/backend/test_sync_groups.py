"""Standalone process groups (floe.backend.sync.groups) over gloo, in spawned processes.

Every process first initialises torch.distributed's default group as a world of its own (what
vLLM's in-process engine does in a sampler process), then joins one standalone group of three;
the weight broadcast (floe.backend.sync.broadcast) runs over it with a sender and two
receivers, and the default group is untouched afterwards. Also: bad arguments are refused
before anything listens, and a rank whose peers never come fails after the group's timeout.
"""

from __future__ import annotations

import json
import multiprocessing
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from floe.backend.sync.groups import standalone_group
from floe.errors import InvalidInput
from tests.spawn import collective_timeout, run_all


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"w.fp32": torch.randn(40, 9, generator=g), "w.bf16": torch.randn(17, generator=g).to(torch.bfloat16),
            "w.int64": torch.arange(-5, 6)}


def _member(rank: int, own_port: int, group_port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    from floe.backend.sync.broadcast import bucketed, receive_weights, send_weights

    # The engine's own default group: a world of one (as vLLM's in-process engine makes).
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{own_port}", rank=0, world_size=1,
                            timeout=collective_timeout())
    group = standalone_group("gloo", "127.0.0.1", group_port, rank, 3, collective_timeout().total_seconds())
    out: dict[str, Any] = {"rank": group.rank(), "size": group.size()}
    if rank == 0:
        prints, sent = send_weights(group, 0, bucketed(_weights().items(), 200))
        out["sent"] = {k: list(v) for k, v in prints.items()}
        out["bytes"] = sent
    else:
        got: dict[str, torch.Tensor] = {}
        for bucket in receive_weights(group, 0, "cpu"):
            got.update({k: v.clone() for k, v in bucket.items()})
        out["equal"] = {k: [str(v.dtype), torch.equal(v, _weights()[k])] for k, v in got.items()}
    out["default"] = [dist.get_rank(), dist.get_world_size()]
    dist.destroy_process_group()
    Path(out_dir, f"member{rank}.json").write_text(json.dumps(out))


def test_broadcast_over_a_standalone_group_beside_each_process_default_group(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    group_port = _free_port()
    procs = [ctx.Process(target=_member, args=(r, _free_port(), group_port, str(tmp_path))) for r in range(3)]
    run_all(procs, "a group member")
    sender, *receivers = (json.loads((tmp_path / f"member{r}.json").read_text()) for r in range(3))
    assert [sender["rank"], *(r["rank"] for r in receivers)] == [0, 1, 2]
    assert all(m["size"] == 3 for m in (sender, *receivers))
    assert all(m["default"] == [0, 1] for m in (sender, *receivers))  # each default group stayed a world of one
    total = sum(t.numel() * t.element_size() for t in _weights().values())
    assert sender["bytes"] == total and sorted(sender["sent"]) == sorted(_weights())
    for got in receivers:
        assert got["equal"] == {"w.fp32": ["torch.float32", True], "w.bf16": ["torch.bfloat16", True],
                                "w.int64": ["torch.int64", True]}


@pytest.mark.parametrize(("args", "field"), [
    (("mpi", 0, 2), "backend"), (("gloo", 2, 2), "rank"), (("gloo", -1, 2), "rank"),
])
def test_bad_arguments_are_refused_before_anything_listens(args: tuple[str, int, int], field: str) -> None:
    backend, rank, world = args
    port = _free_port()
    with pytest.raises(InvalidInput) as info:
        standalone_group(backend, "127.0.0.1", port, rank, world, 5)
    assert info.value.field == field
    with socket.socket() as s:  # nothing took the port
        s.bind(("127.0.0.1", port))


def test_a_rank_whose_peers_never_join_fails_after_the_timeout() -> None:
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="(?i)timed out"):  # torch.distributed.DistStoreError
        standalone_group("gloo", "127.0.0.1", _free_port(), 0, 2, 2.0)
    assert 1.5 <= time.monotonic() - began < 30
