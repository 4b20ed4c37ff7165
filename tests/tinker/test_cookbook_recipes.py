"""tinker-cookbook 0.6.1's stock recipes, unmodified, against `floe serve`, with their own
algorithm keys and defaults (stable_reinforce for the RL ones). Overridden only: the model (a
tiny local model), the data (offline), sizes (batch, group, max_tokens, steps) and base_url.

* `recipes/rl_loop.py`: `main(Config(...))`. Its renderer comes from its model name
  (`model_info.get_recommended_renderer_name`, which knows hub names only), so the model is named
  as its default is, "Qwen/Qwen3.5-9B-Base", and that name is a directory (relative to the working
  directory: the cookbook's tokenizer loader takes local directories) holding the tiny model, which
  the server serves under that name (`served_model_name`). Its hard-coded
  `datasets.load_dataset("openai/gsm8k", "main")` gets local rows at that call.
* `recipes/math_rl/train.py`: its CLI (`chz.entrypoint(CLIConfig, argv)` + `cli_main`), the
  arithmetic environment (its default), a local model path and its renderer.
* DPO: `tinker_cookbook.preference.train_dpo.main` on a local JSONL comparisons file
  (`ComparisonBuilderFromJsonl`, with a test file) and evaluators every step (`eval_every=1`: a
  sampler NLL evaluator from `evaluator_builders` and the test set's, on a sampler the recipe
  saves every step).

The RL recipes learn only where rewards differ inside a group, which a random model never gives,
so the base model is pre-trained here (plain torch, no floe) to answer their prompts with
`\\boxed{1}` or `\\boxed{2}` (rl_loop's reward: the answer is 1), each either ending at once with
the stop sequence or padded past max_tokens (math_rl's format reward).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from floe.models import make_tiny

pytestmark = pytest.mark.tinker

HUB_NAME = "Qwen/Qwen3.5-9B-Base"  # rl_loop.py's default model
QUESTION_SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."  # rl_loop.py's
STRAWBERRY = [  # rl_loop.py's convo_prefix
    {"role": "user", "content": "How many r's are in strawberry?" + QUESTION_SUFFIX},
    {"role": "assistant", "content": "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a "
                                     "5) w 6) b 7) e 8) r 9) r 10) y. We have r's at positions 3, 8, and 9. \\boxed{3}"},
]
PAD = "~" * 8
MAX_TOKENS = 20  # " \boxed{d}" + "\n\nUser:" is 17 tokens (stops); with PAD, 25 (cut at 20)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _questions(n: int) -> list[str]:
    return [f"Tom has {i} apples and eats {i} of them, then finds one. How many apples does he have?" for i in range(n)]


@pytest.fixture(scope="module")
def answering_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model at <tmp>/models/Qwen/Qwen3.5-9B-Base, pre-trained to answer rl_loop's and
    math_rl's rendered prompts with " \\boxed{d}" (d = 1 or 2) then the stop sequence, or PAD
    first (half of the time each, independently)."""
    from tinker_cookbook import renderers  # noqa: PLC0415
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticEnv  # noqa: PLC0415
    from tinker_cookbook.tokenizer_utils import get_tokenizer  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    path = make_tiny(tmp_path_factory.mktemp("models") / "Qwen" / "Qwen3.5-9B-Base", hidden_size=32,
                     intermediate_size=64, num_hidden_layers=2)
    tokenizer = get_tokenizer(str(path))
    renderer = renderers.get_renderer("role_colon", tokenizer)
    prompts = [renderer.build_generation_prompt([*STRAWBERRY, {"role": "user", "content": q + QUESTION_SUFFIX}]).to_ints()
               for q in _questions(8)]
    prompts += [renderer.build_generation_prompt([*ArithmeticEnv.standard_fewshot_prefix(),
                                                  {"role": "user", "content": f"What is {x} + {y}?"}]).to_ints()
                for x, y in ((3, 71), (40, 2), (15, 15), (99, 0), (7, 58), (23, 64))]
    model = AutoModelForCausalLM.from_pretrained(str(path))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rng = random.Random(0)
    for _ in range(60):
        rows = [(prompt, tokenizer.encode(" \\boxed{" + rng.choice("12") + "}" + rng.choice(["", PAD]) + "\n\nUser:",
                                          add_special_tokens=False)) for prompt in rng.sample(prompts, 4)]
        width = max(len(p) + len(a) for p, a in rows)
        ids = torch.tensor([p + a + [0] * (width - len(p) - len(a)) for p, a in rows])  # right padding: causal
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)
        loss = -sum(logp[r, len(p) - 1:len(p) + len(a) - 1].gather(1, torch.tensor(a)[:, None]).mean()
                    for r, (p, a) in enumerate(rows))
        optimizer.zero_grad()
        (loss / len(rows)).backward()
        optimizer.step()
    model.save_pretrained(str(path))
    return path


