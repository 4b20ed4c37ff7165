"""Memory of the Tinker service with the real tinker 0.38 SDK against `floe serve` (issue 19,
items 9, 11, 12): samplers live as long as their run (no cap on snapshots, `load_state` keeps
them); a server bounded to one live run, two live samplers and one live base model (two base
models of different shapes) gives exactly the values of a server that keeps everything in
memory, while its memory stays within the bounds; long operations wait without SDK warnings.

Two servers share the module: "bounded" and "roomy", the same config but the `tinker_max_live_*`
bounds. Memory is read from each server's Prometheus gauge `floe_tinker_in_memory`, whose
`adapters` and `base_models` come from the base models' managers (what really is in memory).
"""

from __future__ import annotations

import logging
import re
import signal
from pathlib import Path

import httpx
import pytest
import torch

from floe.models import make_tiny
from tests.tinker.conftest import API_KEY, start_tinker_server

pytestmark = pytest.mark.tinker

ALIAS = "tiny-alias"
BOUNDS = {"runs": 1, "samplers": 2, "bases": 1, "base_models": 1, "adapters": 3}  # adapters: 1 run + 2 samplers
DATA = {"a": [[5, 9, 14, 20, 7, 33, 12], [40, 41, 42, 8, 9]], "b": [[3, 17, 25, 26, 27, 28], [11, 12, 13]],
        "c": [[60, 61, 62, 63, 64], [21, 22, 23, 24, 25, 26, 27]]}
PROBE = [5, 9, 14, 20, 7, 33, 12, 40]
STEPS = 3
SNAPSHOTS_OF_A = 3  # per step: 9 snapshots of one run (the old cap was 8)


@pytest.fixture(scope="module")
def second_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tinker-second") / "b" / "wide", hidden_size=48, intermediate_size=96,
                     num_hidden_layers=3, seed=1)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, tinker_model: Path, second_model: Path):
    common = (f'tinker_base_models = ["{second_model}"]\nserved_model_name = "{ALIAS}"\n'
              "tinker_long_poll_s = 0.1\n")
    bounded_toml = common + "".join(f"tinker_max_live_{k} = {BOUNDS[k]}\n" for k in ("runs", "samplers", "bases"))
    root = tmp_path_factory.mktemp("residency")
    procs = {"bounded": start_tinker_server(root / "bounded", tinker_model, bounded_toml, wait=False),
             "roomy": start_tinker_server(root / "roomy", tinker_model, common, wait=False)}
    try:
        for proc in procs.values():
            proc.wait_ready()
        yield procs
    finally:
        for proc in procs.values():
            proc.stop(signal.SIGKILL)


def _memory(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.finditer(r'^floe_tinker_in_memory\{what="(\w+)"\} (\S+)$', text, re.MULTILINE)
    return {m[1]: float(m[2]) for m in found}


class _Watch:
    """The largest value of each memory gauge seen between operations."""

    def __init__(self, url: str):
        self.url = url
        self.peak: dict[str, float] = {}

    def __call__(self) -> dict[str, float]:
        now = _memory(self.url)
        for key, value in now.items():
            self.peak[key] = max(self.peak.get(key, 0.0), value)
        return now


def _datums(types, seqs):
    return [types.Datum(model_input=types.ModelInput.from_ints(s[:-1]),
                        loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)}) for s in seqs]


def _use(sampler, seed: int) -> tuple:
    """What a sampler gives: sampled tokens and log-probs, and the log-probs of PROBE."""
    from tinker import types  # noqa: PLC0415

    out = sampler.sample(types.ModelInput.from_ints(PROBE[:3]), num_samples=2,
                         sampling_params=types.SamplingParams(max_tokens=4, seed=seed)).result()
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(PROBE)).result()
    return tuple((tuple(s.tokens), tuple(s.logprobs)) for s in out.sequences), tuple(scored[1:])


