"""What an API adapter hands the registry (``server.adapters``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter

from server.errors import APIError


@dataclass(frozen=True)
class Adapter:
    """One API: its routes, the metric label of each endpoint (one ending in "/" covers the
    paths under it), and its error shape.

    ``prefixes``: the paths (and what lies under them) whose errors take ``error_body``; an
    adapter without its own shape answers in OpenAI's (``APIError.body``)."""

    name: str
    routers: tuple[APIRouter, ...]
    endpoints: dict[str, str]
    prefixes: tuple[str, ...] = ()
    error_body: Callable[[APIError], dict[str, Any]] | None = field(default=None)

    def owns(self, path: str) -> bool:
        return any(path == p or path.startswith(p + "/") for p in self.prefixes)
