"""Env family options: the pydantic base models and the one place their errors are worded.

Every family declares its options as a ``FamilyOptions`` subclass (``extra="forbid"``, frozen)
in its ``options_model`` class attribute; families that read rows from a file extend
``DataFileOptions``. ``parse_options`` turns pydantic's errors into one ``InvalidInput`` whose
field is the recipe path of the bad option, so a typo reads
``env.options.max_lenght: unknown option 'max_lenght' for env family 'reverse_text'; valid
options: ...`` whether it comes from a recipe or from ``make_family``.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from floe.errors import InvalidInput

ModelT = TypeVar("ModelT", bound=BaseModel)

OPTIONS_FIELD = "env.options"


class FamilyOptions(BaseModel):
    """Base for family option models: unknown keys are errors and models are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class DataFileOptions(FamilyOptions):
    """Options of a family that can read its tasks from a file instead of generating them."""

    data_path: str | None = None  # .jsonl/.json/.parquet rows; None = generate
    eval_data_path: str | None = None  # eval rows; without it eval is a hash split of data_path


def parse_options(model: type[ModelT], family: str, options: dict[str, Any]) -> ModelT:
    """Validate ``options`` for ``family`` into ``model``.

    Raises InvalidInput with field ``env.options.<key>`` for the first unknown or invalid
    option (``env.options`` for a rule across options); unknown options are listed with the
    valid ones.
    """
    valid = sorted(model.model_fields)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        listed = ", ".join(valid) if valid else f"none ({family!r} takes no options)"
        raise InvalidInput(
            f"{OPTIONS_FIELD}.{unknown[0]}",
            f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} for env family "
            f"{family!r}; valid options: {listed}",
        )
    try:
        return model(**options)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<options>'}: {e['msg']}" for e in err.errors()
        )
        field = f"{OPTIONS_FIELD}.{loc}" if loc else OPTIONS_FIELD
        raise InvalidInput(field, f"invalid options for env family {family!r}: {problems}") from None
