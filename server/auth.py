"""Bearer-token check for the /v1 routes (only when the server was started with an API key).

Compared in constant time so the key cannot be recovered from response timings. /health and
/metrics stay open: they are meant for local probes and scrapers and reveal no model output.
"""

from __future__ import annotations

import secrets

from fastapi import Request

from server.errors import APIError


async def require_api_key(request: Request) -> None:
    """FastAPI dependency: 401 in the OpenAI schema unless ``Authorization: Bearer <key>``."""
    key = request.app.state.mtp.settings.api_key
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise APIError(
            401,
            "Missing API key: send 'Authorization: Bearer <key>'.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if not secrets.compare_digest(token.strip().encode(), key.get_secret_value().encode()):
        raise APIError(
            401,
            "Incorrect API key provided.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
