"""verl's fully-async trainer on floe: verl's own entrypoint
(`python -m verl.experimental.fully_async_policy.fully_async_main`, its fully_async_ppo_trainer.yaml)
with the keys of its stock DAPO example (stock_recipes.FULLY_ASYNC) through the one-key switch, on
the tiny model on this CPU machine: three weights versions of 32 prompts (require_batches 4 ×
mini-batch 2 × trigger_parameter_sync_step 4), 12 training steps. The rollouter generates while
the trainer trains; partial rollouts are on (the recipe's), so a sync interrupts running responses,
which resume on the new weights. Each sample's floe weights versions give its staleness, logged by
verl per sync cycle (`floe/staleness/*`) and per sample (floe_samples.jsonl). The run checkpoints
(verl's save_freq, here every 2 versions and at the end); a second run with the recipe's
`resume_mode=auto` in the same directory resumes from the last one and trains a fourth version.
Runs in verl's environment (scripts/ci/verl.sh)."""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from pathlib import Path

import pytest

from tests.integrations.stock import key_name
from tests.integrations.verl.assets import make_data, make_model
from tests.integrations.verl.run import VLLM_RECIPE_SWITCH, Run, grpo_recipe, run_main_ppo
from tests.integrations.verl.stock_recipes import FULLY_ASYNC, FULLY_ASYNC_NOT_IN_VERL_091, cpu_sized
from tests.integrations.verl.test_one_step import composed, verl_root

pytestmark = [pytest.mark.verl, pytest.mark.timeout(1200)]

ENTRYPOINT = "verl.experimental.fully_async_policy.fully_async_main"
PROMPTS_PER_VERSION = 2 * 4 * 4  # ppo_mini_batch_size (cpu_sized) × require_batches × trigger_parameter_sync_step
VERSIONS = 3
STEP_LINE = re.compile(r"\bstep:(\d+) - ")  # verl's console logger; the fully-async trainer logs per sync cycle
OVERRIDE = "+actor_rollout_ref.model.override_config.max_position_embeddings=32768"
# The recipe's FSDP group size (2 of its 4 training GPUs), a parallelism key like the ones cpu_sized
# replaces: floe shards the policy over every device of the run (refused otherwise, hardware.py).
CPU_PARALLELISM = {"actor_rollout_ref.actor.fsdp_config.fsdp_size": "-1"}


SAVE_FREQ = 2  # versions; verl also saves at the end of a run (save_freq > 0)


def on_cpu(out: Path, assets: dict[str, Path], versions: int = VERSIONS,
           override: dict[str, str] | None = None) -> list[str]:
    """The stock recipe, `cpu_sized`, with the fully-async trainer's own sizes for this machine,
    for a run of `versions` weights versions in all (a resumed run counts the ones before it);
    `override` (key -> value) replaces more of its keys."""
    args = cpu_sized(FULLY_ASYNC, grpo_recipe(assets["model"], assets["train"], assets["test"], out))
    sizes = {
        # the recipe's own 0 (verl's rollouter asserts it: one prompt at a time), where the base's 4 won
        "data.train_batch_size": "0",
        # a path, and the run's size in prompts (len(data) bounds it too)
        "trainer.default_local_dir": str(out / "checkpoints"),
        "rollout.total_rollout_steps": str(PROMPTS_PER_VERSION * versions),
        # the recipe's -1 saves nothing; the resume test needs checkpoints
        "trainer.save_freq": str(SAVE_FREQ),
        # the recipe's rollout.test_freq=10 (verl 0.9.1 names it trainer.test_freq), scaled to the run:
        # the rollouter validates on floe's sampler at version 3; the resumed run ends at 4, which 3
        # does not divide, so verl syncs version 4 once more at its end (the sync manager's no-op)
        "trainer.test_freq": str(VERSIONS),
        # Generation the long pole, as the recipe's 8k-token responses make it on its GPUs: one rollout
        # server taking 2 prompts at a time (the rollout pool's size and its per-replica concurrency;
        # at the recipe's 16 a replica starts a cycle's whole budget at once, which the tiny model
        # finishes before the trainer needs it), so generation is still running at each sync, and
        # the 16-token responses sampled 2 tokens per floe call: a sync interrupts them (partial rollouts)
        "rollout.n_gpus_per_node": "1", "async_training.concurrent_samples_per_replica": "2",
        "floe.rollout_chunk_tokens": "2",
        **CPU_PARALLELISM,
        **(override or {}),
    }
    # The recipe's model override: floe refuses it (floe loads the model's own config.json, as
    # the script's comment asks the user to edit; test_fully_async_keys... checks the refusal).
    args = [k for k in args if key_name(k) not in sizes and k != OVERRIDE]
    return args + [f"{'+' if name.startswith('floe.') else ''}{name}={value}" for name, value in sizes.items()]


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory, shared_ray: str) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("verl-fully-async")
    train, test = make_data(root / "data", train_rows=PROMPTS_PER_VERSION * (VERSIONS + 1))  # + the resumed run's
    return {"root": root, "model": make_model(root / "tiny"), "train": train, "test": test}


