"""Cross-process weight broadcast (floe.backend.sync.broadcast) over gloo: one sender and two
receivers holding real SamplerZones on the tiny model, in three spawned processes.

One world runs every scenario in order (process start-up dominates the time): a sync with
buckets smaller than the largest tensor, a sync in one bucket, mixed dtypes (bf16, fp32,
int64) round-tripping bit-exactly, a sender whose bucket source fails midway, and receivers
that cannot apply a bucket; after each failure a full sync must still work (the collectives
stayed in step); tied names (one tensor under two names) sent once. Each process writes what it saw to a JSON file; the test asserts on them.
"""

from __future__ import annotations

import json
import multiprocessing
import socket
from pathlib import Path
from typing import Any

import torch

from tests.spawn import collective_timeout, run_all

SMALL_BUCKET = 20_000  # bytes: below the tiny model's largest tensor (64 x 128 fp32 = 32,768 bytes)


def _weights(model_path: str) -> dict[str, torch.Tensor]:
    """The weights the sender publishes: the tiny model's, changed deterministically (every
    process can compute them to check what it received)."""
    from floe.models import load_model

    state = load_model(model_path).state_dict()
    return {k: v * 1.5 + 0.01 * (i + 1) for i, (k, v) in enumerate(state.items())}


def _mixed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "a.bf16": torch.randn(33, 7, generator=g).to(torch.bfloat16),
        "b.fp32": torch.randn(5, generator=g),
        "c.bf16": torch.randn(2, 3, 4, generator=g).to(torch.bfloat16),
        "d.int64": torch.randint(-(2**40), 2**40, (9,), generator=g),
        "e.scalar": torch.tensor(3.25),
    }


