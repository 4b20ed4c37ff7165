"""First use of the Python API: prompt containers, sample temperatures, chat rendering, GRPO helpers.

Item 9 (greedy and prompt containers), item 10 (samples carry their temperature; a mismatch
is refused, an omitted temperature is taken from them) and item 11 (floe.chat, floe.grpo and
the GRPO script in docs/examples) of the "First use" issue.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import floe
from floe.client.inputs import as_prompts
from floe.rl import advantages as rl_advantages
from floe.rl import rollouts
from floe.rl.config import AdvantageConfig
from tests.conftest import assert_same_state, backend_of, counted, state_snapshot
from tests.protocol.surface import serve_in_thread

ROOT = Path(__file__).resolve().parents[1]
GRPO_SCRIPT = ROOT / "docs" / "examples" / "grpo_script.py"


# -- item 9: prompts in the containers users have -------------------------------------------------


def test_prompt_containers_sample_like_plain_lists(make_client):
    """A BatchEncoding (padded, with its mask), numpy arrays, tensors and tuples reach the
    sampler as the same prompts as plain lists: same prompts back, same seeded samples."""
    client = make_client()
    tok = client.tokenizer()
    texts = ["ab", "hello there"]
    plain = [tok.encode(t) for t in texts]
    params = floe.SamplingParams(max_tokens=5, seed=11)
    want = client.sample(plain, n=2, params=params)
    for side in ("left", "right"):
        tok.padding_side = side
        padded = tok(texts, padding=True, return_tensors="pt")
        assert padded["input_ids"].shape == (2, len(plain[1]))  # the short prompt is padded
        got = client.sample(padded, n=2, params=params)
        assert [g.prompt for g in got.groups] == plain  # the padding is gone
        assert [g.samples for g in got.groups] == [g.samples for g in want.groups]
    same_length = [tok.encode("abcd"), tok.encode("wxyz")]
    want_same = client.sample(same_length, params=params)
    for given in (np.array(same_length, dtype=np.int64), torch.tensor(same_length), tuple(tuple(p) for p in same_length),
                  [np.array(p, dtype=np.int32) for p in same_length], {"input_ids": same_length}):
        got = client.sample(given, params=params)
        assert [g.prompt for g in got.groups] == same_length
        assert [g.samples for g in got.groups] == [g.samples for g in want_same.groups]
    one = client.sample(torch.tensor(plain[1]), params=params)  # 1-D: a single prompt
    assert [g.prompt for g in one.groups] == [plain[1]]
    ragged = client.sample(tok(texts), params=params)  # a BatchEncoding of ragged lists, taken as is
    assert [g.prompt for g in ragged.groups] == plain


@pytest.mark.parametrize("prompts, field, words", [
    ([[1, 2.5]], "prompts[0]", "integers"),
    ([1.0, 2.0], "prompts[0]", "integers"),
    (np.array([[1.0, 2.0]]), "prompts", "float64"),
    (torch.tensor([[1.5]]), "prompts", "torch.float32"),
    (torch.tensor([[True]]), "prompts", "torch.bool"),
    (np.zeros((1, 2, 3), dtype=np.int64), "prompts", "3-D"),
    ("some text", "prompts", "not text"),
    ([], "prompts", "non-empty"),
    ([[]], "prompts[0]", "empty"),
    ([[3, 4], 5], "prompts[1]", "list of token ids"),
    ({"input_ids": [[3, 4]], "token_type_ids": [[0, 0]]}, "prompts", "token_type_ids"),
    ({"attention_mask": [[1]]}, "prompts", "input_ids"),
    ({"input_ids": [[3, 4, 5]], "attention_mask": [[1, 0, 1]]}, "prompts.attention_mask[0]", "contiguous"),
    ({"input_ids": [[3, 4]], "attention_mask": [[1, 1, 1]]}, "prompts.attention_mask", "shape"),
    ({"input_ids": [[3, 4]], "attention_mask": [[0, 0]]}, "prompts.attention_mask[0]", "every token"),
    ([[3, -1]], "prompts[0]", "outside the vocabulary"),
    (np.array([[3, 10**6]]), "prompts[0]", "outside the vocabulary"),
])
def test_bad_prompts_are_refused_naming_the_field(make_client, prompts, field, words):
    client = make_client()
    before = state_snapshot(client)
    with pytest.raises(floe.InvalidInput) as e:
        client.sample(prompts, params=floe.SamplingParams(max_tokens=2))
    assert e.value.field == field and words in e.value.message
    assert_same_state(before, state_snapshot(client))


def test_as_prompts_leaves_its_input_alone_and_returns_plain_ints():
    ids = np.array([[5, 6, 7]], dtype=np.uint16)
    mask = torch.tensor([[0, 1, 1]])
    out = as_prompts({"input_ids": ids, "attention_mask": mask})
    assert out == [[6, 7]] and all(type(t) is int for t in out[0])
    assert ids.tolist() == [[5, 6, 7]] and mask.tolist() == [[0, 1, 1]]
    given = [[1, 2]]
    assert as_prompts(given) == given and as_prompts(given) is not given


def test_greedy_is_accepted_and_negative_temperature_refused(make_client):
    client = make_client()
    tok = client.tokenizer()
    out = client.sample([tok.encode("ab")], n=2, params=floe.SamplingParams(max_tokens=4, temperature=0))
    assert out.groups[0].samples[0].tokens == out.groups[0].samples[1].tokens
    before = state_snapshot(client)
    for bad in (-0.5, math.nan, math.inf, "0"):
        with pytest.raises(floe.InvalidInput) as e:
            client.sample([tok.encode("ab")], params=floe.SamplingParams(temperature=bad))  # type: ignore[arg-type]
        assert e.value.field == "params.temperature" and "0 = greedy" in e.value.message
    assert_same_state(before, state_snapshot(client))


# -- item 10: samples carry their temperature --------------------------------------------------------


def _drawn_at(client: floe.Client, temperature: float) -> tuple[floe.SampleResult, floe.Batch]:
    tok = client.tokenizer()
    out = client.sample([tok.encode("abc"), tok.encode("xy")], n=3,
                        params=floe.SamplingParams(max_tokens=6, temperature=temperature, seed=4))
    rewards = [[float(j) for j in range(len(g.samples))] for g in out.groups]
    return out, floe.grpo.batch_from_samples(out, rewards)


def test_forward_backward_takes_the_samples_temperature(make_client):
    """Samples drawn at 0.7 and trained without temperature= are scored at 0.7: ratios are 1
    before any step, and the call equals one that passes temperature=0.7 explicitly."""
    client = make_client()
    out, batch = _drawn_at(client, 0.7)
    assert out.temperature == 0.7 and {s.temperature for g in batch.groups for s in g.samples} == {0.7}
    implicit = client.forward_backward(batch, "ppo")
    assert implicit.metrics["ratio_min"] == pytest.approx(1.0, abs=1e-4)
    assert implicit.metrics["ratio_max"] == pytest.approx(1.0, abs=1e-4)
    fwd = client.forward(batch)  # forward follows the same rule
    for g, fg in zip(out.groups, fwd.logprobs):
        for s, fs in zip(g.samples, fg):
            assert max(abs(a - b) for a, b in zip(s.logprobs, fs)) < 1e-4
    other = make_client()
    explicit = other.forward_backward(batch, "ppo", temperature=0.7)
    assert counted(explicit.metrics) == counted(implicit.metrics) and explicit.logprobs == implicit.logprobs
    # The same samples scored at temperature 1 (the old silent default) have ratios far from 1.
    unstated = floe.Batch([floe.Group(g.prompt, [floe.Sample(s.tokens, s.logprobs, s.advantage) for s in g.samples])
                           for g in batch.groups])
    silent = other.forward_backward(unstated, "ppo")
    assert max(abs(silent.metrics["ratio_min"] - 1), abs(silent.metrics["ratio_max"] - 1)) > 0.05


def test_a_temperature_mismatch_is_refused_naming_the_sample(make_client):
    client = make_client()
    _, batch = _drawn_at(client, 0.7)
    before = state_snapshot(client)
    with pytest.raises(floe.InvalidInput) as e:
        client.forward_backward(batch, "ppo", temperature=1.0)
    assert e.value.field == "batch.groups[0].samples[0].temperature"
    assert "0.7" in e.value.message and "1.0" in e.value.message
    with pytest.raises(floe.InvalidInput) as e:
        client.forward(batch, zone="reference", temperature=0.9)
    assert e.value.field == "batch.groups[0].samples[0].temperature"
    batch.groups[1].samples[2].temperature = 0.9  # samples that disagree among themselves
    with pytest.raises(floe.InvalidInput) as e:
        client.forward_backward(batch, "ppo")
    assert e.value.field == "batch.groups[1].samples[2].temperature"
    assert "0.9" in e.value.message and "batch.groups[0].samples[0].temperature states 0.7" in e.value.message
    for bad in (0.0, -1.0, math.nan, "hot"):
        batch.groups[1].samples[2].temperature = bad  # type: ignore[assignment]
        with pytest.raises(floe.InvalidInput) as e:
            client.forward_backward(batch, "ppo")
        assert e.value.field == "batch.groups[1].samples[2].temperature"
    with pytest.raises(floe.InvalidInput) as e:
        client.forward_backward(batch, "ppo", temperature=0.0)
    assert e.value.field == "temperature"
    assert_same_state(before, state_snapshot(client))


def test_prompts_and_temperatures_cross_http_like_in_process(make_client):
    """Over the wire: a padded BatchEncoding is normalised by the client, samples come back
    with their temperature, and forward_backward takes it from them or refuses a mismatch."""
    client = make_client()
    with serve_in_thread(backend_of(client)) as url, floe.connect(url) as remote:
        tok = remote.tokenizer()
        encoding = tok(["ab", "hello"], padding=True, return_tensors="pt")
        out = remote.sample(encoding, n=2, params=floe.SamplingParams(max_tokens=4, temperature=0.7, seed=3))
        assert [g.prompt for g in out.groups] == [tok.encode("ab"), tok.encode("hello")]
        assert out.temperature == 0.7
        batch = floe.grpo.batch_from_samples(out, [[1.0, 0.0], [0.0, 1.0]])
        with pytest.raises(floe.InvalidInput) as e:
            remote.forward_backward(batch, "ppo", temperature=1.0)
        assert e.value.field == "batch.groups[0].samples[0].temperature"
        res = remote.forward_backward(batch, "ppo")
        assert res.metrics["ratio_max"] == pytest.approx(1.0, abs=1e-4)
        with pytest.raises(floe.InvalidInput) as e:
            remote.sample(np.array([[1.5]]))
        assert e.value.field == "prompts"


def test_unstated_temperatures_keep_the_default_of_one(make_client):
    """Batches without temperatures (every caller before this field) score at 1.0 as before,
    and a call's explicit temperature applies to them unchanged."""
    client = make_client()
    tok = client.tokenizer()
    batch = floe.Batch([floe.Group(tok.encode("q"), [floe.Sample(tok.encode("abc"))])])
    assert client.forward(batch).logprobs == client.forward(batch, temperature=1.0).logprobs
    assert client.forward(batch, temperature=0.5).logprobs != client.forward(batch).logprobs


