"""Which EnvFamily a name means: built-ins, a user's "pkg.module:Class", or an entry point.

A name resolves, in order, to
* a built-in family (``BUILTINS``: reverse_text, math, alphabet_sort, text2sql);
* ``"pkg.module:Class"`` (anything with a colon): ``Class`` imported from ``pkg.module``, so a
  recipe can use an environment from the user's own code without forking floe;
* an entry point of the ``floe.envs`` group (``importlib.metadata``) with that name, so an
  installed package can register ``my_env = "my_pkg.tasks:MyFamily"``.

Every family class must subclass ``EnvFamily``, set a string ``name`` and declare its options
as a ``FamilyOptions`` subclass in ``options_model`` (without one it takes no options).
``options_model(name)`` gives that model without building the family, so a recipe validates
``env.options`` at load time. Families are imported on first use, so importing ``floe.envs``
(which every sandbox worker process does) stays cheap.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

from floe.envs.base import EnvFamily
from floe.envs.options import FamilyOptions, parse_options
from floe.errors import InvalidInput

NAME_FIELD = "env.name"
ENTRY_POINT_GROUP = "floe.envs"

# name -> "module:Class"
BUILTINS: dict[str, str] = {
    "reverse_text": "floe.envs.reverse_text:ReverseTextFamily",
    "math": "floe.envs.math:MathFamily",
    "alphabet_sort": "floe.envs.alphabet_sort:AlphabetSortFamily",
    "text2sql": "floe.envs.text2sql:Text2SqlFamily",
}

FAMILIES: tuple[str, ...] = tuple(BUILTINS)


def entry_point_names() -> list[str]:
    """Names registered by installed packages under the ``floe.envs`` entry-point group."""
    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def family_class(name: str) -> type[EnvFamily]:
    """The EnvFamily subclass ``name`` means (see the module docstring).

    Raises InvalidInput (field ``env.name``) for an unknown name (listing built-ins and entry
    points), a module that fails to import (naming it and the ImportError), a missing class,
    or a class that is not an EnvFamily with a string ``name``.
    """
    if not isinstance(name, str) or not name:
        raise InvalidInput(NAME_FIELD, f"must be a non-empty string, got {name!r}")
    if name in BUILTINS:
        return _load(BUILTINS[name], name)
    if ":" in name:
        return _load(name, name)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            try:
                loaded = ep.load()
            except ImportError as err:
                raise InvalidInput(
                    NAME_FIELD, f"entry point {name!r} ({ep.value}) failed to import: {err}"
                ) from None
            return _checked(loaded, f"entry point {name!r} ({ep.value})")
    eps = ", ".join(entry_point_names()) or "none installed"
    raise InvalidInput(
        NAME_FIELD,
        f"unknown env {name!r}; built-in: {', '.join(FAMILIES)}; entry points ({ENTRY_POINT_GROUP}): {eps}; "
        "or name your own class as 'pkg.module:Class'",
    )


def options_model(name: str) -> type[FamilyOptions]:
    """The options model of family ``name``, without building the family (FamilyOptions,
    which accepts no options, when the class declares none)."""
    return family_class(name).options_model


def validate_options(name: str, options: dict[str, Any]) -> FamilyOptions:
    """``options`` validated against family ``name``'s options model (InvalidInput naming
    ``env.options.<key>`` otherwise); builds nothing."""
    return parse_options(options_model(name), name, options)


def make_family(name: str, **options: Any) -> EnvFamily:
    """Build the env family ``name`` with ``options``.

    Raises InvalidInput (a ValueError) naming an unknown family (listing the valid ones) or
    an unknown/invalid option (``env.options.<key>``, listing the family's valid options).
    """
    cls = family_class(name)
    validate_options(name, options)
    return cls(**options)


def _load(spec: str, name: str) -> type[EnvFamily]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise InvalidInput(NAME_FIELD, f"{name!r}: a class is named as 'pkg.module:Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise InvalidInput(
            NAME_FIELD, f"cannot import module {module_name!r} for env {name!r}: {type(err).__name__}: {err}"
        ) from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise InvalidInput(NAME_FIELD, f"module {module_name!r} has no attribute {attr!r} (env {name!r})")
        obj = getattr(obj, part)
    return _checked(obj, repr(spec))


def _checked(obj: Any, what: str) -> type[EnvFamily]:
    if not (isinstance(obj, type) and issubclass(obj, EnvFamily)):
        kind = f"class {obj.__name__}" if isinstance(obj, type) else type(obj).__name__
        raise InvalidInput(NAME_FIELD, f"{what} is not an EnvFamily subclass (got {kind}); subclass floe.envs.EnvFamily")
    if not isinstance(getattr(obj, "name", None), str) or not obj.name:
        raise InvalidInput(NAME_FIELD, f"{what}: an EnvFamily must set a class attribute `name` (a non-empty string)")
    model = obj.options_model
    if not (isinstance(model, type) and issubclass(model, FamilyOptions)):
        raise InvalidInput(NAME_FIELD, f"{what}: options_model must be a floe.envs.FamilyOptions subclass")
    return obj