def _tied() -> dict[str, torch.Tensor]:
    """embed / lm_head one tensor (tied), first and last, a norm between them."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 8, generator=g)
    return {"embed": w, "norm": torch.randn(8, generator=g), "lm_head": w}


def _fps(prints: dict[str, Any]) -> dict[str, list[float]]:
    return {k: list(v) for k, v in prints.items()}


def _worker(rank: int, world: int, port: int, model_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    from floe.backend.sampler import SamplerZone
    from floe.backend.sync.broadcast import bucketed, receive_into, receive_weights, send_weights
    from floe.config import TorchEngineConfig
    from floe.models import load_model, load_tokenizer
    from floe.sampler import EngineSource, build_engine

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=collective_timeout())
    group = dist.group.WORLD
    out: dict[str, Any] = {}
    weights = _weights(model_path)
    largest = max(t.numel() * t.element_size() for t in weights.values())
    if rank == 0:
        for case, size in (("small", SMALL_BUCKET), ("one", 1 << 30)):
            prints, sent = send_weights(group, 0, bucketed(weights.items(), size))
            out[case] = {"fingerprints": _fps(prints), "bytes": sent}
        send_weights(group, 0, [{k: v for k, v in list(_mixed().items())[:3]}, dict(list(_mixed().items())[3:])])
        _, out["tied_bytes"] = send_weights(group, 0, bucketed(_tied().items(), 16 * 8 * 4))  # one tensor per bucket

        def failing():
            yield dict(list(weights.items())[:2])
            raise RuntimeError("the policy's gather failed")

        try:
            send_weights(group, 0, failing())
        except RuntimeError as e:
            out["abort"] = str(e)
        bogus = dict(list(weights.items())[:2])
        bogus["no.such.weight"] = torch.zeros(3)
        send_weights(group, 0, [bogus, dict(list(weights.items())[2:])])
        prints, _ = send_weights(group, 0, bucketed(weights.items(), SMALL_BUCKET))
        out["repair"] = _fps(prints)
    else:
        source = EngineSource(load_model(model_path), model_path, load_tokenizer(model_path))
        zone = SamplerZone(build_engine(TorchEngineConfig(max_batch_sequences=8), source), "torch", 0)
        for case, size in (("small", SMALL_BUCKET), ("one", 1 << 30)):
            zone.receive({k: torch.zeros_like(v) for k, v in weights.items()})  # so that the sync must change them
            zone.begin_receive()
            sizes, storages = [], []
            for bucket in receive_weights(group, 0, "cpu"):
                sizes.append(sum(t.numel() * t.element_size() for t in bucket.values()))
                storages.append(len({t.untyped_storage().data_ptr() for t in bucket.values()}))
                zone.receive_bucket(bucket)
            prints = zone.end_receive()
            held = zone.model.state_dict()
            out[case] = {
                "fingerprints": _fps(prints), "bucket_bytes": sizes, "storages": storages, "bound": max(size, largest),
                "equal": all(torch.equal(held[k], v) for k, v in weights.items()), "complete": zone.weights_complete,
            }
        got = {}
        for bucket in receive_weights(group, 0, "cpu"):
            got.update({k: v.clone() for k, v in bucket.items()})
        out["mixed"] = {k: [str(v.dtype), torch.equal(v, _mixed()[k])] for k, v in got.items()}
        tied = []
        for bucket in receive_weights(group, 0, "cpu"):
            tied.append({"names": list(bucket), "equal": all(torch.equal(v, _tied()[k]) for k, v in bucket.items()),
                         "storages": len({t.data_ptr() for t in bucket.values()})})
        out["tied"] = tied
        for case in ("abort", "bogus"):
            try:
                receive_into(zone, group, 0, "cpu")
            except Exception as e:  # noqa: BLE001 - recorded for the test
                out[case] = {"error": f"{type(e).__name__}: {e}", "complete": zone.weights_complete}
        out["repair"] = {"fingerprints": _fps(receive_into(zone, group, 0, "cpu")), "complete": zone.weights_complete}
        zone.set_version(1)  # what the Backend does once it verified the repair's fingerprints
        params = {"max_tokens": 4, "seed": 1}
        import floe

        out["samples"] = [s.tokens for s in zone.sample([[10, 11]], 2, floe.SamplingParams(**params)).groups[0].samples]
    dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_broadcast_one_sender_two_receivers(tiny_model, tmp_path):
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 3, port, str(tiny_model), str(tmp_path))) for r in range(3)]
    run_all(procs, "a broadcast process")
    sender, *receivers = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3))

    total = sum(t.numel() * t.element_size() for t in _weights(str(tiny_model)).values())
    assert sender["small"]["bytes"] == sender["one"]["bytes"] == total
    assert sender["small"]["fingerprints"] == sender["one"]["fingerprints"] == sender["repair"]
    for got in receivers:
        for case in ("small", "one"):
            seen = got[case]
            assert seen["fingerprints"] == sender[case]["fingerprints"] and seen["equal"] and seen["complete"]
            assert sum(seen["bucket_bytes"]) == total and max(seen["bucket_bytes"]) <= seen["bound"]
            assert all(n == 1 for n in seen["storages"])  # fp32 only: every tensor a view of one buffer
        assert len(got["small"]["bucket_bytes"]) > 5 and len(got["one"]["bucket_bytes"]) == 1
        assert got["small"]["bound"] > SMALL_BUCKET  # the largest tensor exceeded the bucket size, and went alone
        assert got["mixed"] == {"a.bf16": ["torch.bfloat16", True], "b.fp32": ["torch.float32", True],
                                "c.bf16": ["torch.bfloat16", True], "d.int64": ["torch.int64", True],
                                "e.scalar": ["torch.float32", True]}
        assert got["abort"]["error"].startswith("StateError: sync_weights: the policy aborted") and not got["abort"]["complete"]
        assert "differ in tensors" in got["bogus"]["error"] and not got["bogus"]["complete"]
        assert got["repair"] == {"fingerprints": sender["repair"], "complete": True}
        # Tied names travel together, once: one tensor's bytes, both names views of it.
        assert got["tied"] == [{"names": ["embed", "lm_head"], "equal": True, "storages": 1},
                               {"names": ["norm"], "equal": True, "storages": 1}]
    assert sender["tied_bytes"] == (16 * 8 + 8) * 4
    assert sender["abort"] == "the policy's gather failed"
    assert receivers[0]["samples"] == receivers[1]["samples"]
