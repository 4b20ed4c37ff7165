"""The `floe` command: train | sft | eval | serve | plot. (Benchmarks are scripts in benchmarks/.)

Recipes are TOML files; more files can be layered with `@ OVERLAY.toml` and single keys set
with `--section.key value` (TOML syntax for the value; a date-like value such as 2024-01-01
stays the text it was). A later layer or override that sets `model.path` replaces an earlier
`[model.tiny]` and the other way round. Unknown keys are errors.

Every command parses its flags and validates its whole recipe (loss, env name and options
included) before importing the model stack, then checks the machine and the data
(floe.rl.preflight) before any model loads. Every user error is one line on stderr,
`floe <command>: error: <field>: <problem and fix>`, with exit status 2; Ctrl-C is one line too
(`floe train` says the step and how to resume, and still writes the plots), status 130.
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import json
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from floe.config import split_recipe_args
from floe.errors import FloeError, InvalidInput

USAGE_RECIPE = """recipe arguments:
  RECIPE.toml [@ OVERLAY.toml ...] [--section.key VALUE ...]
  Layers merge left to right, then overrides apply, e.g.
    floe train recipes/reverse_text.toml @ recipes/overlays/async.toml --train.steps 20
  Every key is documented in docs/recipes.md; an unknown key is an error."""

COMMAND_HELP = {
    "train": "GRPO from a recipe (recipes/reverse_text.toml is the default demo)",
    "sft": "supervised fine-tuning: on [sft] data (chat or prompt/completion rows) or an env's demonstrations",
    "eval": "held-out reward (pass@k, maj@k) of a model or a run's checkpoint",
    "serve": "run the backend as an HTTP server",
    "plot": "PNG curves of a run's metrics",
    "prime-trainer": "prime-rl's trainer on a `floe serve`: @ rl.toml @ recipes/prime_rl/floe.toml",
    "prime-rl": "a prime-rl recipe on floe, every process started here: @ rl.toml @ recipes/prime_rl/floe.toml",
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one InvalidInput line (the caller prints it), not usage + exit."""

    def error(self, message: str) -> NoReturn:
        raise InvalidInput("arguments", f"{message}; see {self.prog} --help")


