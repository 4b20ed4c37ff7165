"""Tied-embedding models (the LM head is the input embedding: Qwen3 0.6B-4B, Llama 3.2, Gemma)
through every state operation, next to untied ones (issue 23, item 1).

A tied tensor is saved once (under its first state-dict name; state.json's `tied_weights` names
the others) and re-tied on load, in both layouts ("full" from one process, "sharded" from FSDP
ranks) and at any rank count; safetensors refuses the same tensor twice, which is what made the
sharded save of a tied model fail at 1 and 2 ranks. A failed sharded save is a StateError on
every rank (torch.distributed.checkpoint's CheckpointException is a BaseException), so the
placement reports an error of that save and the zone goes on working.

Local placement: save, load (fp32 and bf16 with fp32 masters), export, sync, through the client.
Spawned ranks (gloo, `tests.spawn`): 2 ranks train a step and save; 1 rank loads that state,
saves its own; the local zone loads both; the ranks load the local state; export and the
sync buckets from the ranks. The Ray placement runs the same operations in tests/ray.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import floe
from floe.backend.data_parallel import merge_forward_backward, split_batch
from floe.backend.policy import PolicyZone
from floe.compute.losses import resolve_loss
from floe.config import ComputeConfig, OptimizerConfig
from floe.errors import StateError
from floe.models import load_model, make_tiny
from tests.conftest import backend_of
from tests.spawn import collective_timeout, run_ranks

OPT = OptimizerConfig(lr=1e-3)
COMPUTE = ComputeConfig(max_tokens_per_microbatch=64)
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
TOL = 1e-5  # one AdamW step of lr 1e-3 from the same weights: ranks and one process agree to fp32 rounding


def _keys(path: Path) -> list[str]:
    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def _batch() -> floe.Batch:
    g = torch.Generator().manual_seed(3)

    def ints(n: int) -> list[int]:
        return [int(x) for x in torch.randint(3, 60, (n,), generator=g)]

    groups = [floe.Group(ints(4 + i), [floe.Sample(ints(3 + (i + j) % 5), logprobs=[-3.0] * (3 + (i + j) % 5),
                                                   advantage=1.0 - j) for j in range(3)]) for i in range(4)]
    return floe.Batch(groups)


SPEC = resolve_loss("importance_sampling", None)


def _tied(model: Any) -> bool:
    return model.lm_head.weight is model.model.embed_tokens.weight


# -- the local placement, through the client ----------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tied-models")
    return {kind: make_tiny(root / kind, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            tie_word_embeddings=kind == "tied") for kind in ("tied", "untied")}


def _step(client: floe.Client) -> None:
    client.forward_backward(_batch(), "importance_sampling")
    client.optim_step()


@pytest.mark.parametrize(("kind", "dtype"), [("tied", "float32"), ("tied", "bfloat16"), ("untied", "float32")])
def test_local_save_load_export_and_sync(models, tmp_path, kind, dtype):
    """(An untied bf16 model's state is tests/backend/test_mixed_precision.py's.)"""
    cfg = {"model": str(models[kind]), "state_dir": str(tmp_path / "states"), "dtype": dtype, "optimizer": {"lr": 1e-2}}
    a = floe.connect(floe.BackendConfig(**cfg))
    b = floe.connect(floe.BackendConfig(**cfg))
    try:
        _step(a)
        a.sync_weights()
        a.save_state("s")
        state = tmp_path / "states" / "s"
        meta = json.loads((state / "state.json").read_text())
        keys = _keys(state / "policy.safetensors")
        if kind == "tied":
            assert EMBED in keys and HEAD not in keys, "the tied tensor is saved once"
            assert meta["tied_weights"] == {HEAD: EMBED}
        else:
            assert EMBED in keys and HEAD in keys and "tied_weights" not in meta
        assert b.load_state("s").step == 1
        pa, pb = backend_of(a).policy, backend_of(b).policy
        assert _tied(pb.model) is (kind == "tied")  # still one parameter under both names
        if pb.masters is not None:  # bf16: the fp32 masters came back exactly
            for ma, mb in zip(pa.masters.masters, pb.masters.masters):
                assert torch.equal(ma, mb)
        _step(a)
        _step(b)
        wa, wb = pa.model.state_dict(), pb.model.state_dict()
        assert all(torch.equal(wa[k], wb[k]) for k in wa), "the resumed run is the un-interrupted one"
        # sync: the sampler holds exactly the policy's weights (its own tie included)
        b.sync_weights()
        sb = backend_of(b).sampler.model
        assert _tied(sb) is (kind == "tied")
        assert all(torch.equal(v, sb.state_dict()[k]) for k, v in wb.items())
        # export: an ordinary HF directory that loads back to the same weights and tie
        out = Path(b.export_hf(str(tmp_path / "export")))
        back = AutoModelForCausalLM.from_pretrained(out, dtype=getattr(torch, dtype))
        assert _tied(back) is (kind == "tied")
        assert all(torch.equal(v, back.state_dict()[k]) for k, v in wb.items())
    finally:
        a.close()
        b.close()


def test_a_tied_state_of_the_old_layout_still_loads(models, tmp_path):
    """States of tied models written before `tied_weights` hold the tensor under both names."""
    client = floe.connect(floe.BackendConfig(model=str(models["tied"]), state_dir=str(tmp_path / "states")))
    try:
        _step(client)
        client.save_state("old")
        state = tmp_path / "states" / "old"
        weights = load_file(str(state / "policy.safetensors"))
        weights[HEAD] = weights[EMBED].clone()
        save_file(weights, str(state / "policy.safetensors"))
        meta = json.loads((state / "state.json").read_text())
        del meta["tied_weights"], meta["files"]
        (state / "state.json").write_text(json.dumps(meta))
        before = {k: v.clone() for k, v in backend_of(client).policy.model.state_dict().items()}
        _step(client)
        assert client.load_state("old").step == 1
        after = backend_of(client).policy.model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert _tied(backend_of(client).policy.model)
    finally:
        client.close()


# -- spawned FSDP ranks ---------------------------------------------------------------------


def _rank_step(zone: Any, world: int) -> dict[str, Any]:
    batch = _batch()
    shares = split_batch(batch, world, SPEC)
    partial = zone.forward_backward(shares[zone.rank], SPEC, 1.0)
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, partial, group=zone.group)
    fb = merge_forward_backward(batch, shares, parts, SPEC)
    st = zone.optim_step()
    return {"loss": fb.metrics["loss"], "grad_norm": st.grad_norm, "step": st.step}


def _full(zone: Any) -> dict[str, torch.Tensor]:
    """The sync's buckets as one dict, tied names as separate copies (so safetensors saves them)."""
    out: dict[str, torch.Tensor] = {}
    for bucket in zone.full_tensor_buckets(4000):
        out.update({k: v.clone() for k, v in bucket.items()})
    return out


