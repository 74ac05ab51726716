"""Server settings: CLI flags > environment (``MTPSERVE_*``) > TOML file > defaults.

Why pydantic-settings: one typed object validated once at startup, so a typo in the TOML file or
an environment variable fails loudly before the model loads rather than at the first request.
The TOML file is ``--config FILE``, else ``$MTPSERVE_CONFIG``, else the shipped
``configs/server.toml`` (package data, so an installed wheel has it too). Sampler overrides live
in its ``[sampling]`` table and sit between the checkpoint's generation_config and the request
(see ``sampling.params.resolve``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

import configs
from engine.api import parse_draft_tokens
from sampling.params import SamplingOverrides, preset

DEFAULT_CONFIG = configs.path(configs.SERVER)


class ServerSettings(BaseSettings):
    """Everything the HTTP server needs besides the engine itself."""

    model_config = SettingsConfigDict(env_prefix="MTPSERVE_", extra="ignore")

    #: Checkpoint folder or repo id. The string itself is also accepted as a model name.
    model: str | None = None
    #: Extra names clients may use for the served model.
    served_model_names: list[str] = Field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    #: Speculative draft length K (0 = plain decoding); None = the engine's automatic choice.
    draft_tokens: int | None = None
    mtp_weights: str | None = None
    #: Weights dtype: auto (as stored on GPUs, float32 on CPUs where it fits) or a dtype name.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    draft_vocab: int | None = Field(None, ge=0)
    #: When set, every /v1 route requires ``Authorization: Bearer <key>``.
    api_key: SecretStr | None = None
    #: Host names served besides the loopback names and the bound address (a reverse proxy's
    #: public name); "*": any (server.guard).
    allowed_hosts: list[str] = Field(default_factory=list)
    #: Web origins (``https://app.example``) whose pages may call the API besides this
    #: server's own chat page; "*": any (server.guard).
    allowed_origins: list[str] = Field(default_factory=list)
    #: A sampler preset from configs/presets.toml (between generation_config and the request).
    preset: str | None = None
    #: Explicit sampler overrides (applied after the preset).
    sampling: dict[str, Any] = Field(default_factory=dict)
    #: Requests waiting for the engine (beyond those decoding) before 429.
    max_queue: int = Field(64, ge=1)
    #: Requests decoding together (continuous batching, speculation on for every row); 1
    #: decodes one request at a time.
    max_batch: int = Field(8, ge=1, le=64)
    retry_after_seconds: int = Field(1, ge=1)
    #: Largest n (choices per request), and largest prompt batch of /v1/completions.
    max_n: int = Field(8, ge=1)
    max_stop_sequences: int = Field(16, ge=0)
    max_top_logprobs: int = Field(20, ge=0)
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    #: Default max_tokens when a request gives none (capped by the rest of the context), so
    #: that one request that never stops cannot hold a batch row for good; None: the rest of
    #: the context.
    default_max_tokens: int | None = Field(4096, ge=1)
    log_level: str = "info"
    #: Chat-template arguments every chat request gets unless it sends its own value (e.g.
    #: ``{"enable_thinking": false}`` for a thinking model used without thinking).
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    #: Seconds of silence after which a stream sends a keep-alive ping (long prefills).
    sse_ping_seconds: float = Field(15.0, gt=0)
    #: Memory budget of the conversation (prefix) cache in bytes; 0 turns the cache off.
    prompt_cache_bytes: int = Field(1 << 30, ge=0)
    #: Folder for the cache's disk tier (None: memory only), and that tier's byte budget.
    prompt_cache_dir: str | None = None
    prompt_cache_disk_bytes: int = Field(8 << 30, ge=0)

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _kwargs_from_json(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else {}
            except ValueError as exc:
                raise ValueError(f"chat_template_kwargs is not JSON: {exc}") from exc
            if not isinstance(value, dict):
                raise ValueError("chat_template_kwargs must be a JSON object")
        return value

    @field_validator("draft_tokens", mode="before")
    @classmethod
    def _auto_is_none(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() == "none":
            return None
        return parse_draft_tokens(value)  # 'auto' -> None; outside the engine's range: error

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: tuple[PydanticBaseSettingsSource, ...] = (init_settings, env_settings)
        toml_file = settings_cls.model_config.get("toml_file")
        if toml_file:
            sources += (TomlConfigSettingsSource(settings_cls, toml_file=toml_file),)
        return sources

    def sampling_overrides(self) -> SamplingOverrides:
        """The server layer of sampler settings: preset, then the explicit [sampling] table."""
        layer: dict[str, Any] = {}
        if self.preset:
            layer.update(preset(self.preset).set_fields())
        layer.update({k: v for k, v in self.sampling.items() if v is not None})
        return SamplingOverrides.from_mapping(layer)

    def model_names(self, model_id: str) -> list[str]:
        """Every name a request may use for the served model; the first is the canonical id."""
        names = [model_id, *self.served_model_names]
        if self.model:
            names.append(self.model)
            names.append(Path(self.model).name)
        seen: dict[str, None] = {}
        for name in names:
            if name:
                seen.setdefault(name, None)
        return list(seen)


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> ServerSettings:
    """Build settings from (highest first) ``overrides`` (CLI flags), env, the TOML file."""
    path = config_file or os.environ.get("MTPSERVE_CONFIG")
    if path is None and DEFAULT_CONFIG.exists():
        path = DEFAULT_CONFIG
    if path is not None and not Path(path).is_file():
        raise FileNotFoundError(f"config file not found: {path}")

    class _FromFile(ServerSettings):
        model_config = SettingsConfigDict(
            env_prefix="MTPSERVE_", extra="forbid", toml_file=str(path) if path else None
        )

    values = {k: v for k, v in overrides.items() if v is not None}
    return _FromFile(**values)
