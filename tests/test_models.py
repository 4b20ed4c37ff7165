"""The tiny-model kit writes an ordinary HF directory that the real loaders read back."""

from __future__ import annotations

import json

import pytest
import torch

import floe
from floe.models import load_model, load_tokenizer, make_tiny
from tests.conftest import backend_of


def test_tiny_model_is_a_normal_hf_directory(tmp_path):
    path = make_tiny(tmp_path / "m", hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["hidden_size"] == 32 and cfg["num_hidden_layers"] == 1
    tok = load_tokenizer(str(path))
    text = "Hello, world!\n  tabs\tand 123"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) == len(text)  # one token per character
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|user|>hi<|end|><|assistant|>"
    model = load_model(str(path))
    assert model.config.vocab_size == len(tok) and not model.training


def test_same_seed_same_weights(tmp_path):
    a = load_model(str(make_tiny(tmp_path / "a", seed=1)))
    b = load_model(str(make_tiny(tmp_path / "b", seed=1)))
    c = load_model(str(make_tiny(tmp_path / "c", seed=2)))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_gradient_checkpointing_gives_the_same_gradients(make_client):
    grads = []
    for ckpt in (False, True):
        client = make_client(compute={"gradient_checkpointing": ckpt})
        tok = client.tokenizer()
        batch = floe.Batch([floe.Group(tok.encode("prompt"), [floe.Sample(tok.encode("abc")), floe.Sample(tok.encode("de"))])])
        client.forward_backward(batch, "cross_entropy")
        grads.append(torch.cat([p.grad.reshape(-1) for p in backend_of(client).policy.params]))
    assert float((grads[0] - grads[1]).norm() / grads[0].norm()) < 1e-6


def test_make_tiny_replaces_only_its_own_directories(tmp_path):
    path = make_tiny(tmp_path / "m", hidden_size=32, num_hidden_layers=1, seed=1)
    assert json.loads((path / "floe_tiny.json").read_text())["seed"] == 1
    make_tiny(path, hidden_size=32, num_hidden_layers=1, seed=2)  # its own: replaced
    assert json.loads((path / "floe_tiny.json").read_text())["seed"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary directories left
    empty = tmp_path / "empty"
    empty.mkdir()
    assert make_tiny(empty, hidden_size=32, num_hidden_layers=1) == empty
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    a_file = tmp_path / "file"
    a_file.write_text("keep me too")
    for victim in (foreign, a_file):
        with pytest.raises(floe.InvalidInput, match="not written by make_tiny") as e:
            make_tiny(victim, hidden_size=32, num_hidden_layers=1)
        assert e.value.field == "path"
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"] and a_file.read_text() == "keep me too"
