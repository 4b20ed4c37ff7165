"""Shared-prefix decoding (`floe.sampler.prefix_decode`) gives what the padded path and a plain
HF forward of the full sequence give: same tokens, log-probs within 1e-5 (fp32; the paths
sum attention in a different order, so they agree to float rounding, not bit for bit)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import floe
from floe.models import load_model, load_tokenizer, make_tiny
from floe.sampler.prefix_decode import supports_prefix_decode
from floe.sampler.torch_engine import TorchEngine

COMMON = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 256}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("m") / "q3", hidden_size=64, num_attention_heads=4,
                     num_key_value_heads=2, num_hidden_layers=2)


def _model(family: str, tiny_dir, vocab: int):
    torch.manual_seed(0)
    if family == "qwen3":
        return load_model(str(tiny_dir))
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, **COMMON)).eval()
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, **COMMON)).eval()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_prefix_decode_matches_padded_path_and_full_forward(family, temperature, tiny_dir):
    tok = load_tokenizer(str(tiny_dir))
    model = _model(family, tiny_dir, len(tok))
    assert supports_prefix_decode(model)
    new, old = TorchEngine(model, tok, 64), TorchEngine(model, tok, 64, shared_prefix=False)
    assert new.shared_prefix and not old.shared_prefix
    prompts = [tok.encode("hello world"), tok.encode("ab"), tok.encode("a much longer prompt than the others")]
    # Stop strings / stop tokens make rows finish at different steps.
    params = floe.SamplingParams(max_tokens=16, temperature=temperature, stop=["e"], stop_at_eos=False)
    got, want = new.generate(prompts, 3, params, [1, 2, 3], 0), old.generate(prompts, 3, params, [1, 2, 3], 0)
    lengths = set()
    for g_new, g_old, prompt in zip(got, want, prompts):
        for a, b in zip(g_new.samples, g_old.samples):
            assert a.tokens == b.tokens and a.stop_reason == b.stop_reason
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
            lengths.add(len(a.tokens))
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + a.tokens])).logits[0, len(prompt) - 1 : -1].float()
            t = temperature if temperature > 0 else 1.0
            ref = torch.log_softmax(logits / t, dim=-1).gather(-1, torch.tensor(a.tokens)[:, None])[:, 0]
            assert a.logprobs == pytest.approx(ref.tolist(), abs=1e-5)
    if temperature > 0:
        assert len(lengths) > 1  # rows did finish at different times


def test_unsupported_models_keep_the_padded_path(tiny_dir):
    tok = load_tokenizer(str(tiny_dir))
    model = _model("qwen2", tiny_dir, len(tok))
    model.config.use_sliding_window = True
    assert not supports_prefix_decode(model) and not TorchEngine(model, tok, 8).shared_prefix
    assert not supports_prefix_decode(object())
