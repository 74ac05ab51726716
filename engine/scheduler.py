"""The one worker thread that owns the engine, and the bridge from it to asyncio.

Why a single thread: the engine (mlx arrays, caches, compiled functions) is not thread-safe and
mlx work should stay on one thread, so every generation runs, one after another, on the worker
created here. The engine is even *built* on that thread (``engine_factory``) so no mlx object
crosses threads. HTTP handlers never touch the engine: they ``submit()`` requests and iterate
the returned ``RequestHandle`` asynchronously.

Guarantees:
- **Fair order**: a bounded FIFO queue; requests run in the order they were accepted (the n
  choices of one request are queued together, so they are contiguous).
- **Backpressure**: ``submit`` raises ``QueueFullError`` rather than queueing without bound.
- **Cancellation**: ``RequestHandle.cancel()`` sets a flag that the engine polls once per decode
  cycle through ``cancelled()``; a request cancelled while still queued never starts.
- **Isolation of failures**: an exception inside one generation is delivered to that request's
  handle only; the worker keeps serving the next request.

This module must not import mlx (the engine is duck-typed).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.api import GenerationEvent, GenerationRequest

logger = logging.getLogger(__name__)


class EngineLike(Protocol):
    def generate(
        self, request: GenerationRequest, cancelled: Callable[[], bool] = ...
    ) -> Iterator[GenerationEvent]: ...


class QueueFullError(Exception):
    """The waiting queue is full; the client should retry after ``retry_after`` seconds."""

    def __init__(self, retry_after: float) -> None:
        super().__init__("the request queue is full; retry later")
        self.retry_after = retry_after


class SchedulerClosedError(Exception):
    """The scheduler is shutting down (or its engine failed to load)."""


class GenerationFailedError(Exception):
    """The engine raised while generating this request; ``__cause__`` is the original error."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error) or type(error).__name__)
        self.error = error


_END = object()


@dataclass
class _Failure:
    error: BaseException


@dataclass(eq=False)
class RequestHandle:
    """The caller's side of one queued generation: an async iterator of ``GenerationEvent``.

    Iteration ends after the event with ``finish_reason`` (or when the request was cancelled);
    an engine error is raised from ``__anext__`` as ``GenerationFailedError``.
    """

    request: GenerationRequest
    request_id: int
    _loop: asyncio.AbstractEventLoop
    _queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    _cancel: threading.Event = field(default_factory=threading.Event)
    enqueued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    finished: bool = False

    def cancel(self) -> None:
        """Ask the engine to stop at its next decode cycle (thread-safe, idempotent)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def is_cancelled(self) -> bool:
        """The ``cancelled()`` callback handed to ``engine.generate``."""
        return self._cancel.is_set()

    # worker side ---------------------------------------------------------------------------
    def _post(self, item: Any) -> bool:
        """Hand an item to the event loop; False when the loop is gone (nobody will read)."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
            return True
        except RuntimeError:  # event loop closed
            self._cancel.set()
            return False

    # caller side ---------------------------------------------------------------------------
    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> GenerationEvent:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _END:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, _Failure):
            self.finished = True
            raise GenerationFailedError(item.error) from item.error
        if item.finish_reason is not None:
            self.finished = True
        return item


