"""Every causal-LM family floe claims loads, samples and trains, and its sampler agrees with its policy.

For tiny random configs of Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral (full and sliding-window
attention), Gemma 2, Gemma 3 (text), Phi-3, OLMo-2 and gpt-oss: an embedded backend loads
the HF directory with the default `attn_implementation="auto"` (SDPA where the class supports
it, eager for Gemma 2 and gpt-oss, which refuse SDPA), samples (rows stop at different steps,
so rows leave the KV cache), trains one PPO step, syncs, samples again, and the sampler's
log-probs equal the policy's `forward(temperature=0.7)` log-probs within 1e-4 (fp32) before
and after the update. Weights are initialised wide enough (std 0.2) that the distributions
are far from uniform, and sliding windows (8 positions) are shorter than every sequence and
provably change the output, so a cache or mask that mishandled the window would show.

Explicit attention choices: one the architecture refuses is an InvalidInput naming the
supported ones; eager on a prompt-dedup family runs eager in every zone (prompt dedup falls
back to the padded path instead of swapping in its SDPA kernel).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, PretrainedConfig

import floe
from floe.config import BackendConfig, parse_config
from floe.errors import InvalidInput
from floe.models.loading import load_model, resolve_attn_implementation
from floe.models.tiny import make_char_tokenizer
from tests.conftest import backend_of

TEMPERATURE = 0.7
TOLERANCE = 1e-4
WINDOW = 8  # sliding-window length, shorter than every prompt + sample below
SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": WINDOW}


def _common() -> dict[str, Any]:
    tok = make_char_tokenizer()
    return {
        "vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "initializer_range": 0.2, "tie_word_embeddings": False,
        "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
    }


# family -> tiny config. Gemma 2 keeps its attention and final-logit soft-capping on.
CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": lambda: transformers.LlamaConfig(**_common()),
    "qwen2": lambda: transformers.Qwen2Config(**_common()),
    "qwen3": lambda: transformers.Qwen3Config(**_common(), head_dim=16),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **_common(), head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
    ),
    "mistral": lambda: transformers.MistralConfig(**_common(), sliding_window=None),
    "mistral_sliding": lambda: transformers.MistralConfig(**_common(), sliding_window=WINDOW),
    "gemma2": lambda: transformers.Gemma2Config(
        **_common(), head_dim=16, query_pre_attn_scalar=16, **SLIDING,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
    ),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(**_common(), head_dim=16, query_pre_attn_scalar=16, **SLIDING),
    "phi3": lambda: transformers.Phi3Config(**_common()),
    "olmo2": lambda: transformers.Olmo2Config(**_common()),
    "gpt_oss": lambda: transformers.GptOssConfig(  # its YaRN rope implies a 131072 context
        **{**_common(), "max_position_embeddings": 131072},
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, **SLIDING,
    ),
}
SLIDING_FAMILIES = ["mistral_sliding", "gemma2", "gemma3_text", "gpt_oss"]
EAGER_ONLY = {"gemma2", "gpt_oss"}  # their classes refuse SDPA: "auto" must pick eager
PREFIX_DEDUP = {"llama", "qwen2", "qwen3", "mistral"}  # shared-prefix attention supports these


def write_model(family: str, path: Path) -> Path:
    """A tiny random-init model of `family` plus floe's char tokenizer, as an HF directory."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[family]())
    model.save_pretrained(path, safe_serialization=True)
    make_char_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("architectures")
    return {family: write_model(family, root / family) for family in CONFIGS}


def _connect(path: Path, tmp_path: Path, **overrides: Any) -> floe.Client:
    cfg = {"model": str(path), "num_threads": 1, "state_dir": str(tmp_path / "states"), **overrides}
    return floe.connect(BackendConfig(**cfg))


def _sample(client: floe.Client, first_seed: int) -> floe.SampleResult:
    """Two prompts x 2 samples where rows stop at different steps, so rows leave the KV cache
    mid-decode: the first seed from `first_seed` on whose sample lengths differ."""
    tok = client.tokenizer()
    prompts = [tok.encode("The quick brown fox, again"), tok.encode("xyz")]
    for seed in range(first_seed, first_seed + 20):
        params = floe.SamplingParams(
            max_tokens=16, temperature=TEMPERATURE, seed=seed, stop_token_ids=tok.encode("aeiou")
        )
        result = client.sample(prompts, n=2, params=params)
        if len({len(s.tokens) for g in result.groups for s in g.samples}) > 1:
            return result
    raise AssertionError("no seed gave rows of different lengths")


def _as_batch(result: floe.SampleResult, with_old: bool) -> floe.Batch:
    return floe.Batch([
        floe.Group(g.prompt, [
            floe.Sample(s.tokens, s.logprobs if with_old else None, advantage=1.0 if j % 2 else -1.0)
            for j, s in enumerate(g.samples)
        ])
        for g in result.groups
    ])