# -- item 11: chat renderer and GRPO helpers on the public API ----------------------------------------


def test_chat_renderer_is_public_and_the_one_the_rl_loop_uses(make_client):
    assert rollouts.Renderer is floe.chat.Renderer
    client = make_client()
    tok = client.tokenizer()
    chat = floe.chat.Renderer(tok)
    history = [{"role": "user", "content": "hi"}]
    prompt = chat.render(history)
    assert tok.decode(prompt) == "<|user|>hi<|end|><|assistant|>"
    out = client.sample([prompt], params=floe.SamplingParams(max_tokens=6, seed=0, stop_at_eos=False))
    seq = out.groups[0].samples[0]
    new = [{"role": "user", "content": "more"}]
    nxt = chat.next_prompt(prompt, seq, history, new)
    assert nxt[: len(prompt) + len(seq.tokens)] == prompt + seq.tokens  # the completion verbatim
    assert tok.decode(nxt[len(prompt) + len(seq.tokens):]) == "<|end|><|user|>more<|end|><|assistant|>"
    assert chat.decode(seq.tokens) == tok.decode(seq.tokens, skip_special_tokens=True)


def test_group_advantages_public_and_rl_agree():
    rewards = [1.0, 0.0, 0.5, 0.25]
    assert floe.grpo.group_advantages(rewards) == [0.5625, -0.4375, 0.0625, -0.1875]
    assert floe.grpo.group_advantages([0.3, 0.3]) is None
    assert floe.grpo.group_advantages([0.3, 0.3], drop_constant_groups=False) == [0.0, 0.0]
    for cfg in (AdvantageConfig(), AdvantageConfig(scale_std=True, eps=1e-3), AdvantageConfig(drop_constant_groups=False)):
        assert rl_advantages.group_advantages(rewards, cfg) == floe.grpo.group_advantages(
            rewards, scale_std=cfg.scale_std, drop_constant_groups=cfg.drop_constant_groups, eps=cfg.eps)
    with pytest.raises(floe.InvalidInput) as e:
        floe.grpo.group_advantages([1.0, math.nan])
    assert e.value.field == "rewards[1]"


