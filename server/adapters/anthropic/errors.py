"""Anthropic's error shape: ``{"type": "error", "error": {"type", "message"}}`` with
Anthropic's type names (its SDK maps them, and the status, to exception classes)."""

from __future__ import annotations

from typing import Any

from server.errors import APIError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def error_body(error: APIError) -> dict[str, Any]:
    kind = _TYPES.get(error.status)
    if kind is None:
        kind = "api_error" if error.status >= 500 else "invalid_request_error"
    message = error.message
    if error.param and not message.startswith(f"{error.param}:"):
        message = f"{error.param}: {message}"  # Anthropic's shape has no separate param
    return {"type": "error", "error": {"type": kind, "message": message}}