def _max_gap(result: floe.SampleResult, logprobs: list[list[list[float]]]) -> float:
    gaps = [
        abs(a - b)
        for g, lg in zip(result.groups, logprobs)
        for s, ls in zip(g.samples, lg)
        for a, b in zip(s.logprobs, ls, strict=True)
    ]
    return max(gaps)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_sample_train_sample_agrees_with_policy(family: str, model_dirs: dict[str, Path], tmp_path: Path):
    client = _connect(model_dirs[family], tmp_path, optimizer={"lr": 1e-3})
    backend = backend_of(client)
    expected_attn = "eager" if family in EAGER_ONLY else "sdpa"
    assert backend.sampler.model.config._attn_implementation == expected_attn

    first = _sample(client, first_seed=3)
    logprobs = [x for g in first.groups for s in g.samples for x in s.logprobs]
    assert max(logprobs) - min(logprobs) > 1.0  # far from uniform: agreement is not vacuous
    if family in SLIDING_FAMILIES:
        assert max(len(g.prompt) + len(s.tokens) for g in first.groups for s in g.samples) > 2 * WINDOW
    batch = _as_batch(first, with_old=True)
    before = client.forward(batch, temperature=TEMPERATURE).logprobs
    assert _max_gap(first, before) < TOLERANCE

    fb = client.forward_backward(batch, loss="ppo", temperature=TEMPERATURE)
    assert torch.isfinite(torch.tensor(fb.metrics["loss"]))
    assert _max_gap(first, fb.logprobs) < TOLERANCE  # policy == sampler before the step
    step = client.optim_step()
    assert step.step == 1 and step.grad_norm > 0
    assert client.sync_weights().version == 1

    after_step = client.forward(batch, temperature=TEMPERATURE).logprobs
    assert _max_gap(first, after_step) > TOLERANCE  # the update changed the policy

    second = _sample(client, first_seed=100)
    assert all(s.weights_version == 1 for g in second.groups for s in g.samples)
    again = client.forward(_as_batch(second, with_old=False), temperature=TEMPERATURE).logprobs
    assert _max_gap(second, again) < TOLERANCE  # the synced sampler agrees with the new policy

    policy_attn = backend.policy.model.config._attn_implementation
    assert policy_attn == ("floe_prefix" if family in PREFIX_DEDUP else expected_attn)
    client.close()


@pytest.mark.parametrize("family", SLIDING_FAMILIES)
def test_sliding_window_changes_the_output(family: str, model_dirs: dict[str, Path]):
    """The window is live: the same weights with a window wider than the sequence differ."""
    ids = torch.tensor([list(range(8, 8 + 3 * WINDOW))])
    narrow = load_model(str(model_dirs[family]))
    wide = AutoModelForCausalLM.from_pretrained(
        model_dirs[family], sliding_window=1024, attn_implementation=narrow.config._attn_implementation
    )
    with torch.no_grad():
        a, b = narrow(input_ids=ids).logits, wide(input_ids=ids).logits
    assert torch.allclose(a[:, :WINDOW], b[:, :WINDOW], atol=1e-5)  # inside the window: identical
    assert (a[:, 2 * WINDOW :] - b[:, 2 * WINDOW :]).abs().max() > 1e-2


def test_refused_attention_implementation_names_the_supported_ones(model_dirs: dict[str, Path], tmp_path: Path):
    with pytest.raises(InvalidInput) as err:
        _connect(model_dirs["gemma2"], tmp_path, attn_implementation="sdpa")
    assert err.value.field == "attn_implementation"
    assert "Gemma2ForCausalLM" in err.value.message and "'eager'" in err.value.message
    with pytest.raises(InvalidInput) as err:
        load_model(str(model_dirs["gemma2"]), attn_implementation="sdpa")
    assert err.value.field == "attn_implementation"
    with pytest.raises(InvalidInput) as err:
        parse_config(BackendConfig, {"model": "m", "attn_implementation": "fast"})
    assert err.value.field == "config.attn_implementation"


def test_flash_attention_needs_flash_attn_installed():
    model_class = type(AutoModelForCausalLM.from_config(CONFIGS["llama"]()))
    if transformers.utils.is_flash_attn_2_available():
        assert resolve_attn_implementation(model_class, "flash_attention_2") == "flash_attention_2"
    else:
        with pytest.raises(InvalidInput, match="flash-attn") as err:
            resolve_attn_implementation(model_class, "flash_attention_2")
        assert err.value.field == "attn_implementation"


def test_not_a_causal_lm_is_rejected_before_loading(tmp_path: Path):
    path = tmp_path / "t5"
    transformers.T5Config(d_model=32, num_layers=1, num_heads=2, d_ff=64).save_pretrained(path)
    with pytest.raises(InvalidInput, match="t5") as err:
        load_model(str(path))
    assert err.value.field == "model"


def test_explicit_eager_runs_eager_everywhere(model_dirs: dict[str, Path], tmp_path: Path):
    """A prompt-dedup family loaded with eager keeps eager: dedup falls back to the padded path."""
    client = _connect(model_dirs["qwen3"], tmp_path, attn_implementation="eager")
    backend = backend_of(client)
    first = _sample(client, first_seed=5)
    batch = _as_batch(first, with_old=True)
    assert _max_gap(first, client.forward(batch, temperature=TEMPERATURE).logprobs) < TOLERANCE
    client.forward_backward(batch, loss="ppo", temperature=TEMPERATURE)
    for model in (backend.policy.model, backend.sampler.model, backend.reference.model):
        assert model.config._attn_implementation == "eager"
    client.close()
