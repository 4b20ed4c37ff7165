"""The `floe` command: train | sft | eval | serve | plot. (Benchmarks are scripts in benchmarks/.)

Recipes are TOML files; more files can be layered with `@ OVERLAY.toml` and single keys set
with `--section.key value` (TOML syntax for the value). Unknown keys are errors. Every command
validates its whole recipe (loss, env name and options included) before importing the model
stack or building anything, so a typo fails in about a second.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from floe.config import load_layers, split_recipe_args
from floe.errors import FloeError, InvalidInput

USAGE_RECIPE = """recipe arguments:
  RECIPE.toml [@ OVERLAY.toml ...] [--section.key VALUE ...]
  Layers merge left to right, then overrides apply, e.g.
    floe train recipes/reverse_text.toml @ recipes/overlays/async.toml --train.steps 20
  Every key is documented in docs/recipes.md; an unknown key is an error."""


def load_recipe(args: list[str]) -> tuple[Any, list[str]]:
    """(validated Recipe, remaining flags) from `RECIPE.toml [@ OVERLAY ...] [--a.b VALUE ...] flags`.

    Raises InvalidInput naming the first bad key (see floe.rl.config.parse_recipe).
    """
    from floe.rl.config import parse_recipe

    files, overrides, rest = split_recipe_args(args)
    if not files:
        raise InvalidInput("RECIPE", "give a recipe TOML file, e.g. recipes/reverse_text.toml")
    return parse_recipe(load_layers(files, overrides)), rest


def cmd_train(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="floe train", description="Run GRPO from a recipe.", epilog=USAGE_RECIPE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--resume", action="store_true", help="continue the run in output.run_dir from its last checkpoint")
    parser.add_argument("--no-progress", action="store_true", help="no live progress bar")
    if any(a in ("-h", "--help") for a in argv):
        parser.print_help()
        return 0
    recipe, rest = load_recipe(argv)
    opts = parser.parse_args(rest)
    from floe.rl import train
    from floe.rl.plot import plot_run

    summary = train(recipe, resume=opts.resume, progress=not opts.no_progress)
    plots = plot_run(summary.run_dir)
    evals = summary.eval_rewards
    first, last = evals.get(0), evals.get(max(evals)) if evals else None
    print(json.dumps({"run_dir": summary.run_dir, "steps": summary.steps_done, "seconds": round(summary.seconds, 1),
                      "eval_reward_start": first, "eval_reward_end": last, "plots": [str(p) for p in plots]}, indent=2))
    return 0


def cmd_sft(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="floe sft", description="SFT (cross_entropy) on the recipe env's demonstrations; "
                                     "uses the recipe's [model] and [warm_start] and exports an HF directory.",
                                     epilog=USAGE_RECIPE, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=False, help="output HF directory (default: <run_dir>/sft); must be new, "
                        "empty, or an earlier floe export")
    if any(a in ("-h", "--help") for a in argv):
        parser.print_help()
        return 0
    recipe, rest = load_recipe(argv)
    opts = parser.parse_args(rest)
    import shutil
    import tempfile

    from floe.backend.backend import EXPORT_MARKER
    from floe.envs import make_family
    from floe.models import make_tiny
    from floe.rl.config import WarmStartConfig
    from floe.rl.progress import RunProgress
    from floe.rl.warmstart import sft_on_demonstrations

    out = Path(opts.out or Path(recipe.output.run_dir) / "sft")
    # Checked before training (export_hf checks again when it writes): never replace a
    # directory that floe did not export.
    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or (out / EXPORT_MARKER).is_file())):
        raise InvalidInput("--out", f"{out} exists and is not a floe export; choose a new or empty directory")
    family = make_family(recipe.env.name, **recipe.env.options)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.work-", dir=out.parent))
    try:
        base = recipe.model.path or str(make_tiny(work / "base", **recipe.model.tiny.model_dump()))
        ui = RunProgress()
        sft_on_demonstrations(base, family, recipe.warm_start or WarmStartConfig(), work, ui.warm_start,
                              recipe.backend.get("num_threads"), out=out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"model": str(out)}))
    return 0


def cmd_eval(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="floe eval", description="Held-out reward of a model (or a run's checkpoint) "
                                     "on the recipe's env.", epilog=USAGE_RECIPE, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="a state name in <run_dir>/states to load first")
    if any(a in ("-h", "--help") for a in argv):
        parser.print_help()
        return 0
    recipe, rest = load_recipe(argv)
    opts = parser.parse_args(rest)
    from concurrent.futures import ThreadPoolExecutor

    import floe
    from floe.envs import make_family
    from floe.rl import evaluate
    from floe.rl.rollouts import Renderer
    from floe.rl.warmstart import prepare_model

    model = prepare_model(recipe)
    client = floe.connect(recipe.backend_config(model))
    if opts.checkpoint:
        client.load_state(opts.checkpoint)
    family = make_family(recipe.env.name, **recipe.env.options)
    start = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        result = evaluate(client, family, family.tasks("eval", recipe.eval.size, recipe.eval.seed), recipe,
                          Renderer(client.tokenizer()), pool)
    result["seconds"] = round(time.perf_counter() - start, 2)
    print(json.dumps(result, indent=2))
    return 0


def cmd_plot(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="floe plot", description="Write reward, KL and entropy PNGs for a run.")
    parser.add_argument("run_dir")
    opts = parser.parse_args(argv)
    from floe.rl.plot import plot_run

    for path in plot_run(opts.run_dir):
        print(path)
    return 0


def cmd_serve(argv: list[str]) -> int:
    from floe.server.cli import serve_main

    return serve_main(argv)


COMMANDS = {"train": cmd_train, "sft": cmd_sft, "eval": cmd_eval, "serve": cmd_serve, "plot": cmd_plot}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: floe {train,sft,eval,serve,plot} ... (floe COMMAND --help for each)\n\n"
              "  train  GRPO from a recipe (recipes/reverse_text.toml is the default demo)\n"
              "  sft    supervised warm start on an env's demonstrations\n"
              "  eval   held-out reward of a model or checkpoint\n"
              "  serve  run the backend as an HTTP server\n"
              "  plot   PNG curves of a run's metrics")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except (FloeError, FileExistsError, FileNotFoundError) as e:
        print(f"floe {argv[0]}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
