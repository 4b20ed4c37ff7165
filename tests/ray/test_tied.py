"""A tied-embedding model on the Ray placement (issue 23, item 1): save_state at 2 and 1 policy
ranks (the tied tensor once), load across rank counts and into the local placement, export and
sync; a save the ranks cannot write is a StateError of that save and the backend goes on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from floe.errors import StateError
from floe.models import make_tiny
from tests.ray.conftest import RAY_PLACEMENT
from tests.ray.steps import Record, assert_close_weights, grpo_step, weights

TOL = 1e-5
ONE_RANK = {**RAY_PLACEMENT, "policy": {"workers": 1, "cpus": 1}, "sampler": {"workers": 1, "cpus": 1},
            "reference": {"colocate_with_policy": True}}
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tied") / "tiny", hidden_size=64, num_hidden_layers=2,
                     tie_word_embeddings=True)


def _shard_keys(state: Path) -> set[str]:
    keys: set[str] = set()
    for f in (state / "policy").glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            keys |= set(st.keys())
    return keys


def test_tied_model_state_on_two_and_one_ranks_and_back_to_local(ray_cluster, make_backend, tied_model, tmp_path) -> None:
    two = make_backend(model=str(tied_model), placement=RAY_PLACEMENT)
    a = Record()
    grpo_step(two, 0, a)  # includes a broadcast sync of the tied model
    assert a.versions == [0] and two.info().sampler_version == 1
    saved = two.save_state("two_ranks")
    assert (saved.step, saved.version) == (1, 1)
    state = tmp_path / "states" / "two_ranks"
    assert "weights." + EMBED in _shard_keys(state) and "weights." + HEAD not in _shard_keys(state)
    assert json.loads((state / "state.json").read_text())["tied_weights"] == {HEAD: EMBED}

    # A save the ranks cannot write: an error of that save; the backend is not failed.
    with pytest.raises(StateError, match="could not write their shards"):
        two.policy.save_state(tmp_path / "states" / "two_ranks" / "state.json" / "sub")
    assert two.info().step == 1
    grpo_step(two, 1, a)

    one = make_backend(model=str(tied_model), placement=ONE_RANK)  # 2 ranks -> 1 rank
    assert one.load_state("two_ranks").step == 1
    b = Record()
    grpo_step(one, 1, b)
    assert b.tokens == a.tokens[1:] and b.losses == pytest.approx(a.losses[1:], abs=TOL)
    assert_close_weights(weights(one), weights(two), TOL)
    one.save_state("one_rank")
    one.close()

    local = make_backend(model=str(tied_model))  # Ray (1 rank) -> local
    assert local.load_state("one_rank").step == 2
    assert local.policy.model.lm_head.weight is local.policy.model.model.embed_tokens.weight
    assert_close_weights(weights(local), weights(two), TOL)
    local.save_state("local")  # local -> Ray (2 ranks)
    assert two.load_state("local").step == 2
    c, d = Record(), Record()
    grpo_step(local, 2, c)
    grpo_step(two, 2, d)
    assert c.tokens == d.tokens and c.losses == pytest.approx(d.losses, abs=TOL)
    assert_close_weights(weights(local), weights(two), TOL)

    out = Path(two.export_hf(str(tmp_path / "export")))
    back = AutoModelForCausalLM.from_pretrained(out)
    assert back.lm_head.weight is back.model.embed_tokens.weight
    mine = weights(two)
    assert all(torch.allclose(v.float(), mine[k], atol=0, rtol=0) for k, v in back.state_dict().items())
