"""The HTTP steps every POST endpoint shares: read and validate the body, answer a job.

Bodies are read by hand (not by FastAPI's body parameter) so the size limit is enforced while
reading and every schema error becomes the endpoint's own 400; the endpoints still publish their
typed request schemas in /openapi.json (``json_body`` below).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from sse_starlette import ServerSentEvent

from server.auth import require_api_key
from server.core.finite import FiniteJSONResponse, loads_strict
from server.core.jobs import Job, StreamEncoder, collect, run_until_disconnect, stream
from server.core.output import OutputDelta
from server.core.sse import EventStream
from server.errors import APIError, bad_request, from_validation_error
from server.state import ServerState

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


def v1_router() -> APIRouter:
    """An adapter's router: under /v1, behind the API key when one is set."""
    return APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])


#: Request models named by ``json_body``; ``openapi_schema`` publishes them as components.
REQUEST_MODELS: dict[str, type[BaseModel]] = {}


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` that documents ``model`` as the endpoint's JSON request body."""
    REQUEST_MODELS[model.__name__] = model
    return {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
            },
        }
    }


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document plus the request bodies' schemas (their nested models included)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    for name, model in REQUEST_MODELS.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components[name] = schema
    app.openapi_schema = doc
    return doc


#: Bodies from this size up are parsed and validated on a worker thread: an 8 MB body takes
#: long enough to stall every open stream if the event loop does it.
LARGE_BODY_BYTES = 1 << 16


async def _off_loop_if_large(size: int, work: Callable[..., T], *args: Any) -> T:
    if size < LARGE_BODY_BYTES:
        return work(*args)
    return await asyncio.to_thread(work, *args)


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object; 413 beyond ``limit`` bytes (checked while reading)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            too_big = int(declared) > limit
        except ValueError:
            raise bad_request("invalid Content-Length header") from None
        if too_big:
            raise APIError(413, f"request body larger than {limit} bytes", code="body_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body larger than {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise bad_request("request body is empty; expected a JSON object", code="invalid_json")
    try:
        data = await _off_loop_if_large(len(raw), loads_strict, raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"invalid JSON body: {exc}", code="invalid_json") from exc
    except RecursionError as exc:  # the parser recurses once per level of nesting
        raise bad_request("invalid JSON body: nested too deeply", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    return data


async def read_body(request: Request, model: type[M]) -> tuple[ServerState, M]:
    """The app state and the validated body; then the engine must be loaded."""
    state: ServerState = request.app.state.mtp
    data = await read_json(request, state.settings.max_body_bytes)
    try:
        body = await _off_loop_if_large(
            int(request.headers.get("content-length") or 0), model.model_validate, data
        )
    except ValidationError as exc:
        raise from_validation_error(exc) from exc
    state.require_engine()
    return state, body


async def respond(
    request: Request,
    job: Job,
    *,
    stream_with: StreamEncoder | None,
    body: Callable[[list[list[OutputDelta]]], dict[str, Any]],
    ping: Callable[[], ServerSentEvent] | None = None,
) -> Response:
    """Stream the job through ``stream_with`` or, without one, collect it and answer
    ``body(deltas per choice)``."""
    if stream_with is not None:
        return EventStream(
            stream(job, stream_with),
            on_close=job.cancel_all,
            ping_seconds=job.state.settings.sse_ping_seconds,
            ping=ping,
        )
    deltas = await run_until_disconnect(request, collect(job), job)
    if deltas is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return FiniteJSONResponse(body(deltas))
