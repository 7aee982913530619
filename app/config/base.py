"""The base of every configuration section: closed (unknown keys refused), frozen, no inf/nan, no booleans for numbers.

Kept apart from :mod:`app.config` so that section models defined elsewhere (e.g. ``app.config.federation``) share it
without importing the whole configuration.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

HEX64 = r"^[0-9a-f]{64}$"


class _Closed(BaseModel):
    # allow_inf_nan=False: `.inf`/`.nan` are refused for every float; booleans are refused for numbers below.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_numbers(cls, data: object) -> object:
        """YAML ``true`` is not a number: refuse it for int and float fields (pydantic's lax mode takes it as 1)."""
        if isinstance(data, dict):
            for name, info in cls.model_fields.items():
                if isinstance(data.get(name), bool) and info.annotation in (int, float, int | None, float | None):
                    raise ValueError(f"{name}: a number is required, not {str(data[name]).lower()}")
        return data


def problems(model: type[BaseModel], exc: ValidationError) -> str:
    """``exc``'s problems on one line (``training.max_step: Extra inputs are not permitted; …``); an unknown key also
    names the closest field of its section: ``(did you mean max_steps?)``."""
    out = []
    for err in exc.errors():
        line = f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
        if err["type"] == "extra_forbidden" and err["loc"]:
            close = difflib.get_close_matches(str(err["loc"][-1]), _field_names(model, err["loc"][:-1]), n=1)
            line += f" (did you mean {close[0]}?)" if close else ""
        out.append(line)
    return "; ".join(out)


def _field_names(model: type[BaseModel] | None, loc: Sequence[int | str]) -> list[str]:
    """The field names of the section at ``loc`` below ``model`` (a mapping's keys are skipped); none if unknown."""
    parts = list(loc)
    while parts and model is not None:
        field = model.model_fields.get(str(parts.pop(0)))
        if field is None:
            return []
        if typing.get_origin(field.annotation) is dict and parts:
            parts.pop(0)  # federation.clients.<name>: the key, then the value's fields
        model = _section(field.annotation)
    return [] if model is None else [f.alias or name for name, f in model.model_fields.items()]


def _section(annotation: object) -> type[BaseModel] | None:
    """The model an annotation holds (``X``, ``X | None``, ``dict[str, X]``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for m in map(_section, typing.get_args(annotation)) if m is not None), None)
