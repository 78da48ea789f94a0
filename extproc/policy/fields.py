"""The field types every part of the policy file shares: durations, header names, strict models."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: object) -> object:
    """Accept 250ms, 10s, 2m, 1h or a bare number of seconds."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 250ms, 10s or 2m")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        match = _DURATION.match(value)
        if match is None:
            raise ValueError(f"expected a duration such as 250ms, 10s or 2m, got {value!r}")
        return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    raise ValueError("expected a duration such as 250ms, 10s or 2m")


#: Seconds, written in the file as ``250ms``, ``10s``, ``2m`` or a plain number.
Duration = Annotated[float, BeforeValidator(parse_duration)]
HeaderName = Annotated[str, Field(pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$", max_length=128)]


class Strict(BaseModel):
    """Unknown keys are errors; a loaded policy is frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)