def _scenario(url: str, state_dir: Path, models: dict[str, str], watch: _Watch) -> dict:
    """Three runs (a, b on the first base model, a by its alias; c on the second) trained in
    turn, a snapshot sampler after every step (several of run a), each sampler used when made
    and again at the end after `load_state` moved run a back to its step-2 checkpoint."""
    import tinker  # noqa: PLC0415
    from tinker import types  # noqa: PLC0415

    service = tinker.ServiceClient(base_url=url, api_key=API_KEY)
    out: dict = {"losses": {k: [] for k in DATA}, "first": {}, "then": {}, "names": {}}
    runs = {name: service.create_lora_training_client(base_model=models[name], rank=4, seed=seed).result()
            for seed, name in enumerate(DATA, start=1)}
    watch()
    for name, run in runs.items():
        out["names"][name] = (run.get_info().model_name, run.get_tokenizer().name_or_path)
        untrained = run.save_weights_and_get_sampling_client().result()
        out["names"][name] += (untrained.get_base_model(),)
        out["untrained", name] = _use(untrained, 0)
    samplers: list[tuple[str, object]] = []
    for step in range(STEPS):
        for name, run in runs.items():  # in turn: each run's request finds the others offloaded
            fb = run.forward_backward(_datums(types, DATA[name]), "cross_entropy")
            opt = run.optim_step(types.AdamParams(learning_rate=2e-2))
            out["losses"][name].append(fb.result().metrics["loss:sum"])
            opt.result()
            watch()
            for _ in range(SNAPSHOTS_OF_A if name == "a" else 1):
                sampler = run.save_weights_and_get_sampling_client().result()
                key = f"{name}{step}.{len(samplers)}"
                samplers.append((key, sampler))
                out["first"][key] = _use(sampler, len(samplers))
                watch()
            if name == "a" and step == 1:
                mid = run.save_state("mid").result().path
    runs["a"].load_state(mid).result()  # back to step 2: the samplers made since stay
    reloaded = runs["a"].save_weights_and_get_sampling_client().result()
    out["reloaded"] = _use(reloaded, 99)
    out["reloaded_as_mid"] = _use(dict(samplers)[f"a1.{SNAPSHOTS_OF_A + 2}"], 99)
    for i, (key, sampler) in enumerate(samplers):  # every sampler in turn, oldest first
        out["then"][key] = _use(sampler, i + 1)
        watch()
    finals = {name: run.save_weights_for_sampler("final").result().path for name, run in runs.items()}
    out["finals"] = {name: _adapter(state_dir, path) for name, path in finals.items()}
    rest = tinker.RestClient(base_url=url, api_key=API_KEY)
    out["capabilities"] = sorted(m.model_name for m in rest.get_server_capabilities().result().supported_models)
    out["spilled"] = sorted(p.name for p in (state_dir / ".tinker" / "runs").glob("*/snapshots/*"))
    service.close("success").result()  # this session's runs and samplers leave memory (and disk)
    out["after_close"] = watch()
    out["spilled_after_close"] = sorted(p.name for p in (state_dir / ".tinker" / "runs").glob("*/snapshots/*"))
    return out