def read_samples(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_fully_async(out: Path, assets: dict[str, Path], log: str, versions: int = VERSIONS,
                    override: dict[str, str] | None = None) -> Run:
    """The stock recipe on this CPU (`on_cpu`), run to its end (exit 0 asserted)."""
    run = run_main_ppo(on_cpu(out, assets, versions, override), assets["root"] / log, timeout_s=1000,
                       switch=VLLM_RECIPE_SWITCH, entrypoint=ENTRYPOINT, cwd=verl_root())
    print(f"verl {FULLY_ASYNC.source} on floe ({log}): exit {run.returncode}, {run.seconds:.0f} s")
    assert run.returncode == 0, run.log[-6000:]
    return run


@pytest.fixture(scope="module")
def first_run(assets: dict[str, Path]) -> Run:
    return run_fully_async(assets["root"] / "run", assets, "fully_async.log")


def test_verls_fully_async_trainer_runs_on_floe_with_partial_rollouts_and_staleness_per_sample(assets, first_run):
    out, run = assets["root"] / "run", first_run
    assert "floe backend at http://127.0.0.1" in run.log, run.log[-3000:]
    # verl logs per sync cycle, at the new param version: 1, 2, 3 in order (0: the first sync's timing)
    logged = [int(m.group(1)) for m in map(STEP_LINE.search, run.log.splitlines()) if m]
    cycles = [s for i, s in enumerate(logged) if s > 0 and (i == 0 or s != logged[i - 1])]
    assert cycles == list(range(1, VERSIONS + 1)), logged
    samples = read_samples(out / "checkpoints" / "floe_samples.jsonl")
    by_step: dict[int, list[dict]] = defaultdict(list)
    for r in samples:
        by_step[r["step"]].append(r)
    steps = VERSIONS * 4
    assert sorted(by_step) == list(range(1, steps + 1))  # trainer steps 1..12, in order
    assert all(len(rows) == 2 * 4 * 2 for rows in by_step.values())  # mini-batch 2 × require_batches 4 × n 2
    assert [r["step"] for r in samples] == sorted(r["step"] for r in samples)
    for r in samples:
        assert r["staleness"] == r["policy_version"] - r["weights_version"] >= 0, r
        assert r["weights_version"] <= r["newest_weights_version"] <= r["policy_version"], r
        assert r["staleness"] <= math.ceil(0.1), r  # the recipe's staleness_threshold, in versions
        assert r["policy_version"] == samples[0]["policy_version"] + r["param_version"], r  # one sync per cycle
    # the policy version rises by one per sync cycle (4 steps)
    assert [by_step[s][0]["policy_version"] for s in range(1, steps + 1)] == [
        samples[0]["policy_version"] + (s - 1) // 4 for s in range(1, steps + 1)]
    # partial rollouts: at least one response spans two weights versions (interrupted, resumed)
    spanning = [r for r in samples if r["newest_weights_version"] > r["weights_version"]]
    assert spanning, "no response spanned a sync"
    # such a response counts from the oldest version of its tokens: started before the policy's sync
    assert all(r["staleness"] == r["policy_version"] - r["weights_version"] >= 1 for r in spanning), spanning
    print(f"staleness: {sum(r['staleness'] for r in samples) / len(samples):.3f} mean, "
          f"{max(r['staleness'] for r in samples)} max over {len(samples)} samples; "
          f"{len(spanning)} responses span two versions")
    # verl's validation (its rollouter's _validate on floe's rollout servers) at version 3 only
    validated = sorted(s for s, m in run.steps.items() if any(k.startswith("val-core/") for k in m))
    assert validated == [VERSIONS], {s: sorted(m)[:8] for s, m in run.steps.items()}
    for cycle in range(1, VERSIONS + 1):
        m = run.steps[cycle]
        assert math.isfinite(m["actor/grad_norm"]) and m["actor/grad_norm"] > 0, (cycle, m)
        assert "critic/score/mean" in m and "critic/rewards/mean" in m, (cycle, m)  # verl's reward metrics
        rows = [r for r in samples if r["param_version"] == cycle - 1]
        stalenesses = [r["staleness"] for r in rows]
        # verl's aggregated floe keys are the cycle's per-sample values' statistics
        assert m["floe/staleness/max"] == max(stalenesses) and m["floe/staleness/min"] == min(stalenesses), (cycle, m)
        assert m["floe/staleness/mean"] == pytest.approx(sum(stalenesses) / len(stalenesses)), (cycle, m)
        assert m["floe/staleness/violation_count"] == 0
        spans = sum(r["newest_weights_version"] > r["weights_version"] for r in rows)
        assert m["floe/partial/spanning_samples"] == spans, (cycle, m)
        assert m["fully_async/partial/total_partial_num"] == spans, (cycle, m)  # verl's own count of them
        assert m["floe/policy_version"] == rows[0]["policy_version"]
        assert m["fully_async/count/current_param_version"] == cycle - 1  # verl's own count, at the cycle's steps


def marker_of(out: Path, version: int) -> dict:
    return json.loads((out / "checkpoints" / f"global_step_{version}" / "actor" / "floe_state.json").read_text())


def test_a_second_run_resumes_from_the_last_checkpoint(assets, first_run):
    """The recipe's resume_mode=auto: verl's trainer finds global_step_3 (the first run's end) and
    loads its floe state, verl's rollouter its dataloader position; the run trains version 4 only,
    from the saved weights and optimizer state, and saves it. (Its end re-syncs version 4 before
    verl's final validation check: without the sync manager's no-op the run fails there.)"""
    out = assets["root"] / "run"
    assert sorted(p.name for p in (out / "checkpoints").glob("global_step_*")) == ["global_step_2", "global_step_3"]
    saved = marker_of(out, VERSIONS)
    assert saved["state"] == f"verl_step_{VERSIONS}" and saved["step"] > 0
    before = len(read_samples(out / "checkpoints" / "floe_samples.jsonl"))
    run = run_fully_async(out, assets, "fully_async_resumed.log", versions=VERSIONS + 1)
    assert f"Resuming from  {out / 'checkpoints' / f'global_step_{VERSIONS}'}" in run.log, run.log[-3000:]
    logged = [int(m.group(1)) for m in map(STEP_LINE.search, run.log.splitlines()) if m]
    # the first line is the resumed version's initial sync (as 0 in a fresh run), then one more cycle, numbered on
    assert logged[0] == VERSIONS and set(logged[1:]) == {VERSIONS + 1}, logged
    resumed = marker_of(out, VERSIONS + 1)
    # floe's optimizer continued from the loaded state: its step count goes on from the checkpoint's
    assert resumed["step"] == saved["step"] * (VERSIONS + 1) // VERSIONS, (saved, resumed)
    new = read_samples(out / "checkpoints" / "floe_samples.jsonl")[before:]
    assert len(new) == 4 * 2 * 4 * 2 and {r["param_version"] for r in new} == {VERSIONS}  # 4 steps of 16 samples
    # verl's step numbers go on past the first run's 12 (verl 0.9.1 resumes at 13 and counts its first step 14)
    steps = sorted({r["step"] for r in new})
    assert steps == list(range(steps[0], steps[0] + 4)) and steps[0] > VERSIONS * 4, steps
    # verl's rollouter took up its dataloader where the checkpoint left it (the prompts after the first run's)
    assert f"Loaded dataloader state from {out / 'checkpoints' / f'global_step_{VERSIONS}' / 'data.pt'}" in run.log
    for r in new:
        assert r["staleness"] == r["policy_version"] - r["weights_version"] >= 0, r


def test_without_partial_rollouts_no_response_spans_a_sync(assets):
    """`async_training.partial_rollout=False`: each response is one floe `sample` call, which a sync
    lets finish on the weights it started with; two versions of the stock recipe otherwise."""
    out = assets["root"] / "whole"
    run_fully_async(out, assets, "fully_async_whole.log", versions=2, override={"async_training.partial_rollout": "False"})
    samples = read_samples(out / "checkpoints" / "floe_samples.jsonl")
    assert len(samples) == 2 * 4 * 2 * 4 * 2  # 2 cycles of 4 steps of 16 samples
    assert all(r["newest_weights_version"] == r["weights_version"] for r in samples), "a response spans a sync"
    for r in samples:
        assert 0 <= r["staleness"] == r["policy_version"] - r["weights_version"] <= math.ceil(0.1), r


def composed_fully_async(overrides: list[str], monkeypatch: pytest.MonkeyPatch) -> dict:
    """verl's fully-async config (fully_async_ppo_trainer.yaml over ppo_trainer.yaml) with `overrides`."""
    return composed("fully_async_policy", "fully_async_ppo_trainer", overrides, monkeypatch)


# The stock keys but its paths (the script's shell expands them) and its model override, on the CPU.
STOCK = [k for k in FULLY_ASYNC.keys if "~" not in k and k != OVERRIDE]
ON_CPU = ["+floe.backend.device=cpu", *(f"{k}={v}" for k, v in CPU_PARALLELISM.items())]


def test_the_stock_scripts_keys_verl_091_lacks_are_refused_by_verl_itself(monkeypatch):
    from hydra.errors import ConfigCompositionException  # noqa: PLC0415

    composed_fully_async(STOCK, monkeypatch)
    for key in FULLY_ASYNC_NOT_IN_VERL_091:
        with pytest.raises(ConfigCompositionException, match="Could not override"):
            composed_fully_async([*STOCK, key], monkeypatch)


@pytest.mark.parametrize(("override", "field"), [
    ("async_training.use_trainer_do_validate=True", "async_training.use_trainer_do_validate"),
    ("async_training.use_dynamic_resource_scheduling=True", "async_training.use_dynamic_resource_scheduling"),
    ("algorithm.rollout_correction.bypass_mode=False", "algorithm.rollout_correction.bypass_mode"),
    ("distillation.enabled=True", "distillation.enabled"),
    ("++actor_rollout_ref.rollout.checkpoint_manager_class=my.Manager", "actor_rollout_ref.rollout.checkpoint_manager_class"),
    (None, "rollout.n_gpus_per_node"),  # the stock recipe as on its GPU box (no device key): a separate rollout pool
])
def test_fully_async_keys_floe_cannot_honour_are_refused_by_name(monkeypatch, override, field):
    import floe  # noqa: PLC0415
    from floe.integrations.verl.fully_async import check_fully_async  # noqa: PLC0415 - verl's environment

    check_fully_async(composed_fully_async([*STOCK, *ON_CPU], monkeypatch))  # the stock recipe on the CPU passes
    # None: the stock recipe on its GPU box (its fsdp_size aside, refused first and by its own name)
    cfg = composed_fully_async([*STOCK, *ON_CPU, override] if override else [*STOCK, *ON_CPU[1:]], monkeypatch)
    with pytest.raises(floe.InvalidInput) as info:
        check_fully_async(cfg)
    assert info.value.field == field


def test_the_recipes_model_config_override_is_refused_by_name(monkeypatch):
    """verl's `model.override_config` changes the config only its FSDP workers load; floe's backend
    loads config.json. Refused (start_session's first checks, before any backend starts)."""
    from omegaconf import OmegaConf  # noqa: PLC0415

    import floe  # noqa: PLC0415
    from floe.integrations.verl.plugin import start_session  # noqa: PLC0415

    cfg = OmegaConf.create(composed_fully_async([*STOCK, *ON_CPU, OVERRIDE], monkeypatch))
    with pytest.raises(floe.InvalidInput) as info:
        start_session(cfg, use_critic=False)
    assert info.value.field == "actor_rollout_ref.model.override_config.max_position_embeddings"


def test_an_aborted_response_returns_its_tokens_and_resumes_on_the_new_weights(tmp_path, shared_ray):
    """The partial-rollout contract of floe's rollout server, on a real `floe serve` and Ray actor:
    an abort returns a running response's tokens so far (with their log-probs and version) and
    parks new requests; after a training step and a sync, the resume (prompt + those tokens, as
    verl's FullyAsyncLLMServerClient sends it) is sampled by the new weights."""
    import time  # noqa: PLC0415

    import ray  # noqa: PLC0415

    import floe  # noqa: PLC0415
    from floe.integrations.verl.local_server import LocalServer  # noqa: PLC0415 - verl's environment
    from floe.integrations.verl.plugin import FloeRolloutServer  # noqa: PLC0415

    server = LocalServer({"model": str(make_model(tmp_path / "tiny")), "device": "cpu",
                          "state_dir": str(tmp_path / "state"), "optimizer": {"lr": 0.05}})
    ray.init(address=shared_ray)
    try:
        client = floe.connect(server.url, token=server.token)
        offset = client.info().sampler_version
        rollout = FloeRolloutServer.options(max_concurrency=8, num_cpus=0).remote(  # type: ignore[attr-defined]
            server.url, server.token, 120, 48, 64, None, 1)  # 48-token responses, one token per floe call
        ray.get(rollout.set_version_offset.remote(offset))
        prompt, budget = [5, 6, 7, 8, 9], 48
        params = {"temperature": 1.0, "max_tokens": budget, "ignore_eos": True}
        running = rollout.generate.remote(prompt, params, "r1")
        while ray.get(rollout.counts.remote())["sample"] < 4:  # a few tokens in
            time.sleep(0.02)
        ray.get(rollout.abort_all_requests.remote())
        first = ray.get(running, timeout=30)  # abort_all_requests returned: the request has too
        assert first.stop_reason == "aborted" and 4 <= len(first.token_ids) < budget, first
        assert len(first.log_probs) == len(first.token_ids) and first.extra_fields["global_steps"] == 0
        parked = rollout.generate.remote(prompt, {**params, "max_tokens": 2}, "r2")
        assert not ray.wait([parked], timeout=1.0)[0], "a request between abort and resume ran"
        # one training step changes the weights; sync them (version offset + 1)
        client.forward_backward(floe.Batch([floe.Group(prompt, [floe.Sample(first.token_ids)])]), "cross_entropy")
        client.optim_step()
        assert client.sync_weights(version=offset + 1).version == offset + 1
        ray.get(rollout.resume_generation.remote())
        assert ray.get(parked, timeout=60).extra_fields["global_steps"] == 1
        rest = ray.get(rollout.generate.remote(prompt + first.token_ids,
                                               {**params, "max_tokens": budget - len(first.token_ids)}, "r1"), timeout=120)
        assert rest.stop_reason == "completed" and len(first.token_ids) + len(rest.token_ids) == budget
        assert rest.extra_fields["global_steps"] == 1
        # the resumed tokens' log-probs are the new weights', the aborted ones' are not
        tokens = first.token_ids + rest.token_ids
        now = client.forward(floe.Batch([floe.Group(prompt, [floe.Sample(tokens)])]), temperature=1.0).logprobs[0][0]
        k = len(first.token_ids)
        assert now[k:] == pytest.approx(rest.log_probs, abs=1e-4)
        assert max(abs(a - b) for a, b in zip(now[:k], first.log_probs)) > 1e-3
    finally:
        ray.shutdown()
        server.stop()
    assert not server.log_path.parent.exists()  # its serve.toml and log go with it (it stopped cleanly)


def test_a_resync_of_the_last_step_is_a_no_op_and_new_weights_need_a_new_step(tmp_path, shared_ray):
    """verl's fully-async trainer syncs its last version once more before a final validation
    (when test_freq does not divide it): the same verl step, unchanged weights. floe's versions
    only move forward, so the sync manager skips it; weights trained since then under the same
    step number are refused. A real `floe serve` (no replicas: the offset alone is set)."""
    import ray  # noqa: PLC0415

    import floe  # noqa: PLC0415
    from floe.integrations.verl.local_server import LocalServer  # noqa: PLC0415 - verl's environment
    from floe.integrations.verl.plugin import FloeWeightSync  # noqa: PLC0415

    server = LocalServer({"model": str(make_model(tmp_path / "tiny")), "device": "cpu",
                          "state_dir": str(tmp_path / "state"), "optimizer": {"lr": 0.05}})
    ray.init(address=shared_ray)
    try:
        client = floe.connect(server.url, token=server.token)
        sync = FloeWeightSync(client, [])

        def train() -> None:
            client.forward_backward(floe.Batch([floe.Group([5, 6, 7], [floe.Sample([8, 9])])]), "cross_entropy")
            client.optim_step()

        train()
        sync.update_weights(3)  # a resumed run's first sync: verl's step 3
        first = client.info().sampler_version
        assert sync.version == first and sync.calls == 1
        sync.update_weights(3)  # the re-sync before a final validation
        assert client.info().sampler_version == first and sync.calls == 1
        train()
        with pytest.raises(floe.StateError, match="stepped since"):
            sync.update_weights(3)
        assert client.info().sampler_version == first  # nothing synced
        sync.update_weights(4)
        assert client.info().sampler_version == sync.version == first + 1 and sync.calls == 2
    finally:
        ray.shutdown()
        server.stop()
