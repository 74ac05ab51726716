"""API-key check for the /v1 routes (only when the server was started with an API key).

Accepted as ``Authorization: Bearer <key>`` (OpenAI clients) or ``x-api-key: <key>`` (Anthropic
clients, Claude Code). Compared in constant time so the key cannot be recovered from response
timings. /health and /metrics stay open: they are meant for local probes and scrapers and reveal
no model output.
"""

from __future__ import annotations

import secrets

from fastapi import Request

from server.errors import APIError


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


async def require_api_key(request: Request) -> None:
    """FastAPI dependency: 401 (in the route's API error shape) unless the key matches."""
    key = request.app.state.mtp.settings.api_key
    if key is None:
        return
    token = request.headers.get("x-api-key")
    if token is None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise _unauthorized(
                "Missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'."
            )
    if not secrets.compare_digest(token.strip().encode(), key.get_secret_value().encode()):
        raise _unauthorized("Incorrect API key provided.")
