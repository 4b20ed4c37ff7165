"""First use, items 16 and 17: the distribution name, install commands, and docs/defaults that
disagreed with the code."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import tomllib

import floe
from floe.envs.text2sql import Text2SqlFamily
from floe.models import make_tiny
from floe.rl.config import TinyModelConfig

ROOT = Path(__file__).parents[2]


def test_published_as_floe_rl_and_every_install_command_says_so():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "floe-rl" and project["scripts"]["floe"] == "floe.cli:main"
    files = [ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("src/**/*.py"), *ROOT.glob("scripts/**/*")]
    wrong = [str(f.relative_to(ROOT)) for f in files if f.is_file() and re.search(r"pip install [\"']?floe\[", f.read_text())]
    assert wrong == []


def test_make_tiny_and_model_tiny_have_the_same_defaults():
    params = inspect.signature(make_tiny).parameters
    defaults = {k: p.default for k, p in params.items() if k != "path"}
    assert defaults == {k: f.default for k, f in TinyModelConfig.model_fields.items()}


def test_text2sql_databases_live_under_floe_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOE_CACHE", str(tmp_path / "c"))
    family = Text2SqlFamily()
    try:
        assert family.db_dir == tmp_path / "c" / "text2sql"
        family.tasks("eval", 1, 0)
        assert list((tmp_path / "c" / "text2sql").glob("*.sqlite"))
    finally:
        family.close()


def test_docs_that_disagreed_with_the_repo():
    assert "DESIGN.md" not in (floe.__doc__ or "") and "docs/architecture.md" in floe.__doc__
    assert "floe_state/" in (ROOT / ".gitignore").read_text().splitlines()
    # docs/remote.md: every table is contiguous (a paragraph inside one breaks its rendering).
    lines = (ROOT / "docs" / "remote.md").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and not lines[i - 1].startswith("|"):  # a table starts: header, then |---|
            assert re.fullmatch(r"\|[-| :]+\|", lines[i + 1]), f"docs/remote.md line {i + 1} is a row outside a table: {line!r}"
