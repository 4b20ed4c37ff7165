"""The backend measures its own forward / forward_backward calls (floe.types.THROUGHPUT_METRICS):
seconds, sequence tokens, tokens/s, model FLOPs by compute/flops.py, and MFU against a known
peak only. Tests/server/test_equivalence.py checks HTTP reports the same keys."""

from __future__ import annotations

import math
import time

import pytest
from transformers import AutoConfig

import floe
from floe.compute.flops import TransformerShape, forward_flops, training_flops
from floe.types import THROUGHPUT_METRICS


def _batch() -> floe.Batch:
    return floe.Batch([
        floe.Group([5, 6, 7, 8], [floe.Sample([9, 10, 11], logprobs=[-1.0] * 3, advantage=1.0),
                                  floe.Sample([12, 13], logprobs=[-1.0] * 2, advantage=-1.0)]),
        floe.Group([14, 15], [floe.Sample([16, 17, 18, 19, 20], logprobs=[-2.0] * 5, advantage=0.5)]),
    ])


SEQLENS = [4 + 3, 4 + 2, 2 + 5]  # each sample with its prompt


def _check_consistent(metrics: dict[str, float], wall: float) -> None:
    assert all(math.isfinite(metrics[k]) for k in THROUGHPUT_METRICS if k in metrics)
    assert 0 < metrics["seconds"] <= wall
    assert metrics["sequence_tokens"] == sum(SEQLENS)
    assert metrics["tokens_per_second"] == pytest.approx(metrics["sequence_tokens"] / metrics["seconds"], rel=1e-12)


def test_forward_and_forward_backward_report_time_tokens_and_flops_without_a_peak(make_client, tiny_model):
    client = make_client()  # float32 on CPU: no peak known, so no mfu
    shape = TransformerShape.from_config(AutoConfig.from_pretrained(tiny_model))
    assert shape is not None
    caps = client.info().capabilities
    assert caps["device_name"] == "cpu" and caps["policy_devices"] == 1
    assert caps["peak_flops"] is None and caps["peak_flops_source"] is None and caps["model_flops"] is True

    start = time.perf_counter()
    fb = client.forward_backward(_batch(), "ppo")
    _check_consistent(fb.metrics, time.perf_counter() - start)
    assert fb.metrics["model_flops"] == training_flops(shape, SEQLENS)
    assert "mfu" not in fb.metrics
    assert fb.metrics["tokens"] == 10  # the loss's own token count is unchanged (sample tokens)

    for zone in ("policy", "reference"):
        start = time.perf_counter()
        res = client.forward(_batch(), zone=zone)
        _check_consistent(res.metrics, time.perf_counter() - start)
        assert res.metrics["model_flops"] == forward_flops(shape, SEQLENS)
        assert "mfu" not in res.metrics


def test_a_configured_peak_gives_mfu(make_client):
    client = make_client(compute={"peak_tflops": 0.02})
    caps = client.info().capabilities
    assert caps["peak_flops"] == 0.02e12 and caps["peak_flops_source"] == "compute.peak_tflops"
    fb = client.forward_backward(_batch(), "ppo")
    assert fb.metrics["mfu"] == pytest.approx(fb.metrics["model_flops"] / fb.metrics["seconds"] / 0.02e12, rel=1e-12)
    assert 0 < fb.metrics["mfu"] < 1
    res = client.forward(_batch())
    assert res.metrics["mfu"] == pytest.approx(res.metrics["model_flops"] / res.metrics["seconds"] / 0.02e12, rel=1e-12)


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan")])
def test_a_peak_must_be_a_positive_finite_number(value):
    with pytest.raises(floe.InvalidInput) as err:
        floe.ComputeConfig(peak_tflops=value)
    assert "peak_tflops" in err.value.field
