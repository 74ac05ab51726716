"""Sampling parameters and how their defaults resolve.

Resolution order (later wins): the checkpoint's ``generation_config.json`` -> the server/CLI
configuration (a preset or explicit flags) -> the request. A field left ``None`` at one level
falls through to the level below, so a user who sets only ``temperature`` still gets the
checkpoint's ``top_k``/``top_p``.

"Off" values: ``top_k`` 0 (or >= vocab), ``top_p`` 1.0, ``min_p`` 0, penalties 0 (1.0 for the
multiplicative repetition penalty). ``temperature`` 0 means greedy everywhere.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import NoneType
from typing import Any, get_args, get_type_hints

import configs


class SamplingParamError(ValueError):
    """A sampling parameter is out of range. ``param`` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


#: Temperatures below this sample the argmax: dividing logits by 1e-40 gives infinities (then
#: NaN probabilities), and long before that the distribution is the argmax anyway.
GREEDY_BELOW = 1e-5

#: The key of a sampler field's ``Bound`` in its dataclass field metadata.
BOUND = "sampler_bound"
#: The key of a sampler field's one-line description (API schemas, CLI help).
DESCRIPTION = "sampler_description"


@dataclass(frozen=True)
class Bound:
    """The values a sampler field accepts: ``low``/``high`` (None: unbounded), each included
    unless ``*_open``. ``wording`` replaces the interval in the error message where a reader
    needs the reason rather than the numbers."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    wording: str | None = None

    def holds(self, value: float) -> bool:
        # written as "not outside" comparisons would be, so that NaN (which compares false
        # with everything) is refused rather than let through
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return bool(above and below)

    def describe(self) -> str:
        if self.wording is not None:
            return self.wording
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        if self.low is None:
            return f"{'<' if self.high_open else '<='} {self.high:g}"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"in {left}{self.low:g}, {self.high:g}{right}"


def sampler_field(default: Any, bound: Bound, description: str) -> Any:
    """A ``SamplingParams`` field that is also a request / CLI setting: its neutral
    ``default``, the ``bound`` checked when a sampler is built, and the ``description`` that
    API schemas and ``--help`` show."""
    return field(default=default, metadata={BOUND: bound, DESCRIPTION: description})


@dataclass(frozen=True)
class SamplingParams:
    """Fully resolved sampler settings for one request (every field has a value).

    This class is the one definition of the sampler's settings: each ``sampler_field`` (name,
    type, neutral default, bound, description) is what the API schemas, the CLI flags and
    ``SamplingOverrides`` are generated from (``SAMPLER_FIELDS``). Construction checks every
    bound, so a ``SamplingParams`` that exists is valid: nothing downstream re-checks it."""

    temperature: float = sampler_field(
        1.0,
        Bound(0.0, 100.0),
        "sampling temperature; 0 (or below 1e-5) picks the most likely token",
    )
    top_k: int = sampler_field(
        0,
        Bound(0, wording=">= 0 (0 disables it)"),
        "sample from the k most likely tokens; 0 or >= the vocabulary: off (APIs: -1 too)",
    )
    top_p: float = sampler_field(
        1.0,
        Bound(0.0, 1.0, low_open=True),
        "nucleus sampling: the smallest set of tokens whose probability reaches top_p; 1: off",
    )
    min_p: float = sampler_field(
        0.0,
        Bound(0.0, 1.0),
        "drop tokens less likely than min_p times the most likely token; 0: off",
    )
    presence_penalty: float = sampler_field(
        0.0,
        Bound(-2.0, 2.0),
        "subtracted from the logit of every token already generated; 0: off",
    )
    frequency_penalty: float = sampler_field(
        0.0,
        Bound(-2.0, 2.0),
        "subtracted from a token's logit once per time it was generated; 0: off",
    )
    repetition_penalty: float = sampler_field(
        1.0,
        Bound(0.0, 10.0, low_open=True),
        "divides the logits of tokens in the prompt or output (multiplies negative ones); 1: off",
    )
    #: not a ``sampler_field``: a map keyed by token id, bounded per entry in __post_init__ and
    #: by the vocabulary in ``check_vocabulary``; each API spells it its own way
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = sampler_field(
        None,
        Bound(0, 2**63, high_open=True, wording="a non-negative 63-bit integer"),
        "random seed: the same seed and settings give the same text; choice i uses seed + i",
    )

    def __post_init__(self) -> None:
        for spec in SAMPLER_FIELDS:
            spec.check(getattr(self, spec.name))
        for bias in self.logit_bias.values():
            if not -100.0 <= bias <= 100.0:
                raise SamplingParamError("logit_bias", "logit_bias values must be in [-100, 100]")

    @property
    def greedy(self) -> bool:
        """Argmax draws: temperature 0, top_k 1, or a temperature below ``GREEDY_BELOW``
        (logits divided by one overflow float32; the limit is vLLM's)."""
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def uses_history(self) -> bool:
        """True when the distribution depends on previously generated tokens."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def check_vocabulary(self, vocab_size: int) -> None:
        """``SamplingParamError`` for a ``logit_bias`` token id outside the vocabulary: the one
        check that needs the model (every bound was checked on construction)."""
        for token in self.logit_bias:
            if not 0 <= int(token) < vocab_size:
                raise SamplingParamError("logit_bias", f"logit_bias token id {token} out of range")


@dataclass(frozen=True)
class SamplerField:
    """One sampler setting as schemas and CLIs see it (read from ``SamplingParams``)."""

    name: str
    #: int or float: the value's type (``None`` is always allowed where a value may be unset)
    type: type
    #: the neutral value the sampler uses when no layer sets the field
    default: Any
    bound: Bound
    description: str

    def check(self, value: Any) -> None:
        """``SamplingParamError`` naming the field when ``value`` is outside its bound (None,
        where the field allows it, is always accepted)."""
        if value is None and self.default is None:
            return
        try:
            holds = self.bound.holds(value)
        except TypeError:  # a string in a config file: the same error as a value out of range
            holds = False
        if not holds:
            raise SamplingParamError(self.name, f"{self.name} must be {self.bound.describe()}")


def read_sampler_fields() -> tuple[SamplerField, ...]:
    """The ``sampler_field``s of ``SamplingParams``, in declaration order."""
    hints = get_type_hints(SamplingParams)
    out = []
    for spec in fields(SamplingParams):
        if BOUND not in spec.metadata:
            continue
        # ``int | None`` -> int: "not sent" is None on every surface, so only the value's type
        # is recorded
        value_type = next(
            t for t in get_args(hints[spec.name]) or (hints[spec.name],) if t is not NoneType
        )
        out.append(
            SamplerField(
                spec.name,
                value_type,
                spec.default,
                spec.metadata[BOUND],
                spec.metadata[DESCRIPTION],
            )
        )
    return tuple(out)


#: The definition every surface derives from: API request schemas, CLI flags, overrides.
SAMPLER_FIELDS: tuple[SamplerField, ...] = read_sampler_fields()
SAMPLER_FIELD_NAMES: frozenset[str] = frozenset(f.name for f in SAMPLER_FIELDS)
#: every field of ``SamplingParams`` a layer may set (the sampler fields and ``logit_bias``)
_LAYER_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(SamplingParams))


class SamplingOverrides:
    """One layer of optional settings (checkpoint, server config, preset or request): any field
    of ``SamplingParams``, by keyword; a field not set reads as None and falls through to the
    layer below. Generated from ``SamplingParams`` so a new field needs no second declaration."""

    __slots__ = ("_values",)

    def __init__(self, **values: Any) -> None:
        unknown = set(values) - set(_LAYER_FIELDS)
        if unknown:
            raise TypeError(f"unknown sampling field(s): {sorted(unknown)}")
        object.__setattr__(self, "_values", {k: v for k, v in values.items() if v is not None})

    def __getattr__(self, name: str) -> Any:
        if name in _LAYER_FIELDS:
            return self._values.get(name)
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("SamplingOverrides is immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SamplingOverrides) and self._values == other._values

    def __hash__(self) -> int:
        return hash(tuple(sorted((k, repr(v)) for k, v in self._values.items())))

    def __reduce__(self) -> tuple[Any, ...]:
        # rebuilt through the constructor: the default (setting the slot) is what
        # __setattr__ forbids; pickle and copy go through here
        return (SamplingOverrides.from_mapping, (dict(self._values),))

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self._values.items())
        return f"SamplingOverrides({inner})"

    @classmethod
    def from_mapping(cls, data: dict[str, Any]) -> SamplingOverrides:
        """The known fields of ``data`` (a config table, generation_config.json); others are
        ignored, as those files hold more than sampler settings."""
        values = {k: v for k, v in data.items() if k in _LAYER_FIELDS and v is not None}
        if "logit_bias" in values:
            values["logit_bias"] = {int(k): float(v) for k, v in values["logit_bias"].items()}
        return cls(**values)

    def set_fields(self) -> dict[str, Any]:
        return dict(self._values)


def resolve(*layers: SamplingOverrides, vocab_size: int | None = None) -> SamplingParams:
    """Apply override layers from lowest to highest priority onto the neutral defaults and
    build the sampler once (which checks every bound).

    With ``vocab_size`` (a server resolving a request against its model) the model-dependent
    part happens here too, so the sampler handed to the engine needs no re-check: top_k >= the
    vocabulary keeps every token and becomes 0 ("off", what the sampler expects), and
    ``logit_bias`` ids are checked against the vocabulary."""
    merged: dict[str, Any] = {}
    for layer in layers:
        merged.update(layer.set_fields())
    top_k = merged.get("top_k")
    if vocab_size is not None and isinstance(top_k, int) and top_k >= vocab_size:
        merged["top_k"] = 0
    params = SamplingParams(**merged)
    if vocab_size is not None:
        params.check_vocabulary(vocab_size)
    return params


def generation_config_defaults(model_dir: str | Path) -> SamplingOverrides:
    """The sampler fields of a checkpoint's ``generation_config.json`` (empty when absent)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return SamplingOverrides()
    data = json.loads(path.read_text())
    if data.get("do_sample") is False:
        # HF semantics: do_sample false means greedy whatever the temperature says.
        data = {**data, "temperature": 0.0}
    return SamplingOverrides.from_mapping(data)


def load_presets(path: Path | None = None) -> dict[str, SamplingOverrides]:
    """Named presets (model-card recommendations) from ``path``, else the shipped
    ``configs/presets.toml``."""
    data = tomllib.loads(path.read_text() if path else configs.text(configs.PRESETS))
    return {name: SamplingOverrides.from_mapping(values) for name, values in data.items()}


def preset(name: str) -> SamplingOverrides:
    presets = load_presets()
    if name not in presets:
        raise SamplingParamError("preset", f"unknown preset {name!r}; known: {sorted(presets)}")
    return presets[name]