def test_batch_from_samples_builds_groups_and_names_bad_rewards(make_client):
    client = make_client()
    tok = client.tokenizer()
    out = client.sample([tok.encode("a"), tok.encode("b")], n=2, params=floe.SamplingParams(max_tokens=3, temperature=0.5))
    batch = floe.grpo.batch_from_samples(out, [[1.0, 0.0], [2.0, 2.0]])  # the second group is constant
    assert len(batch.groups) == 1 and batch.groups[0].prompt == out.groups[0].prompt
    first = out.groups[0].samples
    assert [(s.tokens, s.logprobs, s.advantage, s.temperature) for s in batch.groups[0].samples] == [
        (first[0].tokens, first[0].logprobs, 0.5, 0.5), (first[1].tokens, first[1].logprobs, -0.5, 0.5)]
    kept = floe.grpo.batch_from_samples(out, [[1.0, 0.0], [2.0, 2.0]], drop_constant_groups=False)
    assert [s.advantage for g in kept.groups for s in g.samples] == [0.5, -0.5, 0.0, 0.0]
    for rewards, field in [([[1.0, 0.0]], "rewards"), ([[1.0, 0.0], [1.0]], "rewards[1]"),
                           ([[1.0, 0.0], [1.0, math.inf]], "rewards[1][1]"), (None, "rewards")]:
        with pytest.raises(floe.InvalidInput) as e:
            floe.grpo.batch_from_samples(out, rewards)  # type: ignore[arg-type]
        assert e.value.field == field
    with pytest.raises(floe.InvalidInput) as e:
        floe.grpo.batch_from_samples(batch, [[1.0]])  # type: ignore[arg-type]
    assert e.value.field == "result"


def test_grpo_script_runs_on_the_public_api_and_learns(tmp_path):
    """docs/examples/grpo_script.py: at most 40 lines, no internal imports, and 12 steps of
    GRPO raise the toy reward with finite losses; the final greedy answers are printed."""
    source = GRPO_SCRIPT.read_text()
    assert len(source.splitlines()) <= 40
    assert f"```python\n{source}```" in (ROOT / "docs" / "api.md").read_text()  # the docs show this very script
    imports = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
    assert imports == ["import json", "import sys", "import tempfile", "import floe", "from floe.models import make_tiny"]
    proc = subprocess.run([sys.executable, str(GRPO_SCRIPT), "12"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    steps, final = lines[:-1], lines[-1]
    assert [s["step"] for s in steps] == list(range(12))
    assert all(s["loss"] is not None and math.isfinite(s["loss"]) for s in steps)
    first, last = sum(s["reward"] for s in steps[:3]) / 3, sum(s["reward"] for s in steps[-3:]) / 3
    assert last > first + 0.1, (first, last)
    assert len(final["greedy"]) == 4 and all(isinstance(t, str) for t in final["greedy"])
