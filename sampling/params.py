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
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import configs


class SamplingParamError(ValueError):
    """A sampling parameter is out of range. ``param`` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


#: Temperatures below this sample the argmax: dividing logits by 1e-40 gives infinities (then
#: NaN probabilities), and long before that the distribution is the argmax anyway.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Fully resolved sampler settings for one request (every field has a value)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None

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

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Raise ``SamplingParamError`` for values no sampler can honour; return self."""
        if not self.temperature >= 0.0:
            raise SamplingParamError("temperature", "temperature must be >= 0")
        if self.temperature > 100.0:
            raise SamplingParamError("temperature", "temperature must be <= 100")
        if self.top_k < 0:
            raise SamplingParamError("top_k", "top_k must be >= 0 (0 disables it)")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamError("top_p", "top_p must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamError("min_p", "min_p must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise SamplingParamError(name, f"{name} must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise SamplingParamError("repetition_penalty", "repetition_penalty must be in (0, 10]")
        for token, bias in self.logit_bias.items():
            if vocab_size is not None and not 0 <= int(token) < vocab_size:
                raise SamplingParamError("logit_bias", f"logit_bias token id {token} out of range")
            if not -100.0 <= bias <= 100.0:
                raise SamplingParamError("logit_bias", "logit_bias values must be in [-100, 100]")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise SamplingParamError("seed", "seed must be a non-negative 63-bit integer")
        return self


@dataclass(frozen=True)
class SamplingOverrides:
    """One layer of optional settings (checkpoint, server config, preset or request)."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    seed: int | None = None

    @classmethod
    def from_mapping(cls, data: dict[str, Any]) -> SamplingOverrides:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known and v is not None}
        if "logit_bias" in values:
            values["logit_bias"] = {int(k): float(v) for k, v in values["logit_bias"].items()}
        return cls(**values)

    def set_fields(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def resolve(*layers: SamplingOverrides) -> SamplingParams:
    """Apply override layers from lowest to highest priority onto the neutral defaults."""
    params = SamplingParams()
    for layer in layers:
        params = replace(params, **layer.set_fields())
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
