"""Every shipped recipe and overlay validates, so a typo in one fails CI, not a user's run."""

from __future__ import annotations

from pathlib import Path

import pytest

from floe.cli import load_recipe
from floe.envs import make_family

RECIPES = sorted((Path(__file__).parents[2] / "recipes").glob("*.toml"))
OVERLAYS = sorted((Path(__file__).parents[2] / "recipes" / "overlays").glob("*.toml"))


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_validates(path):
    recipe, rest = load_recipe([str(path)])
    assert rest == []
    make_family(recipe.env.name, **recipe.env.options)  # env options are valid too
    recipe.backend_config("model")


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[p.stem for p in OVERLAYS])
def test_overlays_apply_to_the_default_recipe(overlay):
    base = RECIPES[[p.stem for p in RECIPES].index("reverse_text")]
    recipe, _ = load_recipe([str(base), "@", str(overlay)])
    assert recipe.env.name == "reverse_text"
