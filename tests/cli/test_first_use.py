"""Second first-use review (X1): a backend URL that does not answer fails at once in one line and
the HTTP client says why it waits; a failed start leaves the run dir as it was; error fields are
the keys the user typed; a greedy eval refuses several samples per task."""

from __future__ import annotations

import importlib.util
import json
import logging
import time
from pathlib import Path

import pytest

from floe.cli import load_recipe, main
from floe.client.http import HttpTransport
from floe.config import BackendConfig, parse_config
from floe.errors import InvalidInput
from floe.protocol.errors import RemoteUnavailable
from floe.rl.loop import Trainer
from floe.rl.preflight import check_recipe
from floe.rl.warmstart import connect_recipe
from tests.server.conftest import free_port

from .conftest import run_floe


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_an_unreachable_backend_url_is_one_line_at_once(recipe, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    result = run_floe("train", recipe(), "--backend.url", json.dumps(url))
    assert time.monotonic() - start < 60  # the client alone would retry for 600 s
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (f"floe train: error: recipe.backend.url: cannot reach {url} (connection refused); "
                                     "start floe serve there or fix the URL")
    assert not (tmp_path / "run").exists()


def test_the_http_client_warns_once_when_it_starts_retrying(caplog):
    url = f"http://127.0.0.1:{free_port()}"
    transport = HttpTransport(url, timeout=0.5, backoff_initial=0.05)
    with caplog.at_level(logging.WARNING, logger="floe.client"):
        for _ in range(2):
            with pytest.raises(RemoteUnavailable):
                transport.call("info")
    transport.close()
    warnings = [r for r in caplog.records if r.name == "floe.client"]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert warnings[0].levelno == logging.WARNING
    message = warnings[0].getMessage()
    assert message.startswith(f"cannot reach {url} (ConnectError") and message.endswith("retrying until 0.5s")


def test_failed_starts_leave_the_run_dir_as_it_was(recipe, tmp_path, capsys):
    assert importlib.util.find_spec("vllm") is None, "the vLLM case needs a machine without vllm"
    path = recipe(steps=2, name="kept")
    assert main(["train", path, "--no-progress"]) == 0
    run = tmp_path / "kept"
    before = _snapshot(run)
    assert {"config.json", "config_history.jsonl", "metrics.jsonl", "loop_state.json"} <= before.keys()
    dead = json.dumps(f"http://127.0.0.1:{free_port()}")
    failures = {
        "recipe.backend.url": ["--backend.url", dead],
        "recipe.backend.sampler.engine.name": ["--backend.sampler.engine.name", "vllm"],
    }
    for field, args in failures.items():
        capsys.readouterr()
        assert main(["train", path, "--no-progress", "--resume", *args]) == 2
        assert capsys.readouterr().err.startswith(f"floe train: error: {field}: ")
        assert _snapshot(run) == before, field
        fresh = tmp_path / f"fresh-{field}"
        assert main(["train", path, "--no-progress", "--output.run_dir", json.dumps(str(fresh)), *args]) == 2
        assert capsys.readouterr().err.startswith(f"floe train: error: {field}: ")
        assert not fresh.exists(), field


def test_deciding_a_start_writes_nothing_until_the_backend_answers(recipe, tmp_path):
    path = recipe(steps=2, name="decide")
    assert main(["train", path, "--no-progress"]) == 0
    run = tmp_path / "decide"
    before = _snapshot(run)
    trainer = Trainer(load_recipe([path, "--train.steps", "3"])[0], resume=True, progress=False)
    trainer._prepare_run_dir()
    assert _snapshot(run) == before  # decided (resume from step 2), nothing written yet
    trainer._record_config()
    history = [json.loads(line) for line in (run / "config_history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [0, 2] and history[-1]["changed"] == {"train.steps": [2, 3]}
    assert json.loads((run / "config.json").read_text())["train"]["steps"] == 3


@pytest.mark.parametrize(
    ("args", "field", "message"),
    [
        (["--backend.url", "127.0.0.1:7000"], "recipe.backend.url",
         "'127.0.0.1:7000' needs a scheme: http://127.0.0.1:7000 (the address of a floe serve)"),
        (["--backend.sampler.engine.nme=torch"], "recipe.backend.sampler.engine.nme",
         "unknown key; allowed keys: dtype, max_batch_sequences, name"),
        (["--backend.sampler.engine.name", "vllm", "--backend.sampler.engine.dtyp", "auto"],
         "recipe.backend.sampler.engine.dtyp", "unknown key; allowed keys: "),
        (["--backend.sampler.engine.name", "vllm", "--backend.sampler.engine.dtype", "float8"],
         "recipe.backend.sampler.engine.dtype", "Input should be 'auto', 'float32', 'bfloat16' or 'float16'"),
        (["--train.loss.clip_hgh", "0.3"], "recipe.train.loss.clip_hgh", "unknown key; allowed keys: "),
        (["--eval.samples_per_task", "3"], "recipe.eval.samples_per_task",
         ("3 episodes per task with greedy decoding are 3 identical answers (pass@k would be pass@1); "
          "set eval.greedy = false")),
    ],
    ids=["url-without-scheme", "engine-key", "vllm-engine-key", "vllm-engine-value", "loss-key", "greedy-pass-at-k"],
)
def test_errors_name_the_key_the_user_typed(recipe, args, field, message):
    with pytest.raises(InvalidInput) as e:
        load_recipe([recipe(), *args])
    assert e.value.field == field and e.value.message.startswith(message), str(e.value)


def test_a_sampled_eval_may_take_several_samples_per_task(recipe):
    loaded, _ = load_recipe([recipe(), "--eval.samples_per_task", "3", "--eval.greedy", "false"])
    assert loaded.eval.samples_per_task == 3 and loaded.eval.greedy is False


def test_union_tags_are_dropped_from_config_errors_too():
    with pytest.raises(InvalidInput) as e:
        parse_config(BackendConfig, {"model": "m", "sampler": {"engine": {"name": "vllm", "nme": 1}}})
    assert e.value.field == "config.sampler.engine.nme"


def test_a_missing_engine_stack_names_the_recipe_key(recipe):
    assert importlib.util.find_spec("vllm") is None, "this test needs a machine without vllm"
    loaded, _ = load_recipe([recipe(), "--backend.sampler.engine.name", "vllm"])
    with pytest.raises(InvalidInput) as e:
        check_recipe(loaded)  # before any model loads
    assert e.value.field == "recipe.backend.sampler.engine.name"
    assert e.value.message == "needs the vllm package, which is not installed: pip install 'floe-rl[vllm]'"
    with pytest.raises(InvalidInput) as e:
        connect_recipe(loaded)  # the backend's own refusal, with the key the recipe set
    assert e.value.field == "recipe.backend.sampler.engine.name"
    assert e.value.message.startswith("'vllm' is not installed here")