def _tied_in_one_bucket(zone: Any) -> bool | None:
    """Whether every tied name is in its first name's bucket as the same tensor object (what
    lets a broadcast send it once); None on ranks that yield empty buckets."""
    found: dict[str, torch.Tensor] = {}
    for bucket in zone.full_tensor_buckets(4000):
        for other, first in zone.tied.items():
            if other in bucket:
                found[other] = bucket[other] if bucket.get(first) is bucket[other] else torch.empty(0)
    if not found:
        return None
    return all(t.numel() for t in found.values()) and found.keys() == zone.tied.keys()


def _rank_main(rank: int, world: int, scenario: str, work: str) -> None:
    from floe.backend.policy_sharded import ShardedPolicyZone

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{work}/rdzv-{scenario}", rank=rank, world_size=world,
                            timeout=collective_timeout())
    try:
        root = Path(work)
        record: dict[str, Any] = {}
        for kind in ("tied", "untied"):
            zone = ShardedPolicyZone(load_model(str(root / kind), "float32", "cpu"), OPT, COMPUTE, dist.group.WORLD,
                                     torch.device("cpu"))
            out = root / scenario / kind
            rec: dict[str, Any] = {"tied_at_start": _tied(zone.model)}
            if scenario == "two":
                rec["step"] = _rank_step(zone, world)
                meta = zone.save_state(out / "state")
                if rank == 0:
                    (out / "state" / "meta.json").write_text(json.dumps(meta))
                # A save the ranks cannot write (its directory is under a file) is a StateError on every rank ...
                try:
                    zone.save_state(root / "a-file" / "sub")
                    rec["bad_save"] = None
                except StateError as e:
                    rec["bad_save"] = str(e)
                # ... and the zone goes on: the buckets a sync sends, the export
                full = _full(zone)
                rec["bucket_names"] = list(full)
                rec["tied_in_one_bucket"] = _tied_in_one_bucket(zone)
                zone.export_hf(out / "export")
                # the local ("full") state of the same step loads into the ranks
                local = root / "local" / kind
                local_meta = json.loads((local / "meta.json").read_text())
                zone.check_state(local, local_meta)
                zone.load_state(local, local_meta)
                rec["tied_after_local_load"] = _tied(zone.model)
                if rank == 0:
                    save_file(full, str(out / "after_step.safetensors"))
                    save_file(_full(zone), str(out / "from_local.safetensors"))
                else:
                    _full(zone)
            else:  # "one": the 2-rank state on 1 rank, saved again as a 1-rank state
                source = root / "two" / kind / "state"
                meta = json.loads((source / "meta.json").read_text())
                zone.check_state(source, meta)
                zone.load_state(source, meta)
                rec["tied_after_load"] = _tied(zone.model)
                rec["loaded_step"] = zone.step
                saved = zone.save_state(out / "state")
                (out / "state" / "meta.json").write_text(json.dumps(saved))
                save_file(_full(zone), str(out / "loaded.safetensors"))
            record[kind] = rec
        if rank == 0:
            (root / scenario / "record.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("tied-ranks")
    (work / "a-file").write_text("not a directory")
    local: dict[str, Any] = {}
    for kind in ("tied", "untied"):
        make_tiny(work / kind, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  tie_word_embeddings=kind == "tied")
        zone = PolicyZone(load_model(str(work / kind), "float32", "cpu"), OPT, COMPUTE)
        fb = zone.forward_backward(_batch(), SPEC, 1.0)
        st = zone.optim_step()
        d = work / "local" / kind
        d.mkdir(parents=True)
        (d / "meta.json").write_text(json.dumps(zone.save_state(d)))
        local[kind] = {"zone": zone, "step": {"loss": fb.metrics["loss"], "grad_norm": st.grad_norm, "step": st.step},
                       "weights": {k: v.clone() for k, v in zone.publish().tensors.items()}}
    for scenario, world in (("two", 2), ("one", 1)):
        for kind in ("tied", "untied"):
            (work / scenario / kind).mkdir(parents=True)
        run_ranks(_rank_main, world, (scenario, str(work)), rendezvous=[work / f"rdzv-{scenario}"])
    return {"work": work, "local": local, **{s: json.loads((work / s / "record.json").read_text()) for s in ("two", "one")}}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k, x in a.items():
        assert torch.allclose(x, b[k], atol=TOL, rtol=0), f"{k}: max diff {(x - b[k]).abs().max()}"


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_ranks_save_once_and_load_across_rank_counts_and_layouts(ranks, kind):
    work, local = ranks["work"], ranks["local"][kind]
    two, one = ranks["two"][kind], ranks["one"][kind]
    assert two["tied_at_start"] is one["tied_at_start"] is (kind == "tied")
    assert two["step"]["step"] == 1
    assert two["step"]["loss"] == pytest.approx(local["step"]["loss"], abs=TOL)
    assert two["step"]["grad_norm"] == pytest.approx(local["step"]["grad_norm"], rel=TOL)
    for scenario, shards in (("two", 2), ("one", 1)):
        state = work / scenario / kind / "state"
        files = sorted((state / "policy").glob("*.safetensors"))
        assert len(files) == shards
        keys = {k for f in files for k in _keys(f)}
        assert ("weights." + EMBED in keys) and (("weights." + HEAD in keys) is (kind == "untied"))
        meta = json.loads((state / "meta.json").read_text())
        assert meta.get("tied_weights") == ({HEAD: EMBED} if kind == "tied" else None)
    _close(local["weights"], load_file(str(work / "two" / kind / "after_step.safetensors")))
    # 2 ranks -> 1 rank: the same weights, still tied
    assert one["loaded_step"] == 1 and one["tied_after_load"] is (kind == "tied")
    _close(local["weights"], load_file(str(work / "one" / kind / "loaded.safetensors")))
    # the one-process ("full") state -> 2 ranks: exactly the local weights
    assert two["tied_after_local_load"] is (kind == "tied")
    from_local = load_file(str(work / "two" / kind / "from_local.safetensors"))
    assert from_local.keys() == local["weights"].keys()
    assert all(torch.equal(from_local[k], v) for k, v in local["weights"].items())
    # sharded states (2 ranks, 1 rank) -> one process
    for scenario in ("two", "one"):
        state = work / scenario / kind / "state"
        meta = json.loads((state / "meta.json").read_text())
        zone = PolicyZone(load_model(str(work / kind), "float32", "cpu"), OPT, COMPUTE)
        zone.check_state(state, meta)
        zone.load_state(state, meta)
        assert zone.step == 1 and _tied(zone.model) is (kind == "tied")
        _close(local["weights"], {k: v for k, v in zone.publish().tensors.items()})


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_ranks_export_and_sync_buckets_and_a_failed_save_is_a_state_error(ranks, kind):
    work, local, two = ranks["work"], ranks["local"][kind], ranks["two"][kind]
    assert sorted(two["bucket_names"]) == sorted(local["weights"])  # a sync sends every name the sampler holds
    if kind == "tied":  # ... and a tied tensor once: under both names, one tensor, in one bucket
        assert two["tied_in_one_bucket"] is True
    exported = work / "two" / kind / "export"
    assert (HEAD in _keys(exported / "model.safetensors")) is (kind == "untied")  # as HF itself saves a tied model
    back = AutoModelForCausalLM.from_pretrained(exported)
    assert _tied(back) is (kind == "tied")
    _close(local["weights"], back.state_dict())
    assert two["bad_save"] is not None and "save_state" in two["bad_save"] and "a-file" in two["bad_save"]
