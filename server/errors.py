"""Errors as one exception type, ``APIError``, whatever the API.

Every failure a handler can detect (bad JSON, a field out of range, an unknown model, a full
queue) is raised as ``APIError``; the adapter registry (``server.adapters``) answers it in the shape
of the API the request's path belongs to — OpenAI's ``{"error": {"message", "type", "param",
"code"}}`` (``APIError.body``) unless the adapter has its own — so clients (both SDKs map status
codes to exception classes) see consistent errors, and nothing a request sends can surface as
an unhandled 500.
"""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # as OpenAI answers it (code "invalid_api_key")
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error to return to the client with ``status`` (in the shape of the request's API)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none", "json-or-python"}


def _is_type_tag(part: object) -> bool:
    """pydantic puts the union member tried ('str', 'list[int]', 'TextPart', a tag such as
    'type:text') into ``loc``; those are not field names and would make ``param`` useless to a
    client."""
    if isinstance(part, int):
        return False
    text = str(part)
    return text in _TYPE_NAMES or any(c in text for c in "[]-'\",:") or text[:1].isupper()


def from_validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """The most specific pydantic error as a 400 whose ``param`` is the dotted field path.

    Most specific: the deepest field (the first of those). A value that fails a union fails
    every member, and the shallowest failure (``input`` is not a string) hides the one that
    says what is wrong (``input.0.type`` is not a string)."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")

    def field(error: Any) -> list[str]:
        return [str(p) for p in error.get("loc", ()) if p != "body" and not _is_type_tag(p)]

    chosen = max(errors, key=lambda error: len(field(error)))
    param = ".".join(field(chosen)) or None
    message = chosen.get("msg", "invalid value")
    if chosen.get("type") == "model_type":  # "... or instance of ChatMessage": our class names
        message = "Input should be an object"
    if param:
        message = f"{param}: {message}"
    return bad_request(message, param=param, code="invalid_value")