def _sampler_adapter(server, sampler_path: str) -> dict[str, torch.Tensor]:
    run, kind, name = sampler_path.removeprefix("tinker://").split("/")
    return load_file(str(server.state_dir / ".tinker" / "runs" / run / kind / name / "adapter_model.safetensors"))


def _preference(server, model_path: str | None, base_model: str, heads: list[list[int]], good: int, bad: int) -> float:
    """Mean over `heads` of log p(good) − log p(bad) after the head, under a sampler of the
    server (from `model_path`; None: the base model)."""
    import tinker  # noqa: PLC0415
    from tinker import types  # noqa: PLC0415

    with tinker.ServiceClient(base_url=server.url) as service:  # its session finished on the way out
        sampler = (service.create_sampling_client(model_path=model_path) if model_path
                   else service.create_sampling_client(base_model=base_model)).result()
        gaps = []
        for head in heads:
            one, two = (sampler.compute_logprobs(types.ModelInput.from_ints([*head, t])).result()[-1]
                        for t in (good, bad))
            gaps.append(one - two)
    return sum(gaps) / len(gaps)


def test_rl_loop_trains_with_its_default_stable_reinforce(answering_model: Path, tinker_server, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets  # noqa: PLC0415
    from tinker_cookbook import renderers  # noqa: PLC0415
    from tinker_cookbook.recipes import rl_loop  # noqa: PLC0415
    from tinker_cookbook.tokenizer_utils import get_tokenizer  # noqa: PLC0415

    monkeypatch.chdir(answering_model.parent.parent)  # HUB_NAME is this directory's Qwen/Qwen3.5-9B-Base
    questions = _questions(6)
    rows = datasets.DatasetDict({"train": datasets.Dataset.from_dict(
        {"question": questions, "answer": [f"{q} He has 1 apple.\n#### 1" for q in questions]})})
    real_load = datasets.load_dataset

    def load_dataset(path, *args, **kwargs):
        if (path, *args) == ("openai/gsm8k", "main"):
            return rows
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)  # the recipe's one hub download
    server = tinker_server(f'served_model_name = "{HUB_NAME}"', model=answering_model)
    log = tmp_path / "rl_loop"
    config = rl_loop.Config(base_url=server.url, log_path=str(log), model_name=HUB_NAME, batch_size=2, group_size=4,
                            max_tokens=MAX_TOKENS, max_steps=3)
    assert config.loss_fn == "stable_reinforce"
    rl_loop.main(config)

    metrics = _rows(log / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [0, 1, 2]
    trained = [r for r in metrics if "grad_norm:mean" in r]
    assert trained, metrics  # at least one step had a group with different rewards
    assert all(math.isfinite(r["grad_norm:mean"]) and r["grad_norm:mean"] > 0 for r in trained)
    assert all(0 <= r["reward/total"] <= 1 for r in metrics)
    final = _rows(log / "checkpoints.jsonl")[-1]
    assert final["name"] == "final" and final["sampler_path"]
    adapter = _sampler_adapter(server, final["sampler_path"])
    assert any(float(t.abs().max()) > 0 for k, t in adapter.items() if "lora_B" in k)  # the weights moved
    # The reward is for \boxed{1}: stable_reinforce raised its log-prob against \boxed{2}.
    tokenizer = get_tokenizer(HUB_NAME)
    renderer = renderers.get_renderer("role_colon", tokenizer)
    boxed = tokenizer.encode(" \\boxed{", add_special_tokens=False)
    heads = [renderer.build_generation_prompt([*STRAWBERRY, {"role": "user", "content": q + QUESTION_SUFFIX}]).to_ints()
             + boxed for q in questions]
    one, two = (tokenizer.encode(d, add_special_tokens=False)[0] for d in "12")
    before = _preference(server, None, HUB_NAME, heads, one, two)
    after = _preference(server, final["sampler_path"], HUB_NAME, heads, one, two)
    assert after > before, (before, after)


def test_math_rl_cli_trains_with_its_default_stable_reinforce(answering_model: Path, tinker_server,
                                                              tmp_path: Path) -> None:
    import chz  # noqa: PLC0415
    from tinker_cookbook import renderers  # noqa: PLC0415
    from tinker_cookbook.recipes.math_rl import train  # noqa: PLC0415
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticEnv  # noqa: PLC0415
    from tinker_cookbook.tokenizer_utils import get_tokenizer  # noqa: PLC0415

    server = tinker_server(model=answering_model)
    log = tmp_path / "math_rl"
    cli = chz.entrypoint(train.CLIConfig, argv=[
        f"model_name={answering_model}", "renderer_name=role_colon", f"base_url={server.url}", f"log_path={log}",
        "groups_per_batch=2", "group_size=4", f"max_tokens={MAX_TOKENS}", "max_steps=3",
    ])
    assert (cli.loss_fn, cli.env) == ("stable_reinforce", "arithmetic")
    asyncio.run(train.cli_main(cli))

    metrics = _rows(log / "metrics.jsonl")
    assert sorted({r["step"] for r in metrics}) == [0, 1, 2, 3]  # 3: rl/train.py's final row
    for row in metrics:
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row
    trained = [r for r in metrics if "grad_norm:mean" in r]
    assert len(trained) == 3 and all(r["grad_norm:mean"] > 0 for r in trained), metrics
    # The trainer's log-probs of the sampled tokens agree with the sampler's (what its KL compares).
    assert all(abs(r["optim/kl_sample_train_v1"]) < 1e-3 for r in trained), trained
    final = _rows(log / "checkpoints.jsonl")[-1]
    adapter = _sampler_adapter(server, final["sampler_path"])
    assert any(float(t.abs().max()) > 0 for k, t in adapter.items() if "lora_B" in k)  # the weights moved
    # The format reward is for stopping (the stop sequence within max_tokens): stable_reinforce
    # raised the log-prob of ending the answer ("\n") against padding it ("~").
    tokenizer = get_tokenizer(str(answering_model))
    renderer = renderers.get_renderer("role_colon", tokenizer)
    heads = [renderer.build_generation_prompt([*ArithmeticEnv.standard_fewshot_prefix(),
                                               {"role": "user", "content": f"What is {x} + {y}?"}]).to_ints()
             + tokenizer.encode(f" \\boxed{{{d}}}", add_special_tokens=False)
             for x, y, d in ((12, 30, 1), (5, 77, 2), (64, 8, 1), (90, 9, 2))]
    newline, pad = (tokenizer.encode(c, add_special_tokens=False)[0] for c in ("\n", PAD[0]))
    before = _preference(server, None, str(answering_model), heads, newline, pad)
    after = _preference(server, final["sampler_path"], str(answering_model), heads, newline, pad)
    assert after > before, (before, after)


def test_dpo_with_an_evaluator_every_step(tinker_model: Path, tinker_server, tmp_path: Path) -> None:
    import chz  # noqa: PLC0415
    from tinker_cookbook.preference import train_dpo  # noqa: PLC0415
    from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons  # noqa: PLC0415
    from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl  # noqa: PLC0415
    from tinker_cookbook.supervised.nll_evaluator import SamplerNLLEvaluator  # noqa: PLC0415
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig  # noqa: PLC0415

    def comparison(prompt: str, good: str, bad: str, label: str) -> str:
        a, b = (good, bad) if label == "A" else (bad, good)
        return json.dumps({"comparison": {"prompt_conversation": [{"role": "user", "content": prompt}],
                                          "completion_A": [{"role": "assistant", "content": a}],
                                          "completion_B": [{"role": "assistant", "content": b}]}, "label": label})

    words = ("apple", "pear", "plum", "fig")
    train_file, test_file = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train_file.write_text("".join(comparison(f"say {w}", f"{w} {w}", "no.", "AB"[i % 2]) + "\n"
                                  for i, w in enumerate(words)))
    test_file.write_text(comparison("say kiwi", "kiwi kiwi", "no.", "A") + "\n")
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=str(tinker_model), renderer_name="role_colon",
                                            max_length=128, batch_size=len(words))
    dataset = DPODatasetBuilderFromComparisons(common_config=common, comparison_builder=ComparisonBuilderFromJsonl(
        train_path=str(train_file), test_path=str(test_file)))
    held_out_file = tmp_path / "held_out.jsonl"
    held_out_file.write_text(comparison("say lime", "lime lime", "no.", "B") + "\n")
    held_out, _ = DPODatasetBuilderFromComparisons(
        common_config=chz.replace(common, batch_size=1),
        comparison_builder=ComparisonBuilderFromJsonl(train_path=str(held_out_file)))()

    server = tinker_server()
    log = tmp_path / "dpo"
    config = train_dpo.Config(
        log_path=str(log), model_name=str(tinker_model), recipe_name="floe_dpo", renderer_name="role_colon",
        dataset_builder=dataset, base_url=server.url, num_epochs=3, eval_every=1, save_every=0,
        evaluator_builders=[lambda: SamplerNLLEvaluator.from_dataset(held_out, name="held_out")],
    )
    train_dpo.main(config)

    metrics = _rows(log / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [0, 1, 2]
    for row in metrics:  # both evaluators ran at every step, and every number is finite
        assert {"test/nll", "held_out/nll", "dpo_loss"} <= row.keys(), row.keys()
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row
    losses = [r["dpo_loss"] for r in metrics]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-4)  # the policy starts as its reference
    assert losses[-1] < losses[0] and metrics[-1]["margin"] > 0, losses  # chosen answers gained on rejected
    assert _rows(log / "checkpoints.jsonl")[-1]["name"] == "final"
