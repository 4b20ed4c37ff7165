"""Same-host weight sync through shared memory (floe.backend.sync.shared), host-memory path:
a sender process writes the weights of a tied tiny model into its /dev/shm segment and a
receiver process with a real SamplerZone on that model takes the handle (JSON, through a file).

Checked: the weights arrive bit-identical, the receiver's fingerprints equal the sender's, the
tied tensor is written once (bytes), tampered handles (an offset past the end, a shape larger
than its bytes, a shape the engine does not hold, a dtype it does not hold, a segment name that
is a path) are StateErrors that leave the sampler incomplete, and a good handle repairs it; the
sender reuses its segment, grows it (unlinking the old file) and unlinks it at close.

The CUDA IPC path (`cuda_ipc=True`) is not run here (no GPU in CI): benchmarks/bench_sync.py.
"""

from __future__ import annotations

import copy
import json
import multiprocessing
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from floe.backend.sync.broadcast import bucketed
from floe.backend.sync.shared import SHM_DIR, SharedSegment
from floe.errors import StateError
from floe.models import make_tiny
from tests.spawn import run_all

SMALL_BUCKET = 20_000  # bytes: several buckets on the tiny model
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm")


def _weights(model_path: str) -> dict[str, torch.Tensor]:
    """The tied model's weights changed deterministically; the tie kept (one tensor, two names)."""
    from floe.models import load_model

    model = load_model(model_path)
    state = model.state_dict()
    out, seen = {}, {}
    for i, (k, v) in enumerate(state.items()):
        key = v.data_ptr()
        if key not in seen:
            seen[key] = v * 1.5 + 0.01 * (i + 1)
        out[k] = seen[key]
    return out


def _sender(model_path: str, out_dir: str, written: Any, done: Any) -> None:
    torch.set_num_threads(1)
    weights = _weights(model_path)
    segment = SharedSegment()
    handle, prints, size = segment.write(bucketed(weights.items(), SMALL_BUCKET))
    Path(out_dir, "handle.json").write_text(json.dumps(handle))
    path = os.path.join(SHM_DIR, handle["segment"])
    out = {"fingerprints": {k: list(v) for k, v in prints.items()}, "bytes": size, "file_size": os.path.getsize(path)}
    Path(out_dir, "sender.json").write_text(json.dumps(out))
    written.set()
    assert done.wait(300)
    segment.close()
    out["unlinked"] = not os.path.exists(path)
    Path(out_dir, "sender.json").write_text(json.dumps(out))


def _receiver(model_path: str, out_dir: str, written: Any, done: Any) -> None:
    torch.set_num_threads(1)
    import floe
    from floe.backend.sampler import SamplerZone
    from floe.backend.sync.shared import receive_shared
    from floe.config import TorchEngineConfig
    from floe.models import load_model, load_tokenizer
    from floe.sampler import EngineSource, build_engine

    source = EngineSource(load_model(model_path), model_path, load_tokenizer(model_path))
    zone = SamplerZone(build_engine(TorchEngineConfig(max_batch_sequences=8), source), "torch", 0)
    weights = _weights(model_path)
    zone.receive({k: torch.zeros_like(v) for k, v in weights.items()})  # so that the sync must change them
    assert written.wait(300)
    good = json.loads(Path(out_dir, "handle.json").read_text())
    out: dict[str, Any] = {}
    try:
        entries = [e for bucket in good["buckets"] for e in bucket]
        out["offsets"] = {e[0]: e[3] for e in entries}

        def tampered(change) -> dict[str, Any]:
            bad = copy.deepcopy(good)
            change(bad)
            try:
                receive_shared(zone, bad)
            except StateError as e:
                return {"error": str(e), "complete": zone.weights_complete}
            return {"error": None, "complete": zone.weights_complete}

        big = max(entries, key=lambda e: e[3])  # the last tensor written

        def past_end(h):
            h["buckets"][-1][-1][3] = 1 << 40

        def larger(h):
            for e in h["buckets"][-1]:
                if e[0] == big[0]:
                    e[1] = [e[1][0] * 1000, *e[1][1:]]

        def transposed(h):
            first = h["buckets"][0][0]
            first[1] = list(reversed(first[1])) if len(first[1]) == 2 and first[1][0] != first[1][1] else [1, *first[1]]

        def dtype(h):
            h["buckets"][0][0][2] = "float64"

        def path(h):
            h["segment"] = "../../etc/passwd"

        out["bad"] = {name: tampered(fn) for name, fn in (("past_end", past_end), ("larger", larger),
                                                         ("transposed", transposed), ("dtype", dtype), ("path", path))}
        prints = receive_shared(zone, good)
        held = zone.model.state_dict()
        out["fingerprints"] = {k: list(v) for k, v in prints.items()}
        out["complete"] = zone.weights_complete
        out["equal"] = all(torch.equal(held[k], v) for k, v in weights.items())
        zone.set_version(1)
        params = floe.SamplingParams(max_tokens=4, seed=1)
        out["samples"] = [s.tokens for s in zone.sample([[10, 11]], 2, params).groups[0].samples]
    finally:
        Path(out_dir, "receiver.json").write_text(json.dumps(out))
        done.set()


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tied") / "tiny", hidden_size=64, num_hidden_layers=2,
                     tie_word_embeddings=True)


