"""What the handlers share: settings, the scheduler (and through it the engine), metrics.

The engine object is only *read* here (tokenizer, vocabulary size, context length, names);
generation always goes through the scheduler's worker thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from sampling.params import SamplingOverrides
from server.core.detokenizer import TokenText
from server.core.scheduler import Scheduler
from server.errors import APIError
from server.metrics import ServerMetrics
from server.settings import ServerSettings


@dataclass
class ServerState:
    settings: ServerSettings
    scheduler: Scheduler
    metrics: ServerMetrics
    sampling_layer: SamplingOverrides
    engine: Any = None
    names: list[str] = field(default_factory=list)
    token_text: TokenText | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def attach_engine(self, engine: Any) -> None:
        """Called once the worker has built the engine."""
        self.engine = engine
        self.names = self.settings.model_names(str(engine.model_id))
        self.token_text = TokenText(engine.tokenizer)

    def require_engine(self) -> Any:
        if self.engine is None or not self.scheduler.alive:
            raise APIError(
                503, "the model is not loaded", code="model_not_ready", headers={"Retry-After": "5"}
            )
        return self.engine

    def check_model(self, name: str) -> str:
        """The served model's canonical id, or 404 — a request can never choose a path to load."""
        if name in self.names:
            return self.names[0]
        raise APIError(
            404,
            f"The model '{name}' does not exist. This server serves {self.names[0]!r}.",
            param="model",
            code="model_not_found",
        )
