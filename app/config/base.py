"""The base of every configuration section: closed (unknown keys refused), frozen, no inf/nan, no booleans for numbers.

Kept apart from :mod:`app.config` so that section models defined elsewhere (e.g. ``app.config.federation``) share it
without importing the whole configuration.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, model_validator

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
