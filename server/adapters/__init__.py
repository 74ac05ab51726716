"""The adapter registry: every API the server speaks, each in its own folder (routes, schemas,
stream, error shape), registered here in one line.

``install(app)`` mounts the adapters' routes and answers every error in the shape of the API
the request's path belongs to (``error_response``); ``endpoint_label`` names a path for the
request metrics.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.adapters import anthropic, openai, vllm
from server.adapters.adapter import Adapter
from server.errors import APIError, from_validation_error

logger = logging.getLogger(__name__)

ADAPTERS: tuple[Adapter, ...] = (openai.ADAPTER, anthropic.ADAPTER, vllm.ADAPTER)


def error_response(error: APIError, path: str) -> JSONResponse:
    """``error`` as the API of ``path`` shapes it (OpenAI's shape where no adapter claims it)."""
    body = error.body()
    for adapter in ADAPTERS:
        if adapter.error_body is not None and adapter.owns(path):
            body = adapter.error_body(error)
            break
    return JSONResponse(body, status_code=error.status, headers=error.headers)


def endpoint_label(path: str) -> str:
    """The metric label of a request path ("other" for paths no adapter serves); an endpoint
    ending in "/" labels every path under it."""
    for adapter in ADAPTERS:
        for endpoint, label in adapter.endpoints.items():
            if path == endpoint or (endpoint.endswith("/") and path.startswith(endpoint)):
                return label
    return "other"


def install(app: FastAPI) -> None:
    """Mount every adapter's routes and the error handlers."""
    for adapter in ADAPTERS:
        for router in adapter.routers:
            app.include_router(router)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(from_validation_error(exc), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        err = APIError(exc.status_code, str(exc.detail), code=code)
        err.headers = dict(exc.headers) if exc.headers else None
        return error_response(err, request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        err = APIError(500, "internal server error", code="internal_error")
        return error_response(err, request.url.path)
