"""`[lora]` on FSDP2 ranks: 2 spawned ranks (gloo, CPU) of `ShardedLoraPolicyZone` give what
one `LoraPolicyZone` gives, and the two share one state layout ("lora").

The reference is the local LoRA zone on the same tiny model, batches, seed and [lora] (every
linear layer, the LM head included, so the adapted head is scored through the FSDP root). The
ranks run as spawns of `_rank_main` (`tests.spawn.run_ranks`), as in test_fsdp.py, whose
batches, losses, optimizer, micro-batching and tolerances this module reuses: the ranks and the
one process add the same fp32 terms in another order, nothing else differs, so
* first-order terms from the same weights (losses, metrics, log-probs, grad norms) agree within
  test_fsdp.FIRST_ORDER = 1e-5 relative;
* the adapter after 3 AdamW steps within test_fsdp's update bounds (per tensor UPDATE_REL = 1e-3
  of the update; elementwise ELEMENT_LR · lr · steps = 3e-4), and the merged weights the ranks
  publish (the sampler's weights) within the same elementwise bound.
Measured on the 2-core AMD EPYC VM: losses 7e-9 and grad norms 1.8e-7 relative apart, log-probs
2.4e-6 absolute (6e-7 relative); the adapter after 3 steps 2.3e-5 elementwise (bound 3e-4) and
1.2e-4 of its update per tensor (bound 1e-3); the merged weights 1.4e-6 elementwise.

Exact, not within a tolerance: the ranks' own resume (save after step 2, load, step 3 again:
bit-identical loss, log-probs, grad norm, adapter), and a state moving between one process and
the ranks (what the loader holds after load_state equals the saved files bit for bit).

One spawn ("train", 2 ranks): 3 steps with a "lora" save after step 2; forward with entropy;
the merged buckets and the peft export; reload of its own state2 and step 3 again; then the
local zone's state2 loads into the ranks and step 3 runs from it; check_state refuses a
full-weights state and another rank.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from peft import PeftModel
from safetensors.torch import load_file, save_file

from floe.backend.policy import PolicyZone
from floe.backend.policy_lora import LoraPolicyZone
from floe.config import LoraConfig
from floe.errors import StateError
from floe.models import load_model, make_tiny
from floe.models.lora import AdapterHost
from tests.backend.test_fsdp import (
    COMPUTE,
    ELEMENT_LR,
    OPT,
    _batches,
    _close,
    _close_weights,
    _forward,
    _loss,
    _step,
    _weights_of,
)
from tests.spawn import RANK_TIMEOUT_S, collective_timeout, run_ranks

pytestmark = pytest.mark.timeout(int(2 * RANK_TIMEOUT_S))

SEED = 5
LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj", "lm_head"])


def _local_zone(model_dir: str, seed: int = SEED, lora: LoraConfig = LORA) -> LoraPolicyZone:
    return LoraPolicyZone(AdapterHost(load_model(model_dir, "float32", "cpu"), model_dir), lora, seed, OPT, COMPUTE)


def _adapter(zone: Any) -> dict[str, torch.Tensor]:
    """The whole adapter by peft name (collective on the ranks)."""
    return {k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for k, p in zone.host.named_parameters("policy").items()}


def _save(zone: Any, directory: Path, rank: int = 0) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    meta = zone.save_state(directory)
    if rank == 0:
        (directory / "meta.json").write_text(json.dumps(meta))


def _load(zone: Any, directory: Path) -> None:
    meta = json.loads((directory / "meta.json").read_text())
    zone.check_state(directory, meta)
    zone.load_state(directory, meta)


def _rank_main(rank: int, world: int, model_dir: str, work: str) -> None:
    from floe.backend.policy_sharded_lora import ShardedLoraPolicyZone

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{work}/rdzv-lora", rank=rank, world_size=world,
                            timeout=collective_timeout())
    try:
        out = Path(work) / "train"
        batches = _batches()
        host = AdapterHost(load_model(model_dir, "float32", "cpu"), model_dir)
        zone = ShardedLoraPolicyZone(host, LORA, SEED, OPT, COMPUTE, dist.group.WORLD, torch.device("cpu"))
        record: dict[str, Any] = {
            "trainable": sum(p.numel() for p in zone.params),
            "frozen_have_no_grad_flag": all(not p.requires_grad for p in host.base_parameters),
            "initial": None,
        }
        initial = _adapter(zone)
        record["steps"] = []
        for i, batch in enumerate(batches):
            if i == 2:
                _save(zone, out / "state2", rank)
            record["steps"].append(_step(zone, batch, _loss(i), world))
        record["forward"] = _forward(zone, batches[1], world)
        final_adapter, final_merged = _adapter(zone), _weights_of(zone)
        zone.export_hf(out / "export")
        # Exact resume on the ranks: state2 back, step 3 again.
        _load(zone, out / "state2")
        record["loaded_step"] = zone.step
        record["resumed"] = _step(zone, batches[2], _loss(2), world)
        resumed_adapter = _adapter(zone)
        # The local zone's state2 (one process) on the ranks: loaded bit for bit, then step 3.
        _load(zone, Path(work) / "local_state2")
        loaded_from_local = _adapter(zone)
        record["from_local"] = _step(zone, batches[2], _loss(2), world)
        from_local = _adapter(zone)
        refusals = []
        for other in ("full_state", "rank8_state"):
            try:
                zone.check_state(Path(work) / other, json.loads((Path(work) / other / "meta.json").read_text()))
                refusals.append(None)
            except StateError as exc:
                refusals.append(str(exc))
        record["refused"] = refusals
        if rank == 0:
            save_file(initial, str(out / "initial.safetensors"))
            save_file(final_adapter, str(out / "final_adapter.safetensors"))
            save_file(final_merged, str(out / "final_merged.safetensors"))
            save_file(resumed_adapter, str(out / "resumed_adapter.safetensors"))
            save_file(loaded_from_local, str(out / "loaded_from_local.safetensors"))
            save_file(from_local, str(out / "from_local.safetensors"))
            (out / "record.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The local LoRA reference and the 2-rank spawn, run once for the module's tests."""
    work = tmp_path_factory.mktemp("fsdp_lora")
    model_dir = str(make_tiny(work / "tiny", hidden_size=64, num_hidden_layers=2))
    batches = _batches()
    local = _local_zone(model_dir)
    initial = {k: v.clone() for k, v in local.model.state_dict().items()}
    steps = []
    for i, batch in enumerate(batches):
        if i == 2:
            _save(local, work / "local_state2")
        steps.append(_step(local, batch, _loss(i), 1))
    forward = local.forward(batches[1], 1.0, True)
    _save(PolicyZone(load_model(model_dir, "float32", "cpu"), OPT, COMPUTE), work / "full_state")
    _save(_local_zone(model_dir, lora=LORA.model_copy(update={"rank": 8})), work / "rank8_state")
    (work / "train").mkdir()
    run_ranks(_rank_main, 2, (model_dir, str(work)), rendezvous=[work / "rdzv-lora"])
    return {
        "work": work, "model_dir": model_dir, "local_steps": steps, "local_forward": forward,
        "local_initial": initial, "local_adapter": {k: v.clone() for k, v in local.model.state_dict().items()},
        "local_merged": _weights_of(local), "record": json.loads((work / "train" / "record.json").read_text()),
        "local": local,
    }


