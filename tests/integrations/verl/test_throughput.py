"""The verl plugin's throughput metrics (floe.integrations.verl.throughput) against verl's own
functions: the TFLOP/s are verl's qwen2/qwen3 estimator (its formula written out here), the
peak verl's get_device_flops table at the backend's GPU name, or the backend's configured peak;
a CPU backend has none (0, and mfu 0)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.verl


def test_tflops_are_verls_estimate_and_mfu_divides_by_the_peak_and_devices(tmp_path):
    from transformers import AutoConfig  # noqa: PLC0415

    from floe.integrations.verl.throughput import ActorThroughput, verl_tflops  # noqa: PLC0415
    from floe.models import make_tiny  # noqa: PLC0415

    config = AutoConfig.from_pretrained(make_tiny(tmp_path / "tiny"))
    seqlens, seconds = [30, 50, 20], 0.5
    d, hd, heads, kv, ff, layers, vocab = 64, 16, 4, 2, 128, 2, config.vocab_size
    dense = (3 * d * ff + d * (heads * hd + 2 * kv * hd + heads * hd)) * layers + 2 * vocab * d  # verl's N
    by_hand = (6 * dense * 100 + 6 * (30**2 + 50**2 + 20**2) * hd * heads * layers) / seconds / 1e12
    assert verl_tflops(config, seqlens, seconds) == pytest.approx(by_hand, rel=1e-12)

    caps = {"device_name": "cpu", "policy_devices": 2, "peak_flops": 0.004e12, "peak_flops_source": "compute.peak_tflops"}
    m = ActorThroughput(config, caps).metrics(seqlens, seconds, tokens=100.0)
    assert m["floe/peak_tflops"] == [pytest.approx(0.004)]
    assert m["mfu"] == [pytest.approx(by_hand / 0.004 / 2, rel=1e-12)]
    assert m["floe/tflops"] == [pytest.approx(by_hand, rel=1e-12)]
    assert m["floe/tokens_per_second"] == [200.0] and m["floe/update_seconds"] == [0.5] and m["floe/update_tokens"] == [100.0]
    assert ActorThroughput(config, caps).metrics([], 0.0, 0.0) == {}  # no update: nothing measured


@pytest.mark.parametrize(("caps", "peak"), [
    ({"device_name": "cpu", "peak_flops": None, "peak_flops_source": None}, 0.0),  # no invented CPU peak
    ({"device_name": "NVIDIA H100 80GB HBM3", "peak_flops": 989e12, "peak_flops_source": "datasheet"}, 989.0),  # verl's table
    ({"device_name": "NVIDIA A100-SXM4-80GB", "peak_flops": None, "peak_flops_source": None}, 312.0),  # verl's, fp32 too
    ({"device_name": "NVIDIA GeForce GTX 1080", "peak_flops": None, "peak_flops_source": None}, 0.0),  # not in verl's table
    ({"device_name": "NVIDIA H100 80GB HBM3", "peak_flops": 500e12, "peak_flops_source": "compute.peak_tflops"}, 500.0),
])
def test_the_peak(caps, peak):
    from floe.integrations.verl.throughput import promised_tflops  # noqa: PLC0415

    assert promised_tflops(caps) == pytest.approx(peak)