def _adapter(state_dir: Path, path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file  # noqa: PLC0415

    run, kind, name = path.removeprefix("tinker://").split("/")
    return load_file(str(state_dir / ".tinker" / "runs" / run / kind / name / "adapter_model.safetensors"))


def _hf_logprobs(model: Path, tokens: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    hf = AutoModelForCausalLM.from_pretrained(str(model)).eval()
    with torch.no_grad():
        logp = torch.log_softmax(hf(input_ids=torch.tensor([tokens])).logits[0].float(), -1)
    return [float(logp[i - 1, tokens[i]]) for i in range(1, len(tokens))]


def test_bounded_memory_gives_exactly_the_values_of_unbounded_memory(servers, tinker_model: Path,
                                                                       second_model: Path) -> None:
    models = {"a": ALIAS, "b": str(tinker_model), "c": str(second_model)}
    watches = {name: _Watch(proc.url) for name, proc in servers.items()}
    got = {name: _scenario(proc.url, proc.state_dir, models, watches[name]) for name, proc in servers.items()}
    bounded, roomy = got["bounded"], got["roomy"]

    # Exactly the same values: losses, sampled tokens and log-probs, scores, final adapters.
    assert bounded["losses"] == roomy["losses"]
    assert all(len(v) == STEPS for v in roomy["losses"].values()) and roomy["losses"]["a"][0] > roomy["losses"]["a"][-1]
    assert bounded["first"] == roomy["first"] and bounded["then"] == roomy["then"]
    for name in DATA:
        assert bounded["untrained", name] == roomy["untrained", name]
        assert bounded["finals"][name].keys() == roomy["finals"][name].keys()
        for key, value in bounded["finals"][name].items():
            assert torch.equal(value, roomy["finals"][name][key]), (name, key)

    for out in (bounded, roomy):
        # Samplers live as long as their run: all 9 of run a (and the others) still give what they
        # gave when made, after load_state; the reloaded run samples as its step-2 snapshot did.
        assert sum(k.startswith("a") for k in out["first"]) == STEPS * SNAPSHOTS_OF_A > 8
        assert out["then"] == out["first"]
        assert out["reloaded"] == out["reloaded_as_mid"]
        assert len({v[1] for v in out["first"].values()}) == len(out["first"]) - (SNAPSHOTS_OF_A - 1) * STEPS  # trained
        # Each run on the base model it named, which get_info / get_base_model report as asked.
        assert out["names"] == {"a": (ALIAS, str(tinker_model), ALIAS), "b": (str(tinker_model),) * 3,
                                "c": (str(second_model),) * 3}
        assert out["capabilities"] == sorted([ALIAS, str(tinker_model), str(second_model)])
    assert bounded["untrained", "a"][1] == pytest.approx(_hf_logprobs(tinker_model, PROBE), abs=1e-5)
    assert bounded["untrained", "c"][1] == pytest.approx(_hf_logprobs(second_model, PROBE), abs=1e-5)

    # Memory: the bounded server never held more than its bounds between operations (the
    # managers' own adapter and base-model counts included); the roomy one held everything.
    peak = watches["bounded"].peak
    assert all(peak[k] <= BOUNDS[k] for k in BOUNDS), peak
    assert watches["roomy"].peak["adapters"] >= 3 + STEPS * (SNAPSHOTS_OF_A + 2) + 1, watches["roomy"].peak
    assert watches["roomy"].peak["base_models"] == 2
    assert len(bounded["spilled"]) >= STEPS * (SNAPSHOTS_OF_A + 2) - BOUNDS["samplers"]  # they waited on disk
    assert roomy["spilled"] == [] and bounded["spilled_after_close"] == []
    for out in (bounded, roomy):  # closing the session freed everything of it
        assert out["after_close"]["runs"] == out["after_close"]["samplers"] == out["after_close"]["adapters"] == 0


def test_long_operations_wait_quietly(servers, caplog: pytest.LogCaptureFixture) -> None:
    """An operation longer than the server's long poll (`tinker_long_poll_s = 0.1` here) is
    polled with 408 try_again answers, which the SDK repeats without a log line."""
    import tinker  # noqa: PLC0415
    from tinker import types  # noqa: PLC0415

    server = servers["bounded"]
    service = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    sampler = service.create_sampling_client(base_model=ALIAS)
    before = len(server.log_path.read_text().splitlines())
    with caplog.at_level(logging.INFO):
        out = sampler.sample(types.ModelInput.from_ints([5, 9, 14]), num_samples=64,
                             sampling_params=types.SamplingParams(max_tokens=600, seed=1, stop=[])).result()
    service.close("success").result()
    assert [len(s.tokens) for s in out.sequences] == [600] * 64
    # Heartbeat warnings are left out: the tests close their ServiceClients (conftest's
    # tinker_service), but a cookbook recipe that makes its own and never closes it (rl_loop.py)
    # keeps heartbeating to its stopped server from an SDK thread, into this test's records.
    noisy = [r.getMessage() for r in caplog.records if r.name.startswith("tinker") and r.levelno >= logging.WARNING
             and "Session heartbeat failed" not in r.getMessage()]
    assert noisy == []
    assert not any("Retrying request" in r.getMessage() for r in caplog.records)
    polls = [line for line in server.log_path.read_text().splitlines()[before:]
             if '"/api/v1/retrieve_future"' in line and '"status": 408' in line]
    assert len(polls) >= 2  # it did wait longer than the long poll, more than once
