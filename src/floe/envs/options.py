"""Turning ``make_family(name, **options)`` keyword options into a validated pydantic model.

Every family declares its options as a pydantic model with ``extra="forbid"``; this module owns
the translation of pydantic's errors into one ``ValueError`` that names the offending fields,
so a typo in a config file reads as "unknown option 'max_lenght' ... valid: ...".
"""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

ModelT = TypeVar("ModelT", bound=BaseModel)


class FamilyOptions(BaseModel):
    """Base for family option models: unknown keys are errors and models are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def parse_options(model: type[ModelT], family: str, options: dict) -> ModelT:
    """Validate ``options`` for ``family``; raise ValueError naming bad or unknown fields."""
    valid = sorted(model.model_fields)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(map(repr, unknown))} for env family {family!r}; "
            f"valid options: {', '.join(valid)}"
        )
    try:
        return model(**options)
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<options>'}: {e['msg']}" for e in err.errors()
        )
        raise ValueError(f"invalid options for env family {family!r}: {problems}") from None
