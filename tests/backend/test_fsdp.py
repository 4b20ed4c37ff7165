"""FSDP2 data parallel: 2 spawned ranks (gloo, CPU) give what one process gives.

The reference is the local `PolicyZone` on the same tiny model and batches. The ranks run as
torch.multiprocessing spawns of `_rank_main` (`tests.spawn.run_ranks`: bounded, RANK_TIMEOUT_S
each), each a `ShardedPolicyZone` over a gloo group; rank 0 writes what it saw (metrics JSON,
gradients and weights as safetensors) into a directory this test reads.

Tolerances, from what differs: the ranks and the one process add the same fp32 terms in
another order (each rank sums its share, the shares are then summed), so every gradient
element carries a relative rounding error of about n·2⁻²⁴ for n terms (≈ 1e-7 typical here);
nothing else differs. Hence:
* first-order terms, computed from the same weights (losses, metrics, log-probs, entropies,
  grad norms, and the whole summed gradient of the first step): tight, FIRST_ORDER = 1e-5
  relative (≈ 100× the rounding measured here, ≈ 1e-7);
* weights after k AdamW steps: Adam divides each gradient element by its own running scale, so
  a relative error of an element's gradient becomes an absolute error of its update in units
  of lr, and an element whose gradient nearly cancels (small against the terms summed into it)
  can move differently by a good part of lr. Such elements are few: compared per tensor
  relative to the update itself, ‖Δw_ranks − Δw_local‖ ≤ UPDATE_REL · ‖Δw_local‖ (Δw: the
  change from the initial weights), and elementwise within ELEMENT_LR · lr · k, 1% of the most a
  weight moves in k steps. Measured on this tiny model (3 clipped steps, lr 1e-2) on a 2-core
  AMD EPYC (Zen 4, torch's AVX-512 kernels): one process against itself with another micro-batch
  plan (another summation order, both right) differs by 2.2e-5 at most elementwise
  (7e-4 · lr · k) and 1.9e-5 relative per tensor, the ranks against one process by 4.4e-6 and
  6.6e-6; the earlier flat 1e-5 absolute bound sat inside that noise (the issue's EPYC measured
  1.05e-5 on the ranks). First-order terms differed by 7.7e-7 relative, the first summed
  gradient by 2.7e-7.
A wrong gradient is still caught: a planted averaging bug (the FSDP divide factor set to the
world size: every gradient halved) fails the first-order checks by a factor of 2, although
the weights after a clipped Adam step come out the same (both are invariant to a gradient
scale); `test_a_planted_gradient_scale_fails_the_first_order_checks` runs it on the ranks.

The "train" scenario first runs one forward_backward whose KL and entropy terms have their own
aggregations (`TERMS`) from the initial weights, compares it first-order, and discards it.

Scenarios (three spawns, to keep the suite short; the module's pytest timeout covers all three
at their bound):
  "train" (2 ranks): 3 GRPO-style steps (importance_sampling, ppo with seq_mean_token_mean,
      and a 1-group batch: fewer groups than ranks), forward with entropy, full_tensor_buckets,
      export_hf; a sharded save after step 2; then the local ("full") state of step 2 loads
      into the sharded zone and step 3 runs again; check_state refuses another model.
  "resume1" (1 rank): loads the 2-rank state, saves it again as a 1-rank state, runs step 3.
  "resume2" (2 ranks): loads the 1-rank state and runs step 3; then a zone with the planted
      averaging bug runs step 1.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.fsdp import FSDPModule

import floe
from floe.backend.data_parallel import merge_forward, merge_forward_backward, split_batch
from floe.backend.policy import PolicyZone
from floe.compute.losses import LossSpec, resolve_loss
from floe.config import ComputeConfig, OptimizerConfig
from floe.errors import StateError
from floe.models import load_model, make_tiny
from tests.spawn import RANK_TIMEOUT_S, collective_timeout, run_ranks

pytestmark = pytest.mark.timeout(int(4 * RANK_TIMEOUT_S))  # the fixture's three bounded spawns and the local runs

FIRST_ORDER = 1e-5  # relative (to max(1, |value|)) for values computed from the same weights
UPDATE_REL = 1e-3  # per tensor: |Δw_ranks - Δw_local| / |Δw_local| after k steps
ELEMENT_LR = 1e-2  # elementwise, in units of lr · k
OPT = OptimizerConfig(lr=1e-2, grad_clip=0.05)
COMPUTE = ComputeConfig(max_tokens_per_microbatch=40)  # several micro-batches per rank, unequal counts
BUCKET = 6000  # bytes: several buckets, one tensor larger than a bucket


def _loss(step: int) -> LossSpec:
    if step == 1:
        return resolve_loss("ppo", {"clip_low": 0.5, "clip_high": 0.5, "aggregation": "seq_mean_token_mean"})
    return resolve_loss("importance_sampling", None)


# The KL and entropy terms under their own aggregations (each term's global per-sample scales
# travel with the shares, RankShare.scales): checked once from the initial weights.
TERMS = {"kl": {"coef": 0.2, "aggregation": "seq_mean_token_mean"}, "entropy": {"coef": 0.05, "aggregation": "sum"}}


def _terms_loss() -> LossSpec:
    return resolve_loss("importance_sampling", dict(TERMS, aggregation="token_mean"))


def _batches(old: list[list[list[float]]] | None = None) -> list[floe.Batch]:
    """Step batches: 5 groups of ragged prompts and samples; then 1 group (fewer groups than ranks)."""
    g = torch.Generator().manual_seed(7)

    def ints(n: int) -> list[int]:
        return [int(x) for x in torch.randint(3, 60, (n,), generator=g)]

    def group(plen: int, slens: list[int], advs: list[float]) -> floe.Group:
        samples = []
        for n, a in zip(slens, advs):
            samples.append(floe.Sample(ints(n), logprobs=[-4.0 + 0.01 * k for k in range(n)], advantage=a,
                                       ref_logprobs=[-4.1 + 0.03 * k for k in range(n)]))
        return floe.Group(ints(plen), samples)

    big = [
        group(5, [7, 3, 9], [1.0, -0.5, -0.5]),
        group(3, [4, 4], [0.7, -0.7]),
        group(8, [12, 2, 5, 6], [0.2, 0.4, -0.3, -0.3]),
        group(2, [3], [1.5]),
        group(6, [6, 8], [-1.0, 1.0]),
    ]
    other = [group(4, [5, 2, 6], [0.5, 0.5, -1.0]), group(7, [3, 9], [1.0, -1.0]), group(3, [10], [0.3])]
    return [floe.Batch(big), floe.Batch(other), floe.Batch([group(4, [5, 7], [1.0, -1.0])])]


def _weights_of(zone: Any) -> dict[str, torch.Tensor]:
    """Full weights by name: PolicyZone.publish() or the concatenated buckets of a sharded zone."""
    if isinstance(zone, PolicyZone):
        return {k: v.clone() for k, v in zone.publish().tensors.items()}
    out: dict[str, torch.Tensor] = {}
    for bucket in zone.full_tensor_buckets(BUCKET):
        out.update(bucket)
    return out


def _gradients(zone: Any) -> dict[str, torch.Tensor]:
    """The whole summed gradient by parameter name (collective on a sharded zone)."""
    out = {}
    for name, p in zip(zone.param_names(), zone.params):
        g = p.grad
        out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def _step(zone: Any, batch: floe.Batch, spec: LossSpec, world: int, grads: dict | None = None) -> dict[str, Any]:
    """One forward_backward + optim_step on either zone kind; the merged result as plain data
    (and, into `grads`, the summed gradient before the step)."""
    if isinstance(zone, PolicyZone):
        fb = zone.forward_backward(batch, spec, 1.0)
    else:
        shares = split_batch(batch, world, spec)
        partial = zone.forward_backward(shares[zone.rank], spec, 1.0)
        parts: list[Any] = [None] * world
        dist.all_gather_object(parts, partial, group=zone.group)
        fb = merge_forward_backward(batch, shares, parts, spec)
    if grads is not None:
        grads.update(_gradients(zone))
    st = zone.optim_step()
    return {"metrics": fb.metrics, "logprobs": fb.logprobs, "grad_norm": st.grad_norm, "step": st.step, "lr": st.lr}


def _forward(zone: Any, batch: floe.Batch, world: int) -> dict[str, Any]:
    """Collective: a sharded zone's forward with entropy over `batch`, merged as plain data."""
    shares = split_batch(batch, world, None)
    fw = zone.forward(shares[zone.rank], 1.0, True)
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, fw, group=zone.group)
    merged = merge_forward(len(batch.groups), shares, parts)
    return {"logprobs": merged.logprobs, "entropy": merged.entropy}