def test_shared_memory_sync_between_two_processes(tied_model, tmp_path) -> None:
    ctx = multiprocessing.get_context("spawn")
    written, done = ctx.Event(), ctx.Event()
    procs = [ctx.Process(target=fn, args=(str(tied_model), str(tmp_path), written, done)) for fn in (_sender, _receiver)]
    run_all(procs, "a shared-memory sync process")
    sender = json.loads((tmp_path / "sender.json").read_text())
    got = json.loads((tmp_path / "receiver.json").read_text())

    weights = _weights(str(tied_model))
    assert weights[EMBED] is weights[HEAD]
    unique = sum(t.numel() * t.element_size() for k, t in weights.items() if k != HEAD)
    assert sender["bytes"] == unique  # the tied tensor written once
    assert got["offsets"][EMBED] == got["offsets"][HEAD]  # ... and both names alias one offset
    assert got["fingerprints"] == sender["fingerprints"] and got["equal"] and got["complete"]
    assert sender["unlinked"]
    for case, seen in got["bad"].items():
        assert seen["error"] is not None and seen["error"].startswith("sync_weights:"), case
        assert not seen["complete"], case
    assert "outside the" in got["bad"]["past_end"]["error"] and "outside the" in got["bad"]["larger"]["error"]
    assert "holds float32" in got["bad"]["dtype"]["error"]
    assert "not a floe sync segment" in got["bad"]["path"]["error"]
    assert len(got["samples"]) == 2


def test_segment_reused_grown_and_unlinked() -> None:
    g = torch.Generator().manual_seed(0)
    small = {"a": torch.randn(10, generator=g), "b": torch.randn(3, 3, generator=g).to(torch.bfloat16)}
    large = {**small, "c": torch.randn(5000, generator=g)}
    segment = SharedSegment()
    try:
        first, _, size = segment.write([small])
        assert size == 10 * 4 + 9 * 2
        again, _, _ = segment.write([small])
        assert again["segment"] == first["segment"]  # reused
        grown, _, _ = segment.write([dict(list(large.items())[:2]), {"c": large["c"]}])
        assert grown["segment"] != first["segment"] and not os.path.exists(os.path.join(SHM_DIR, first["segment"]))
        assert [[e[0] for e in bucket] for bucket in grown["buckets"]] == [["a", "b"], ["c"]]
        assert all(e[3] % 64 == 0 for bucket in grown["buckets"] for e in bucket)
        with pytest.raises(StateError, match="not finite"):
            segment.write([{"a": torch.tensor([1.0, float("nan")])}])
    finally:
        name = segment.name
        segment.close()
    assert name is not None and not os.path.exists(os.path.join(SHM_DIR, name))


def test_cuda_ipc_guards_on_cpu() -> None:
    """The CUDA IPC path is not run here (no GPU); its guards are: CPU tensors with cuda_ipc
    asked for still go through /dev/shm, and a CUDA handle reaching a CPU receiver is refused."""
    from floe.backend.sync.shared import apply_shared

    segment = SharedSegment()
    try:
        handle, _, _ = segment.write([{"a": torch.ones(4)}], cuda_ipc=True)
        assert handle["kind"] == "shm"
        got: dict[str, torch.Tensor] = {}
        apply_shared(handle, {"a": "float32"}, lambda b: got.update({k: v.clone() for k, v in b.items()}))
        assert torch.equal(got["a"], torch.ones(4))
    finally:
        segment.close()
    fake = {"kind": "cuda_ipc", "device_uuid": "GPU-0", "ipc": [0, "00", 8, 0, "00", 0, "00", False], "buckets": []}
    with pytest.raises(StateError, match="CUDA IPC handle reached a receiver on cpu"):
        apply_shared(fake, {}, lambda b: None, "cpu")
    with pytest.raises(StateError, match='kind is not "shm"'):
        apply_shared({"kind": "pickle"}, {}, lambda b: None)
