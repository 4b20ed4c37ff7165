"""The sampler is shared: concurrent samples run together, a sync waits for them, and every
request is validated before any lock is taken."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

import floe
from floe.models import make_tiny
from tests.conftest import backend_of


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Wide enough that a decode step is mostly matrix work (the GIL is released), not Python.
    return make_tiny(tmp_path_factory.mktemp("wide") / "tiny", hidden_size=512, intermediate_size=1024, num_hidden_layers=2)


def _run_together(calls: list) -> tuple[float, list]:
    """Wall time of running `calls` in one thread each, and their results (or errors)."""
    results: list = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as e:  # noqa: BLE001 - reported to the test below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start, results


def _parallel_ratio(fn) -> float:
    """Wall time of two concurrent `fn()` calls over one call's."""
    start = time.perf_counter()
    fn()
    single = time.perf_counter() - start
    both, results = _run_together([fn, fn])
    assert not any(isinstance(r, BaseException) for r in results), results
    return both / single


def test_two_concurrent_samples_overlap(make_client, wide_model):
    """Two sample calls (32 prompts x n=4, 64 tokens each, 1 intra-op thread) run together.

    The bar is 1.6x one call's wall time. The 2 cores this suite runs on may be busy with
    other work, in which case nothing can run two threads at once; each attempt therefore
    also times a GIL-free matmul pair of the same length (the machine's own ratio), and the
    sampler must stay within 1.6x, or within 1.25x of the machine's ratio when the machine
    itself cannot do better than 1.3x. A sampler that serialised its calls takes 2x.
    """
    client = make_client(model=str(wide_model), num_threads=1)
    backend = backend_of(client)
    tok = client.tokenizer()
    prompts = [tok.encode(f"prompt {i:02d}: say something") for i in range(32)]
    params = floe.SamplingParams(max_tokens=64, stop_at_eos=False, seed=7)
    alone = backend.sample(prompts, 4, params)
    spans: list[tuple[float, float]] = []

    def sample() -> floe.SampleResult:
        start = time.perf_counter()
        out = backend.sample(prompts, 4, params)
        spans.append((start, time.perf_counter()))
        # Same seed, same weights: concurrent calls give exactly what a call alone gives.
        assert [[s.tokens for s in g.samples] for g in out.groups] == [[s.tokens for s in g.samples] for g in alone.groups]
        return out

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    start = time.perf_counter()
    sample()
    reps = max(1, round((time.perf_counter() - start) / _matmul_seconds(a, b)))

    def matmuls() -> None:
        for _ in range(reps):
            a @ b

    attempts = []
    for _ in range(3):
        machine = _parallel_ratio(matmuls)
        spans.clear()
        sampler = _parallel_ratio(sample)
        (s1, e1), (s2, e2) = spans[-2:]
        assert s1 < e2 and s2 < e1  # the two calls were inside the sampler at the same time
        attempts.append((round(sampler, 2), round(machine, 2)))
        bar = 1.6 if machine < 1.3 else 1.25 * machine
        if sampler < bar:
            break
    print(f"two concurrent samples / one sample (sampler, machine) wall-time ratios: {attempts}")
    assert sampler < bar, f"(sampler, machine) ratios per attempt: {attempts}"


def _matmul_seconds(a: torch.Tensor, b: torch.Tensor) -> float:
    a @ b
    start = time.perf_counter()
    for _ in range(5):
        a @ b
    return (time.perf_counter() - start) / 5


def test_a_sync_waits_for_a_running_sample(make_client):
    client = make_client(optimizer={"lr": 1e-2})
    backend = backend_of(client)
    tok = client.tokenizer()
    batch = floe.Batch([floe.Group(tok.encode("abc"), [floe.Sample(tok.encode("xyz"))])])
    client.forward_backward(batch, "cross_entropy")
    client.optim_step()
    prompts = [tok.encode(f"long sample {i}") for i in range(16)]
    params = floe.SamplingParams(max_tokens=200, stop_at_eos=False, seed=3)
    times: dict[str, float] = {}
    started = threading.Event()
    model = backend.sampler.model
    handle = model.register_forward_pre_hook(lambda *_: started.set())

    def sample():
        out = backend.sample(prompts, 4, params)
        times["sample_end"] = time.perf_counter()
        return out

    def sync():
        started.wait(timeout=60)
        times["sync_start"] = time.perf_counter()
        out = backend.sync_weights()
        times["sync_end"] = time.perf_counter()
        return out

    try:
        _, (sampled, synced) = _run_together([sample, sync])
    finally:
        handle.remove()
    assert isinstance(sampled, floe.SampleResult) and isinstance(synced, floe.SyncResult), (sampled, synced)
    assert times["sync_start"] < times["sample_end"] <= times["sync_end"]
    assert synced.version == 1
    assert sampled.weights_version == 0
    assert {s.weights_version for g in sampled.groups for s in g.samples} == {0}
    after = backend.sample(prompts[:1], 2, floe.SamplingParams(max_tokens=4))
    assert {s.weights_version for g in after.groups for s in g.samples} == {1}


def test_requests_are_validated_before_any_lock(make_client, tmp_path):
    """With every zone lock held elsewhere, bad requests are still rejected at once."""
    client = make_client()
    backend = backend_of(client)
    tok = client.tokenizer()
    good = floe.Batch([floe.Group(tok.encode("abc"), [floe.Sample(tok.encode("x"))])])
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("x")
    bad_calls = [
        (lambda: backend.sample([[10**6]], 1), "prompts[0]"),
        (lambda: backend.sample([tok.encode("a")], 10**6), "n"),
        (lambda: backend.sample([tok.encode("a")], 1, floe.SamplingParams(temperature=-1.0)), "params.temperature"),
        (lambda: backend.forward(good, temperature=0.0), "temperature"),
        (lambda: backend.forward(good, zone="critic"), "zone"),
        (lambda: backend.forward_backward(good, "grpo"), "loss"),
        (lambda: backend.forward_backward(good, "ppo"), "batch.groups[0].samples[0].logprobs"),
        (lambda: backend.save_state("../x"), "name"),
        (lambda: backend.load_state(".hidden"), "name"),
        (lambda: backend.delete_state("a/b"), "name"),
        (lambda: backend.export_hf(str(foreign)), "path"),
    ]
    held, release = threading.Event(), threading.Event()

    def hold_everything():
        with backend._policy_lock, backend._sampler_lock.exclusive(), backend._reference_lock:
            held.set()
            release.wait(timeout=60)

    holder = threading.Thread(target=hold_everything)
    holder.start()
    try:
        assert held.wait(timeout=30)
        for call, field in bad_calls:
            elapsed, (err,) = _run_together([call])
            assert isinstance(err, floe.InvalidInput) and err.field == field, (field, err)
            assert elapsed < 5
    finally:
        release.set()
        holder.join()