def _rank_main(rank: int, world: int, scenario: str, model_dir: str, work: str) -> None:
    from floe.backend.policy_sharded import ShardedPolicyZone

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{work}/rdzv-{scenario}", rank=rank, world_size=world,
                            timeout=collective_timeout())
    try:
        out = Path(work) / scenario
        batches = _batches()
        zone = ShardedPolicyZone(load_model(model_dir, "float32", "cpu"), OPT, COMPUTE, dist.group.WORLD, torch.device("cpu"))
        record: dict[str, Any] = {}
        if scenario == "train":
            # From the initial weights: the loss with its KL / entropy terms under their own aggregations,
            # its summed gradient recorded, then discarded (nothing of it reaches the steps below).
            shares = split_batch(batches[0], world, _terms_loss())
            partial = zone.forward_backward(shares[rank], _terms_loss(), 1.0)
            parts_tb: list[Any] = [None] * world
            dist.all_gather_object(parts_tb, partial, group=zone.group)
            record["terms"] = merge_forward_backward(batches[0], shares, parts_tb, _terms_loss()).metrics
            terms_grads = _gradients(zone)
            zone.discard_gradients()
            if rank == 0:
                save_file(terms_grads, str(out / "terms_grads.safetensors"))
            record["steps"] = []
            first_grads: dict[str, torch.Tensor] = {}
            for i, batch in enumerate(batches):
                if i == 2:
                    meta = zone.save_state(out / "state2")
                    if rank == 0:
                        (out / "state2" / "meta.json").write_text(json.dumps(meta))
                record["steps"].append(_step(zone, batch, _loss(i), world, first_grads if i == 0 else None))
            if rank == 0:
                save_file(first_grads, str(out / "first_grads.safetensors"))
            record["forward"] = _forward(zone, batches[1], world)
            record["all_finite"] = zone.all_finite()
            final = _weights_of(zone)
            zone.export_hf(out / "export")
            # A state saved by one process ("full" layout) loads into the ranks.
            local_dir = Path(work) / "local_state2"
            local_meta = json.loads((local_dir / "meta.json").read_text())
            zone.check_state(local_dir, local_meta)
            zone.load_state(local_dir, local_meta)
            record["loaded_step"] = zone.step
            buckets = list(zone.full_tensor_buckets(BUCKET))
            record["bucket_bytes"] = [[t.numel() * t.element_size() for t in b.values()] for b in buckets]
            record["bucket_names"] = [list(b) for b in buckets]
            loaded = {k: v for b in buckets for k, v in b.items()}
            record["from_local"] = _step(zone, batches[2], _loss(2), world)
            from_local = _weights_of(zone)
            # Another model's state is refused, and nothing changes.
            before = _weights_of(zone)
            other = Path(work) / "other_state"
            try:
                zone.check_state(other, json.loads((other / "meta.json").read_text()))
                record["refused"] = None
            except StateError as exc:
                record["refused"] = str(exc)
            record["unchanged_after_refusal"] = all(torch.equal(before[k], v) for k, v in _weights_of(zone).items())
            record["step_after_refusal"] = zone.step
            if rank == 0:
                save_file(final, str(out / "final.safetensors"))
                save_file(from_local, str(out / "from_local.safetensors"))
                save_file(loaded, str(out / "loaded.safetensors"))
        else:
            source = Path(work) / ("train/state2" if scenario == "resume1" else "resume1/state2")
            meta = json.loads((source / "meta.json").read_text())
            zone.check_state(source, meta)
            zone.load_state(source, meta)
            record["loaded_step"] = zone.step
            if scenario == "resume1":
                meta = zone.save_state(out / "state2")
                (out / "state2" / "meta.json").write_text(json.dumps(meta))
            record["steps"] = [_step(zone, batches[2], _loss(2), world)]
            final = _weights_of(zone)
            if scenario == "resume1":  # mixed precision: a bf16 model, fp32 shards and moments
                bf16 = ShardedPolicyZone(load_model(model_dir, "bfloat16", "cpu"), OPT, COMPUTE, dist.group.WORLD, torch.device("cpu"))
                record["bf16"] = {
                    "step": _step(bf16, batches[0], _loss(0), world),
                    "param_dtypes": sorted({str(p.dtype) for p in bf16.params}),
                    "moment_dtypes": sorted({str(v.dtype) for st in bf16.optimizer.state.values() for v in st.values() if v.dim()}),
                    "describe": bf16.describe(),
                }
                if rank == 0:
                    save_file(_weights_of(bf16), str(out / "bf16.safetensors"))
            if scenario == "resume2":  # the planted averaging bug: every unit divides the summed gradient by the world
                planted = ShardedPolicyZone(load_model(model_dir, "float32", "cpu"), OPT, COMPUTE, dist.group.WORLD,
                                            torch.device("cpu"))
                for module in planted.scorer.modules():
                    if isinstance(module, FSDPModule):
                        module.set_gradient_divide_factor(float(world))
                planted_grads: dict[str, torch.Tensor] = {}
                record["planted"] = _step(planted, batches[0], _loss(0), world, planted_grads)
                planted_weights = _weights_of(planted)
                if rank == 0:
                    save_file(planted_grads, str(out / "planted_grads.safetensors"))
                    save_file(planted_weights, str(out / "planted_weights.safetensors"))
            if rank == 0:
                save_file(final, str(out / "final.safetensors"))
        if rank == 0:
            (out / "record.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


def _spawn(world: int, scenario: str, model_dir: Path, work: Path) -> dict[str, Any]:
    (work / scenario).mkdir(parents=True, exist_ok=True)
    run_ranks(_rank_main, world, (scenario, str(model_dir), str(work)), rendezvous=[work / f"rdzv-{scenario}"])
    return json.loads((work / scenario / "record.json").read_text())


def _close(a: Any, b: Any, tol: float = FIRST_ORDER, where: str = "") -> None:
    """First-order terms (same weights in): equal up to `tol` relative to max(1, |a|)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _close(a[k], b[k], tol, f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, tol, f"{where}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert abs(a - b) <= tol * max(1.0, abs(a)), f"{where}: {a} vs {b}"
    else:
        assert a == b, where


def _close_gradients(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = FIRST_ORDER) -> None:
    """The summed gradient from the same weights: per tensor, |a - b| <= tol |a| (2-norms)."""
    assert a.keys() == b.keys()
    for k, x in a.items():
        err, size = float((x - b[k]).norm()), float(x.norm())
        assert err <= tol * size, f"gradient of {k}: |diff| {err:.3g} > {tol:g} x |grad| {size:.3g}"


def _close_weights(w0: dict[str, torch.Tensor], a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
                   steps: int = 3) -> None:
    """Weights after `steps` AdamW steps of lr OPT.lr from `w0` (module docstring): the updates
    agree per tensor within UPDATE_REL of their size, every element within ELEMENT_LR · lr · steps."""
    assert a.keys() == b.keys() == w0.keys()
    bound = ELEMENT_LR * OPT.lr * steps
    for k, x in a.items():
        y = b[k]
        assert x.dtype == y.dtype and x.shape == y.shape, k
        worst = float((x - y).abs().max())
        assert worst <= bound, f"{k}: max diff {worst:.3g} > {bound:.3g} ({ELEMENT_LR:g} lr x {steps} steps)"
        update = float((x - w0[k]).norm())
        err = float((x - y).norm())
        assert err <= UPDATE_REL * update or err <= 1e-7, f"{k}: |diff| {err:.3g} > {UPDATE_REL:g} x |update| {update:.3g}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The local reference and the three spawned scenarios, run once for the module's tests."""
    work = tmp_path_factory.mktemp("fsdp")
    model_dir = make_tiny(work / "tiny", hidden_size=64, num_hidden_layers=2)
    other_dir = make_tiny(work / "other", hidden_size=32, num_hidden_layers=2)
    batches = _batches()
    local = PolicyZone(load_model(str(model_dir), "float32", "cpu"), OPT, COMPUTE)
    steps = []
    for i, batch in enumerate(batches):
        if i == 2:
            local_dir = work / "local_state2"
            local_dir.mkdir()
            (local_dir / "meta.json").write_text(json.dumps(local.save_state(local_dir)))
        steps.append(_step(local, batch, _loss(i), 1))
    forward = local.forward(batches[1], 1.0, True)
    export = work / "local_export"
    local.export_hf(export)
    other = PolicyZone(load_model(str(other_dir), "float32", "cpu"), OPT, COMPUTE)
    (work / "other_state").mkdir()
    (work / "other_state" / "meta.json").write_text(json.dumps(other.save_state(work / "other_state")))
    bf16 = PolicyZone(load_model(str(model_dir), "bfloat16", "cpu"), OPT, COMPUTE)
    out_bf16 = _step(bf16, batches[0], _loss(0), 1)
    w0 = _weights_of(PolicyZone(load_model(str(model_dir), "float32", "cpu"), OPT, COMPUTE))
    one_step = PolicyZone(load_model(str(model_dir), "float32", "cpu"), OPT, COMPUTE)
    first_grads: dict[str, torch.Tensor] = {}
    first_step = _step(one_step, batches[0], _loss(0), 1, first_grads)
    terms_zone = PolicyZone(load_model(str(model_dir), "float32", "cpu"), OPT, COMPUTE)
    terms = terms_zone.forward_backward(batches[0], _terms_loss(), 1.0).metrics
    terms_grads = _gradients(terms_zone)
    shared_zone = PolicyZone(load_model(str(model_dir), "float32", "cpu"), OPT, COMPUTE)  # one shared aggregation
    shared_zone.forward_backward(batches[0], resolve_loss("importance_sampling", {
        "kl": {"coef": TERMS["kl"]["coef"]}, "entropy": {"coef": TERMS["entropy"]["coef"]}}), 1.0)
    out = {
        "bf16_step": out_bf16, "bf16_weights": _weights_of(bf16), "w0": w0, "local_first_grads": first_grads,
        "local_first_step": first_step, "local_after_one": _weights_of(one_step),
        "work": work, "model_dir": model_dir, "local": local, "local_steps": steps, "local_final": _weights_of(local),
        "local_forward": forward, "local_export": export, "local_terms": terms, "local_terms_grads": terms_grads,
        "local_shared_grads": _gradients(shared_zone),
    }
    out["train"] = _spawn(2, "train", model_dir, work)
    out["resume1"] = _spawn(1, "resume1", model_dir, work)
    out["resume2"] = _spawn(2, "resume2", model_dir, work)
    return out


def test_two_ranks_train_like_one_process(runs):
    rec = runs["train"]
    _close(runs["local_steps"], rec["steps"])  # losses, metrics, grad norms, lr, log-probs of all 3 steps
    assert [s["step"] for s in rec["steps"]] == [1, 2, 3]
    assert all(s["grad_norm"] > OPT.grad_clip for s in rec["steps"])  # clipping by the global norm ran
    _close_gradients(runs["local_first_grads"], load_file(str(runs["work"] / "train" / "first_grads.safetensors")))
    _close_weights(runs["w0"], runs["local_final"], load_file(str(runs["work"] / "train" / "final.safetensors")))
    _close(runs["local_forward"].logprobs, rec["forward"]["logprobs"])
    _close(runs["local_forward"].entropy, rec["forward"]["entropy"])
    assert rec["all_finite"] is True


def test_kl_and_entropy_aggregations_on_two_ranks_like_one_process(runs):
    """The loss with kl.aggregation / entropy.aggregation of their own (TERMS) on 2 ranks: the
    loss, metrics and the whole summed gradient are one process's (first order, same weights);
    the term aggregations matter here (one shared aggregation gives another gradient)."""
    _close(runs["local_terms"], runs["train"]["terms"])
    ranks = load_file(str(runs["work"] / "train" / "terms_grads.safetensors"))
    _close_gradients(runs["local_terms_grads"], ranks)
    with pytest.raises(AssertionError, match="gradient of"):
        _close_gradients(runs["local_shared_grads"], ranks, tol=1e-3)


def test_a_planted_gradient_scale_fails_the_first_order_checks(runs):
    """The classic data-parallel bug, planted on 2 real ranks: gradients averaged instead of
    summed (FSDP divide factor = world size). The loss and log-probs are right, the gradient
    and its norm are half: the first-order checks fail. The weights after the clipped AdamW
    step agree with the local run all the same (clipping and Adam's normalisation cancel a
    gradient scale), which is why the first-order terms are what is compared tightly."""
    work, local = runs["work"], runs["local_first_step"]
    planted = runs["resume2"]["planted"]
    _close(local["metrics"]["loss"], planted["metrics"]["loss"])  # the forward is right
    with pytest.raises(AssertionError, match="grad_norm"):
        _close(local, planted)
    assert planted["grad_norm"] == pytest.approx(local["grad_norm"] / 2, rel=1e-4)
    with pytest.raises(AssertionError, match="gradient of"):
        _close_gradients(runs["local_first_grads"], load_file(str(work / "resume2" / "planted_grads.safetensors")))
    _close_weights(runs["w0"], runs["local_after_one"], load_file(str(work / "resume2" / "planted_weights.safetensors")),
                   steps=1)


def test_two_right_summation_orders_pass_the_bounds_the_old_flat_one_did_not(runs):
    """The error model on this machine, without ranks: one process with two micro-batch plans
    (the same terms summed in another order; both results right). Their weights after the 3
    clipped steps differ by more than the flat 1e-5 the test used to allow (2.2e-5 on the 2-core
    AMD EPYC this was measured on; the issue's EPYC run exceeded it on the ranks), and stay well inside
    the update-relative bounds. (How far they differ depends on the CPU's kernels: not asserted.)"""
    batches = _batches()
    finals = []
    for budget in (COMPUTE.max_tokens_per_microbatch, 4096):  # several micro-batches per step; one
        zone = PolicyZone(load_model(str(runs["model_dir"]), "float32", "cpu"), OPT,
                          ComputeConfig(max_tokens_per_microbatch=budget))
        for i, batch in enumerate(batches):
            _step(zone, batch, _loss(i), 1)
        finals.append(_weights_of(zone))
    _close_weights(runs["w0"], *finals)


def test_the_gradient_check_sees_a_scale_error_of_1e_4(runs):
    """FIRST_ORDER leaves room for rounding only: a gradient off by 1e-4 of itself fails, the
    ranks' own one passes."""
    ranks = load_file(str(runs["work"] / "train" / "first_grads.safetensors"))
    _close_gradients(runs["local_first_grads"], ranks)
    with pytest.raises(AssertionError, match="gradient of"):
        _close_gradients(runs["local_first_grads"], {k: v * (1 + 1e-4) for k, v in ranks.items()})


def _steps_equal_local(runs, steps: list[dict], first: int) -> None:
    _close(runs["local_steps"][first:], steps)


def test_a_state_saved_by_two_ranks_resumes_on_one_and_back_on_two(runs):
    work = runs["work"]
    names = sorted(p.relative_to(work / "train" / "state2").as_posix() for p in (work / "train" / "state2").rglob("*") if p.is_file())
    # safetensors and JSON only: one shard file per rank, no DCP ".metadata" pickle
    assert all(n.endswith((".safetensors", ".json")) for n in names), names
    assert len([n for n in names if n.startswith("policy/")]) == 2
    for scenario in ("resume1", "resume2"):  # 2 -> 1, then 1 -> 2
        rec = runs[scenario]
        assert rec["loaded_step"] == 2
        _steps_equal_local(runs, rec["steps"], 2)
        _close_weights(runs["w0"], runs["local_final"], load_file(str(work / scenario / "final.safetensors")))


def test_resume_across_placements(runs, tmp_path):
    """The local ("full") state loads into the ranks, and the ranks' ("sharded") state into the
    local PolicyZone; the next step matches the un-interrupted run either way."""
    work = runs["work"]
    rec = runs["train"]
    assert rec["loaded_step"] == 2
    _steps_equal_local(runs, [rec["from_local"]], 2)
    _close_weights(runs["w0"], runs["local_final"], load_file(str(work / "train" / "from_local.safetensors")))
    local = PolicyZone(load_model(str(runs["model_dir"]), "float32", "cpu"), OPT, COMPUTE)
    sharded = work / "train" / "state2"
    meta = json.loads((sharded / "meta.json").read_text())
    assert meta["policy_layout"] == "sharded" and meta["step"] == 2
    local.check_state(sharded, meta)
    local.load_state(sharded, meta)
    assert local.step == 2
    _steps_equal_local(runs, [_step(local, _batches()[2], _loss(2), 1)], 2)
    _close_weights(runs["w0"], runs["local_final"], _weights_of(local))


def test_check_state_refuses_another_model_and_changes_nothing(runs):
    rec = runs["train"]
    assert rec["refused"] is not None and ("do not match" in rec["refused"] or "shape" in rec["refused"])
    assert rec["unchanged_after_refusal"] is True and rec["step_after_refusal"] == 3
    # The local zone refuses the sharded state of this model when it is another model.
    other = PolicyZone(load_model(str(runs["work"] / "other"), "float32", "cpu"), OPT, COMPUTE)
    before = _weights_of(other)
    sharded = runs["work"] / "train" / "state2"
    with pytest.raises(StateError, match="do not match|shape"):
        other.check_state(sharded, json.loads((sharded / "meta.json").read_text()))
    assert all(torch.equal(before[k], v) for k, v in _weights_of(other).items()) and other.step == 0


def test_full_tensor_buckets_are_the_published_tensors_within_the_bound(runs):
    """Right after loading the local step-2 state, the ranks' buckets equal a local zone's
    publish() exactly: names (in order), dtypes, values."""
    rec = runs["train"]
    local = PolicyZone(load_model(str(runs["model_dir"]), "float32", "cpu"), OPT, COMPUTE)
    local_dir = runs["work"] / "local_state2"
    local.load_state(local_dir, json.loads((local_dir / "meta.json").read_text()))
    published = local.publish().tensors
    assert [n for names in rec["bucket_names"] for n in names] == list(published)
    loaded = load_file(str(runs["work"] / "train" / "loaded.safetensors"))
    assert loaded.keys() == published.keys()
    for k, v in published.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k
    assert len(rec["bucket_bytes"]) > 2
    for sizes in rec["bucket_bytes"]:
        assert sum(sizes) <= BUCKET or len(sizes) == 1  # a tensor larger than the bound travels alone
    assert any(len(sizes) == 1 and sizes[0] > BUCKET for sizes in rec["bucket_bytes"])


def test_export_from_two_ranks_is_an_ordinary_hf_model(runs):
    from transformers import AutoModelForCausalLM

    ours = AutoModelForCausalLM.from_pretrained(runs["work"] / "train" / "export")
    theirs = AutoModelForCausalLM.from_pretrained(runs["local_export"])
    strip = lambda c: {k: v for k, v in c.to_dict().items() if k != "_name_or_path"}
    assert strip(ours.config) == strip(theirs.config)
    listing = lambda d: sorted(p.name for p in d.iterdir())
    assert listing(runs["work"] / "train" / "export") == listing(runs["local_export"])
    _close_weights(runs["w0"], theirs.state_dict(), ours.state_dict())


def test_bf16_ranks_keep_fp32_masters_and_publish_bf16(runs):
    """Mixed precision on the ranks: fp32 shards and AdamW moments, bf16 compute; published in
    bf16 like the local bf16 policy. Compared with the local bf16 PolicyZone (fp32 masters too)
    at bf16 tolerance: both compute in bf16 but round differently (FSDP casts per unit)."""
    rec = runs["resume1"]["bf16"]
    assert rec["param_dtypes"] == ["torch.float32"] and rec["moment_dtypes"] == ["torch.float32"]
    assert rec["describe"]["dtype"] == "bfloat16"
    local = runs["bf16_step"]
    assert abs(rec["step"]["metrics"]["loss"] - local["metrics"]["loss"]) <= 2e-2 * abs(local["metrics"]["loss"])
    assert abs(rec["step"]["grad_norm"] - local["grad_norm"]) <= 5e-2 * local["grad_norm"]
    ours = load_file(str(runs["work"] / "resume1" / "bf16.safetensors"))
    theirs = runs["bf16_weights"]
    assert ours.keys() == theirs.keys()
    for k in theirs:
        assert ours[k].dtype == torch.bfloat16 == theirs[k].dtype, k
        # one step of lr 1e-2 moved every weight; the two runs agree to bf16 rounding of that step
        assert torch.allclose(ours[k].float(), theirs[k].float(), atol=2e-2, rtol=0), k
