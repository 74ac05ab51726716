"""JSON without NaN or infinities, in and out.

Python's ``json`` reads ``NaN``, ``Infinity`` and numbers too large for a float (``1e999`` ->
``inf``), none of which is JSON, and writes them back as ``NaN`` / ``Infinity``, which no strict
client parses (and Starlette's ``JSONResponse`` refuses them: a 500). So a request body with one
is refused (``loads_strict``), a number the model writes past the float range is kept as the
text it wrote (``loads_keeping_huge``), and what is sent is encoded by ``dumps_finite``, which
as a last guard writes any non-finite float that still got through as ``null``.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi.responses import JSONResponse


class NonFiniteNumber(ValueError):
    """A JSON text holds NaN, an infinity, or a number beyond the float range."""


def _refuse_constant(name: str) -> Any:
    raise NonFiniteNumber(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NonFiniteNumber(f"the number {text} is beyond the range of a double")
    return value


def loads_strict(text: str | bytes) -> Any:
    """``json.loads`` that refuses NaN, infinities and numbers that overflow a double."""
    return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)


def _float_or_text(text: str) -> float | str:
    value = float(text)
    return value if math.isfinite(value) else text


def loads_keeping_huge(text: str | bytes) -> Any:
    """``json.loads`` for what the model wrote: a number beyond a double stays its text
    (``"1e999"``); ``NaN`` / ``Infinity`` are not JSON and fail to parse."""
    return json.loads(text, parse_constant=_refuse_constant, parse_float=_float_or_text)


def _without_non_finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _without_non_finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_without_non_finite(v) for v in obj]
    return obj


def dumps_finite(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` that always writes JSON: a non-finite float becomes ``null`` (walked
    only when one is there)."""
    try:
        return json.dumps(obj, allow_nan=False, **kwargs)
    except ValueError:
        return json.dumps(_without_non_finite(obj), allow_nan=False, **kwargs)


class FiniteJSONResponse(JSONResponse):
    """A JSON response that is JSON whatever floats the body holds."""

    def render(self, content: Any) -> bytes:
        return dumps_finite(content, ensure_ascii=False, separators=(",", ":")).encode()