def _file(runs: dict[str, Any], name: str) -> dict[str, torch.Tensor]:
    return load_file(str(runs["work"] / "train" / f"{name}.safetensors"))


def test_two_lora_ranks_train_like_one_lora_process(runs):
    rec = runs["record"]
    assert rec["frozen_have_no_grad_flag"]
    assert rec["trainable"] == sum(v.numel() for v in runs["local_adapter"].values())  # AdamW holds the adapter alone
    assert [s["step"] for s in rec["steps"]] == [1, 2, 3]
    _close(runs["local_steps"], rec["steps"])  # losses, metrics, grad norms, lr, log-probs of all 3 steps
    _close({"logprobs": runs["local_forward"].logprobs, "entropy": runs["local_forward"].entropy}, rec["forward"])
    initial = _file(runs, "initial")
    assert all(torch.equal(initial[k], v) for k, v in runs["local_initial"].items())  # the same init from the seed
    _close_weights(initial, runs["local_adapter"], _file(runs, "final_adapter"))


def test_the_ranks_publish_the_merged_weights_of_one_lora_process(runs):
    merged, local = _file(runs, "final_merged"), runs["local_merged"]
    base = load_model(runs["model_dir"], "float32", "cpu").state_dict()
    assert merged.keys() == local.keys() == base.keys()  # the base model's names: what every sampler engine holds
    bound = ELEMENT_LR * OPT.lr * 3
    changed = [k for k in merged if not torch.equal(merged[k], base[k])]
    assert "lm_head.weight" in changed and any("q_proj" in k for k in changed)
    for k, v in merged.items():
        assert float((v - local[k]).abs().max()) <= bound, k


def test_lora_ranks_resume_exactly_and_share_the_local_state_layout(runs):
    rec = runs["record"]
    assert rec["loaded_step"] == 2
    assert rec["resumed"] == rec["steps"][2]  # bit-identical: loss, metrics, log-probs, grad norm
    final, resumed = _file(runs, "final_adapter"), _file(runs, "resumed_adapter")
    assert all(torch.equal(final[k], resumed[k]) for k in final)

    state2 = runs["work"] / "train" / "state2"
    assert {"adapter_config.json", "adapter_model.safetensors", "optimizer.safetensors", "policy_rng.safetensors"} <= {
        p.name for p in state2.iterdir()}
    assert json.loads((state2 / "meta.json").read_text())["policy_layout"] == "lora"
    # one process loads the ranks' state bit for bit, and step 3 from it matches the ranks' step 3
    local = _local_zone(runs["model_dir"], seed=SEED + 1)  # another init: the state decides
    _load(local, state2)
    saved = load_file(str(state2 / "adapter_model.safetensors"))
    assert all(torch.equal(local.model.state_dict()[k], v) for k, v in saved.items())
    _close(rec["steps"][2], _step(local, _batches()[2], _loss(2), 1))
    # peft loads it on the base model
    peft_model = PeftModel.from_pretrained(load_model(runs["model_dir"]), str(state2))
    assert sum(1 for k, _ in peft_model.named_parameters() if ".lora_" in k) == len(saved)

    # ... and the ranks load the local zone's state bit for bit
    local_saved = load_file(str(runs["work"] / "local_state2" / "adapter_model.safetensors"))
    loaded = _file(runs, "loaded_from_local")
    assert all(torch.equal(loaded[k], v) for k, v in local_saved.items())
    _close(runs["local_steps"][2], rec["from_local"])


def test_lora_ranks_export_a_peft_adapter_and_refuse_other_states(runs):
    export = runs["work"] / "train" / "export"
    exported = load_file(str(export / "adapter_model.safetensors"))
    final = _file(runs, "final_adapter")
    assert all(torch.equal(exported[k], final[k]) for k in final)
    assert json.loads((export / "adapter_config.json").read_text())["r"] == 4
    full, rank8 = runs["record"]["refused"]
    assert full is not None and "full policy" in full
    assert rank8 is not None and "r = 8" in rank8
