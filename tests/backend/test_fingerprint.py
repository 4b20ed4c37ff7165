"""Fingerprints are exact and order-independent; the finiteness check is separate and cheap."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from floe.backend.sync import bucketed, check_publishable
from floe.backend.weights import WeightsSnapshot
from floe.errors import StateError
from floe.sampler.engine import BLOCK_WORDS, fingerprint, fingerprints, is_finite, nonfinite


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(3 * BLOCK_WORDS + 5, generator=g).to(torch.bfloat16),  # tail not a whole word
        "b": torch.randn(17, 33, generator=g),
        "c": torch.randn(2, 4, generator=g).half(),
        "d": torch.arange(7, dtype=torch.int32),
    }


_CHILD = """
import sys, torch
torch.set_num_threads(int(sys.argv[1]))
from floe.sampler.engine import fingerprint
g = torch.Generator().manual_seed(1)
t = torch.randn(1_000_003, generator=g).to(torch.bfloat16)
print(repr(tuple(fingerprint(t))))
"""


def test_fingerprint_is_the_same_for_one_and_two_threads():
    outs = {subprocess.run([sys.executable, "-c", _CHILD, str(n)], capture_output=True, text=True, check=True).stdout
            for n in (1, 2)}
    assert len(outs) == 1


def test_fingerprint_is_the_same_whatever_the_bucket_order_or_size():
    tensors = _tensors()
    whole = fingerprints(tensors)
    for size in (1, 64, 10_000, 1 << 30):
        for order in (list(tensors.items()), list(reversed(tensors.items()))):
            got = {}
            for bucket in bucketed(order, size):
                got.update(fingerprints(bucket))
            assert got == whole
    # a copy in a fresh buffer (another storage, another offset) has the same fingerprint
    buf = torch.empty(tensors["a"].numel() + 3, dtype=torch.bfloat16)
    buf[3:].copy_(tensors["a"])
    assert fingerprint(buf[3:]) == whole["a"]


def test_fingerprint_catches_wrong_stale_partial_and_permuted_weights():
    t = torch.randn(4 * BLOCK_WORDS * 4).to(torch.bfloat16)  # 4 blocks of int64 words
    fp = fingerprint(t)
    wrong = t.clone()
    wrong[123] = wrong[123] + 1
    assert fingerprint(wrong) != fp
    stale = torch.randn_like(t.float()).to(torch.bfloat16)
    assert fingerprint(stale) != fp
    partial = t.clone()
    partial[len(t) // 2:] = 0
    assert fingerprint(partial) != fp
    blocks = t.view(4, -1)
    permuted = blocks[[1, 0, 2, 3]].reshape(-1)
    assert fingerprint(permuted) != fp
    assert fingerprint(t.view(2, -1)) != fp  # shape is part of it
    assert fingerprint(t.view(torch.int16)) != fp  # and dtype
    assert fingerprint(t.clone()) == fp


def test_tied_tensors_are_fingerprinted_once_and_reported_under_both_names():
    w = torch.randn(8, 4)
    prints = fingerprints({"embed": w, "lm_head": w, "other": w.clone()})
    assert prints["embed"] == prints["lm_head"] == prints["other"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_finiteness_check_finds_nan_and_inf(dtype):
    t = torch.randn(10_001).to(dtype)
    assert is_finite(t)
    for bad in (float("nan"), float("inf"), float("-inf")):
        u = t.clone()
        u[5000] = bad
        assert not is_finite(u)
    big = torch.full((1000,), torch.finfo(dtype).max, dtype=dtype)  # the sum overflows, the values are finite
    assert is_finite(big)
    assert is_finite(torch.arange(5))
    assert nonfinite({"x": t, "y": torch.tensor([float("nan")], dtype=dtype)}) == ["y"]


def test_check_publishable_names_the_non_finite_tensor():
    tensors = _tensors()
    tensors["b"] = tensors["b"].clone()
    tensors["b"][0, 0] = float("inf")
    with pytest.raises(StateError, match="not finite in \\['b'\\]"):
        check_publishable(WeightsSnapshot(tensors, fingerprints(tensors), 0))


def test_tied_tensors_are_sent_once_and_both_names_hold_them():
    from floe.backend.sync import cast_tensors
    from floe.sampler.engine import copy_in_place

    w = torch.randn(8, 4)
    published = {"embed": w, "lm_head": w, "norm": torch.randn(4)}
    snapshot = WeightsSnapshot(published, fingerprints(published), 0)
    assert snapshot.bytes == (32 + 4) * 4  # the tied tensor counted once
    cast = cast_tensors(published, {"embed": "bfloat16", "lm_head": "bfloat16"})
    assert cast["embed"] is cast["lm_head"]
    assert WeightsSnapshot(cast, fingerprints(cast), 0).bytes == 32 * 2 + 4 * 4
    shared = torch.zeros(8, 4)
    own = {"embed": shared, "lm_head": shared, "norm": torch.zeros(4)}
    copy_in_place(own, published, "test")
    assert fingerprints(own) == fingerprints(published)
