"""``create_app(engine, settings)``: the FastAPI application.

``engine`` is either a loaded engine (tests, embedding) or a zero-argument factory that loads one
(``mtpserve serve``). Either way the scheduler's worker thread is the only thread that runs it,
and a factory runs *on* that thread during the lifespan startup, so the model is loaded once,
before the first request, and no mlx object ever crosses threads. This module imports neither
mlx nor ``engine.runtime``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.api import GenerationEvent, RequestError
from server import adapters
from server.core.http import openapi_schema
from server.core.scheduler import RequestHandle, Scheduler
from server.guard import RequestGuard, startup_warning
from server.metrics import ServerMetrics
from server.page import router as page_router
from server.settings import ServerSettings
from server.state import ServerState

logger = logging.getLogger(__name__)

#: the server's own endpoints' metric labels (the adapters name theirs: ``server.adapters``)
_OWN_ENDPOINTS = {"/health": "health", "/metrics": "metrics"}


class MetricsMiddleware:
    """Counts requests by endpoint and status and times them (pure ASGI: it must not get in the
    way of streaming or of disconnect detection the way BaseHTTPMiddleware would)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = _OWN_ENDPOINTS.get(path) or adapters.endpoint_label(path)
        status = 500
        start = time.monotonic()

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.request_seconds.labels(endpoint).observe(time.monotonic() - start)


def create_app(engine: Any | Callable[[], Any], settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    factory: Callable[[], Any] = engine if _is_factory(engine) else (lambda: engine)
    metrics = ServerMetrics()

    def on_finished(
        handle: RequestHandle, last: GenerationEvent | None, error: BaseException | None
    ) -> None:
        if handle.started_at is not None:
            metrics.queue_seconds.observe(handle.started_at - handle.enqueued_at)
        if error is None:
            outcome = last.finish_reason if last is not None and last.finish_reason else "cancelled"
        else:  # refused by the engine (a 400: the client's to fix), or failed
            outcome = "rejected" if isinstance(error, RequestError) else "error"
        metrics.generations.labels(outcome).inc()
        if last is not None:
            metrics.record_stats(last.stats)

    scheduler = Scheduler(
        factory,
        max_queue=settings.max_queue,
        max_batch=settings.max_batch,
        retry_after=settings.retry_after_seconds,
        on_finished=on_finished,
    )
    metrics.bind_scheduler(lambda: scheduler.queue_depth, lambda: scheduler.running)
    state = ServerState(
        settings=settings,
        scheduler=scheduler,
        metrics=metrics,
        sampling_layer=settings.sampling_overrides(),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        warning = startup_warning(settings)
        if warning is not None:
            logger.warning("%s", warning)
        scheduler.start()
        loaded = await scheduler.wait_ready_async()  # raises (and aborts startup) on failure
        state.attach_engine(loaded)
        if hasattr(loaded, "on_lost"):  # a sharded engine that lost a rank fails the queue
            loaded.on_lost.append(scheduler.abort)
        metrics.bind_prompt_cache(
            lambda: cache.describe() if (cache := getattr(loaded, "prefix_cache", None)) else None
        )
        logger.info("serving %s as %s", loaded.model_dir, state.names)
        try:
            yield
        finally:
            scheduler.shutdown()

    app = FastAPI(
        title="mtpserve",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    app.openapi = lambda: openapi_schema(app)  # type: ignore[method-assign]
    app.state.mtp = state
    adapters.install(app)
    app.include_router(page_router)
    app.add_middleware(RequestGuard, settings=settings)
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # outermost: counts refusals too

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        st: ServerState = request.app.state.mtp
        if st.engine is None or not st.scheduler.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse(
            {
                "status": "ok",
                "model": st.names[0],
                "queue_depth": st.scheduler.queue_depth,
                "running": st.scheduler.running,
            }
        )

    @app.get("/metrics")
    async def prometheus_metrics(request: Request) -> Response:
        st: ServerState = request.app.state.mtp
        return Response(st.metrics.render(), media_type=st.metrics.content_type)

    return app


def _is_factory(obj: Any) -> bool:
    """A loaded engine has ``generate``; anything else callable is a factory."""
    return callable(obj) and not hasattr(obj, "generate")
