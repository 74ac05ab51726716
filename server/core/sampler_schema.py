"""The sampler fields of the API request bodies, generated from ``sampling.params``' one
definition (``SAMPLER_FIELDS``) so that no schema declares them again.

The models only parse: each field is ``int | float | None`` (None: not sent) with its
description. The bounds are checked once, when the request's sampler is resolved
(``server.core.requests.resolve_sampling``), and a bad value is a 400 naming the field in the
caller's error shape. ``wire_max`` is the exception: an API's own narrower limit on what a
client may send (OpenAI's temperature <= 2), part of that API's contract and its OpenAPI schema.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, Field, create_model

from sampling.params import SAMPLER_FIELDS, SamplerField

M = TypeVar("M", bound=BaseModel)


def sampler_fields_model(
    name: str,
    base: type[M],
    names: Iterable[str] | None = None,
    wire_max: Mapping[str, float] | None = None,
) -> type[M]:
    """A model named ``name`` deriving from ``base`` with the sampler fields ``names`` (None:
    all of them; an API whose wire format lacks a field leaves it out), in the definition's
    order; ``wire_max``: per field, the API's own upper limit."""
    wanted = set(names) if names is not None else {f.name for f in SAMPLER_FIELDS}
    unknown = wanted - {f.name for f in SAMPLER_FIELDS}
    if unknown:
        raise ValueError(f"not sampler fields: {sorted(unknown)}")
    limits = dict(wire_max or {})
    definitions: dict[str, Any] = {
        spec.name: (spec.type | None, wire_field(spec, limits.get(spec.name)))
        for spec in SAMPLER_FIELDS
        if spec.name in wanted
    }
    return create_model(name, __base__=base, **definitions)


def wire_field(spec: SamplerField, wire_max: float | None) -> Any:
    """The pydantic field of ``spec``: optional, described, with the API's own limit if any."""
    return Field(None, le=wire_max, description=spec.description)


def sent_sampling(request: BaseModel) -> dict[str, Any]:
    """The sampler fields ``request``'s API has, as sent (None: not sent)."""
    present = type(request).model_fields
    return {f.name: getattr(request, f.name) for f in SAMPLER_FIELDS if f.name in present}