def _parser(prog: str, description: str) -> ArgumentParser:
    return ArgumentParser(prog=prog, description=description, epilog=USAGE_RECIPE,
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def load_recipe(args: list[str]) -> tuple[Any, list[str]]:
    """(validated Recipe, remaining flags) from `RECIPE.toml [@ OVERLAY ...] [--a.b VALUE ...] flags`.

    Raises InvalidInput naming the first bad key (see floe.rl.config.parse_recipe).
    """
    files, overrides, rest = split_recipe_args(args)
    return _recipe(files, overrides, args), rest


def _recipe(files: list[str], overrides: dict[str, Any], args: list[str]) -> Any:
    from floe.rl.config import merge_recipe_layers, parse_recipe  # noqa: PLC0415 - loads the loss registry

    if not files:
        raise InvalidInput("RECIPE", "give a recipe TOML file, e.g. recipes/reverse_text.toml")
    return parse_recipe(merge_recipe_layers(files, _undated(overrides, args)))


def _undated(overrides: dict[str, Any], args: list[str]) -> dict[str, Any]:
    """Overrides whose value TOML read as a date or time, put back as the text the user wrote
    (`--output.run_dir 2024-01-01` is a directory name, not a date)."""
    out = dict(overrides)
    for key, value in overrides.items():
        if isinstance(value, (datetime.date, datetime.time)):
            for i, arg in enumerate(args):
                if arg.startswith(f"--{key}="):
                    out[key] = arg.split("=", 1)[1]
                elif arg == f"--{key}" and i + 1 < len(args):
                    out[key] = args[i + 1]
    return out


def _flags_then_recipe(parser: ArgumentParser, argv: list[str]) -> tuple[Any, argparse.Namespace] | None:
    """Parse the flags first (fast), then the recipe, then check its device (torch alone, before
    the model stack is imported: `check_device_first`); None after printing --help."""
    if any(a in ("-h", "--help") for a in argv):
        parser.print_help()
        return None
    files, overrides, rest = split_recipe_args(argv)
    opts = parser.parse_args(rest)
    recipe = _recipe(files, overrides, argv)
    check_device_first(recipe)
    return recipe, opts


def check_device_first(recipe: Any) -> None:
    """InvalidInput("recipe.backend.device") for a device this torch cannot use, checked before
    anything else is imported (the training loop imports transformers and the model stack,
    seconds more); the preflight (`floe.rl.preflight`) checks it again. A remote backend's
    device is its server's: not checked here."""
    if recipe.url is None:
        from floe.devices import check_device  # noqa: PLC0415 - torch alone

        check_device(recipe.backend.get("device", "cpu"), "recipe.backend.device", "--backend.device cpu")


def cmd_train(argv: list[str]) -> int:
    parser = _parser("floe train", "Run GRPO from a recipe.")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in output.run_dir from its last checkpoint (from step 0 if it has none)")
    parser.add_argument("--no-progress", action="store_true", help="no live progress bar")
    parsed = _flags_then_recipe(parser, argv)
    if parsed is None:
        return 0
    recipe, opts = parsed
    from floe.rl.loop import Trainer  # noqa: PLC0415 - the model stack, once the recipe is valid
    from floe.rl.plot import plot_run  # noqa: PLC0415

    trainer = Trainer(recipe, resume=opts.resume, progress=not opts.no_progress)

    def on_ctrl_c(signum: int, frame: Any) -> None:
        trainer.interrupted.set()  # kept even where the KeyboardInterrupt below is swallowed
        signal.default_int_handler(signum, frame)

    previous = signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        summary = trainer.run()
    except KeyboardInterrupt:
        run_dir = Path(recipe.output.run_dir)
        if (run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").stat().st_size:
            plot_run(run_dir)
        again = shlex.join(["floe", "train", *argv, *([] if opts.resume else ["--resume"])])
        where = (f"last checkpoint: step {trainer.checkpoint_step}" if trainer.checkpoint_step is not None
                 else "no checkpoint yet, so --resume restarts it from step 0")
        print(f"floe train: interrupted at step {trainer.steps_done} ({where}); resume with: {again}", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGINT, previous)
    plots = plot_run(summary.run_dir)
    evals = summary.eval_rewards
    first, last = evals.get(0), evals.get(max(evals)) if evals else None
    print(json.dumps({"run_dir": summary.run_dir, "steps": summary.steps_done, "seconds": round(summary.seconds, 1),
                      "eval_reward_start": first, "eval_reward_end": last, "plots": [str(p) for p in plots]}, indent=2))
    return 0


def cmd_sft(argv: list[str]) -> int:
    parser = _parser("floe sft", "SFT (cross_entropy) on [sft] data (chat or prompt/completion rows: JSONL, parquet, "
                     "a saved or hub `datasets` dataset) or, without it, on the recipe env's demonstrations; uses the "
                     "recipe's [model] and [warm_start] (steps, batch_size, lr, ...) and exports an HF directory.")
    parser.add_argument("--out", required=False, help="output HF directory (default: <run_dir>/sft); must be new, "
                        "empty, or an earlier floe export")
    parsed = _flags_then_recipe(parser, argv)
    if parsed is None:
        return 0
    recipe, opts = parsed
    from floe.models.loading import check_model_source  # noqa: PLC0415
    from floe.rl.preflight import check_recipe  # noqa: PLC0415

    if recipe.url is not None:
        raise InvalidInput("recipe.backend.url", "floe sft trains an embedded backend; drop backend.url")
    out = Path(opts.out or Path(recipe.output.run_dir) / "sft")
    _check_export_dir(out)
    rows = None
    if recipe.sft.data is not None:
        from floe.rl.sft import load_rows  # noqa: PLC0415

        if recipe.model.path is not None:
            check_model_source(recipe.model.path, "recipe.model.path")
        rows = load_rows(recipe.sft)  # every row checked before the model loads
    else:
        check_recipe(recipe)
    import shutil  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    from floe.envs import make_family  # noqa: PLC0415
    from floe.models import make_tiny  # noqa: PLC0415
    from floe.rl.config import WarmStartConfig  # noqa: PLC0415
    from floe.rl.progress import RunProgress  # noqa: PLC0415
    from floe.rl.sft import DataBatches  # noqa: PLC0415
    from floe.rl.warmstart import SFT_BACKEND_KEYS, sft_on_demonstrations, sft_train  # noqa: PLC0415

    cfg = recipe.warm_start or WarmStartConfig()
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.work-", dir=out.parent))
    try:
        base = recipe.model.path or str(make_tiny(work / "base", **recipe.model.tiny.make_tiny_kwargs()))
        ui = RunProgress(sft_label="sft")  # this is the SFT itself, not a warm start before RL
        if rows is None:
            family = make_family(recipe.env.name, **recipe.env.options)
            sft_on_demonstrations(base, family, cfg, work, ui.warm_start, recipe.backend.get("num_threads"), out=out)
        else:
            backend = {k: v for k, v in recipe.backend.items() if k in SFT_BACKEND_KEYS}
            sft_train(base, DataBatches(rows, recipe.sft, cfg.batch_size), cfg, work, ui.warm_start, backend, out=out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"model": str(out)}))
    return 0


def _check_export_dir(out: Path) -> None:
    """Checked before training (export_hf checks again when it writes): never replace a
    directory that floe did not export."""
    from floe.backend.backend import EXPORT_MARKER  # noqa: PLC0415

    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or (out / EXPORT_MARKER).is_file())):
        raise InvalidInput("--out", f"{out} exists and is not a floe export; choose a new or empty directory")