class Scheduler:
    """Owns the worker thread and the FIFO of pending requests."""

    def __init__(
        self,
        engine_factory: Callable[[], Any],
        *,
        max_queue: int = 64,
        retry_after: float = 1.0,
        on_finished: Callable[[RequestHandle, GenerationEvent | None, BaseException | None], None]
        | None = None,
    ) -> None:
        self._engine_factory = engine_factory
        self.max_queue = max_queue
        self.retry_after = retry_after
        self._on_finished = on_finished
        self._pending: collections.deque[RequestHandle] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count(1)
        self.engine: Any = None
        self.load_error: BaseException | None = None
        self._ready = threading.Event()
        self.running: RequestHandle | None = None
        self.completed = 0
        self.failed = 0

    # lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker; it builds the engine first (see ``wait_ready``)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="mtpserve-engine", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> Any:
        """Block until the engine is built; return it, or raise the load error."""
        if not self._ready.wait(timeout):
            raise TimeoutError("engine did not load in time")
        if self.load_error is not None:
            raise self.load_error
        return self.engine

    async def wait_ready_async(self) -> Any:
        return await asyncio.to_thread(self.wait_ready)

    @property
    def alive(self) -> bool:
        return (
            self._thread is not None
            and self._thread.is_alive()
            and self._ready.is_set()
            and self.load_error is None
            and not self._closing
        )

    def shutdown(self, timeout: float = 10.0) -> None:
        """Cancel everything queued or running and stop the worker."""
        with self._cond:
            self._closing = True
            pending = list(self._pending)
            self._pending.clear()
            if self.running is not None:
                self.running.cancel()
            self._cond.notify_all()
        for handle in pending:
            handle.cancel()
            handle._post(_END)
        if self._thread is not None:
            self._thread.join(timeout)

    def abort(self, error: BaseException) -> None:
        """Fail the running request and every queued one with ``error`` and take no more:
        the engine cannot serve again (a distributed group lost a rank). Does not wait for
        the worker, which may be stuck in a collective that never returns."""
        with self._cond:
            self._closing = True
            handles = list(self._pending)
            self._pending.clear()
            if self.running is not None:
                handles.insert(0, self.running)
            self._cond.notify_all()
        for handle in handles:
            handle.cancel()
            handle._post(_Failure(error))

    # submission (event-loop side) --------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    def submit(self, requests: list[GenerationRequest]) -> list[RequestHandle]:
        """Queue all of ``requests`` atomically (all or none); must run on the event loop."""
        loop = asyncio.get_running_loop()
        with self._cond:
            if self._closing or self.load_error is not None:
                raise SchedulerClosedError("the server is shutting down")
            if len(self._pending) + len(requests) > self.max_queue:
                raise QueueFullError(self.retry_after)
            handles = [
                RequestHandle(request=r, request_id=next(self._ids), _loop=loop) for r in requests
            ]
            self._pending.extend(handles)
            self._cond.notify()
        return handles

    # worker --------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = self._engine_factory()
        except BaseException as exc:  # report, never die silently; wait_ready re-raises it
            logger.error("engine failed to load: %s: %s", type(exc).__name__, exc)
            self.load_error = exc
            self._ready.set()
            return
        self._ready.set()
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                handle = self._pending.popleft()
                self.running = handle
            try:
                self._serve(handle)
            finally:
                with self._cond:
                    self.running = None

    def _serve(self, handle: RequestHandle) -> None:
        """Run one generation to its end, delivering events; never raises."""
        last: GenerationEvent | None = None
        error: BaseException | None = None
        if handle.cancelled:
            handle._post(_END)
            self._finished(handle, None, None)
            return
        handle.started_at = time.monotonic()
        events: Iterator[GenerationEvent] | None = None
        try:
            events = self.engine.generate(handle.request, cancelled=handle.is_cancelled)
            grace = 1
            for event in events:
                last = event
                if not handle._post(event) or event.finish_reason is not None:
                    break
                if handle.cancelled:
                    # The engine polls ``cancelled()`` at the start of its next cycle and ends
                    # with "cancelled" (keeping its caches consistent and its stats complete),
                    # so it gets one more step; closing the iterator is the backstop for an
                    # engine that does not poll.
                    grace -= 1
                    if grace < 0:
                        break
        except Exception as exc:
            logger.exception("generation %d failed", handle.request_id)
            error = exc
        finally:
            if events is not None and hasattr(events, "close"):
                try:
                    events.close()
                except Exception:  # a failing close must not kill the worker
                    logger.exception("closing generation %d failed", handle.request_id)
        if error is not None:
            self.failed += 1
            handle._post(_Failure(error))
        else:
            self.completed += 1
            if last is None or last.finish_reason is None:
                handle._post(_END)
        self._finished(handle, last, error)

    def _finished(
        self, handle: RequestHandle, last: GenerationEvent | None, error: BaseException | None
    ) -> None:
        if self._on_finished is None:
            return
        with contextlib.suppress(Exception):
            self._on_finished(handle, last, error)