def cmd_eval(argv: list[str]) -> int:
    parser = _parser("floe eval", "Held-out reward of a model (or a run's checkpoint) on the recipe's env; with "
                     "eval.samples_per_task = k > 1 also pass@k and maj@k.")
    parser.add_argument("--checkpoint", help="a state name in <run_dir>/states to load first, or 'latest'")
    parsed = _flags_then_recipe(parser, argv)
    if parsed is None:
        return 0
    recipe, opts = parsed
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    from floe.rl.evaluation import evaluate  # noqa: PLC0415
    from floe.rl.preflight import check_recipe  # noqa: PLC0415
    from floe.rl.rollouts import Renderer  # noqa: PLC0415
    from floe.rl.warmstart import connect_recipe  # noqa: PLC0415

    family = check_recipe(recipe)
    run_dir = Path(recipe.output.run_dir)
    checkpoint = None
    if opts.checkpoint and recipe.url is None:  # a local run's states are on disk: check before loading a model
        checkpoint = pick_checkpoint(opts.checkpoint, local_states(Path(recipe.state_dir)), run_dir)
    client = connect_recipe(recipe)
    try:
        if opts.checkpoint:
            client.load_state(checkpoint or pick_checkpoint(opts.checkpoint, client.list_states(), run_dir))
        start = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            result = evaluate(client, family, family.tasks("eval", recipe.eval.size, recipe.eval.seed), recipe,
                              Renderer(client.tokenizer()), pool)
    finally:
        client.close()
    result["seconds"] = round(time.perf_counter() - start, 2)
    print(json.dumps(result, indent=2))
    return 0


def local_states(state_dir: Path) -> list[str]:
    """Names of the states saved under `state_dir`: `floe.backend.state.list_states`, the one
    listing (interrupted overwrites recovered first)."""
    from floe.backend.state import list_states  # noqa: PLC0415 - torch, only for a local run's states

    return list_states(state_dir)


def pick_checkpoint(name: str, saved: list[str], run_dir: Path) -> str:
    """The state `--checkpoint NAME` means: NAME itself, or for 'latest' the run's last checkpoint
    (loop_state.json) or else the last saved state by name. InvalidInput listing the saved ones."""
    listed = ", ".join(saved) if saved else "none"
    if name == "latest":
        state_file = run_dir / "loop_state.json"
        if state_file.is_file():
            latest = json.loads(state_file.read_text())["checkpoint"]
            if latest in saved:
                return str(latest)
        if saved:
            return saved[-1]
        raise InvalidInput("--checkpoint", f"'latest': no saved states for {run_dir}; train first, or evaluate without --checkpoint")
    if name not in saved:
        close = difflib.get_close_matches(name, saved, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise InvalidInput("--checkpoint", f"no saved state {name!r}; {hint}saved states: {listed} (or 'latest')")
    return name


def cmd_plot(argv: list[str]) -> int:
    parser = ArgumentParser(prog="floe plot", description="Write reward, KL and entropy PNGs for a run.")
    parser.add_argument("run_dir")
    opts = parser.parse_args(argv)
    from floe.rl.plot import plot_run  # noqa: PLC0415 - matplotlib

    for path in plot_run(opts.run_dir):
        print(path)
    return 0


def cmd_serve(argv: list[str]) -> int:
    from floe.server.cli import serve_main  # noqa: PLC0415 - the server stack

    return serve_main(argv)


def cmd_prime_trainer(argv: list[str]) -> int:
    from floe.integrations.prime_rl.trainer import main as prime_trainer_main  # noqa: PLC0415 - msgspec, the client

    return prime_trainer_main(argv)


def cmd_prime_rl(argv: list[str]) -> int:
    from floe.integrations.prime_rl.launch import main as prime_rl_main  # noqa: PLC0415 - prime-rl's config classes

    return prime_rl_main(argv)


COMMANDS = {"train": cmd_train, "sft": cmd_sft, "eval": cmd_eval, "serve": cmd_serve, "plot": cmd_plot,
            "prime-trainer": cmd_prime_trainer, "prime-rl": cmd_prime_rl}


def usage() -> str:
    lines = [f"  {name:<13} {text}" for name, text in COMMAND_HELP.items()]
    return "usage: floe {train,sft,eval,serve,plot,prime-trainer,prime-rl} ... (floe COMMAND --help for each; floe --version)\n\n" + "\n".join(lines)


def version() -> str:
    """The installed version (distribution floe-rl), else the source tree's."""
    from importlib.metadata import PackageNotFoundError  # noqa: PLC0415
    from importlib.metadata import version as dist_version  # noqa: PLC0415

    try:
        return dist_version("floe-rl")
    except PackageNotFoundError:
        from floe import __version__  # noqa: PLC0415

        return __version__


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"floe {version()}")
        return 0
    command = argv[0]
    if command not in COMMANDS:
        close = difflib.get_close_matches(command, list(COMMANDS), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        print(f"floe: error: unknown command {command!r}{hint} (commands: {', '.join(COMMANDS)}; floe --help)",
              file=sys.stderr)
        return 2
    try:
        return COMMANDS[command](argv[1:])
    except (FloeError, FileExistsError, FileNotFoundError) as e:
        print(f"floe {command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"floe {command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
