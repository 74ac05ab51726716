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
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.api import GenerationEvent, GenerationRequest, RequestError, release_worker_thread

logger = logging.getLogger(__name__)


class Batch(Protocol):
    """Rows decoding together (``engine.scheduling.batching.BatchDecoder``; a request alone
    is a batch of one): the worker adds requests, steps the batch and delivers its events."""

    capacity: int

    def __len__(self) -> int: ...

    def __contains__(self, key: Hashable) -> bool: ...

    def add(
        self, key: Hashable, request: GenerationRequest, cancelled: Callable[[], bool]
    ) -> None: ...

    def drop(self, key: Hashable) -> None: ...

    def step(self) -> list[tuple[Hashable, GenerationEvent | BaseException]]: ...


class EngineLike(Protocol):
    def batch(self, capacity: int) -> Batch: ...


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
    _withdraw: Callable[[RequestHandle], None] | None = None
    enqueued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    finished: bool = False

    def cancel(self) -> None:
        """Ask the engine to stop at its next decode cycle (thread-safe, idempotent); a
        request still queued leaves the queue now."""
        self._cancel.set()
        if self._withdraw is not None:
            self._withdraw(self)

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
        max_batch: int = 1,
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
        self.max_batch = max_batch
        #: the requests decoding now, by request id (worker thread; read under ``_cond``)
        self._rows: dict[int, RequestHandle] = {}
        self._last: dict[int, GenerationEvent] = {}
        self._grace: dict[int, int] = {}
        #: most requests that decoded together so far
        self.peak_running = 0
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
            for handle in self._rows.values():
                handle.cancel()
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
            handles = list(self._rows.values()) + handles
            self._cond.notify_all()
        for handle in handles:
            handle.cancel()
            handle._post(_Failure(error))

    # submission (event-loop side) --------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    @property
    def running(self) -> int:
        """Requests decoding now (rows of the batch)."""
        return len(self._rows)

    def _withdraw(self, handle: RequestHandle) -> None:
        """A request cancelled while queued leaves the queue at once (and stops counting
        against ``max_queue``); its consumer sees the end of its events."""
        with self._cond:
            try:
                self._pending.remove(handle)
            except ValueError:
                return  # already running (the engine sees the flag) or finished
        self._finished(handle, None, None)  # counted before its reader sees the end (_end)
        handle._post(_END)

    def submit(self, requests: list[GenerationRequest]) -> list[RequestHandle]:
        """Queue all of ``requests`` atomically (all or none); must run on the event loop."""
        loop = asyncio.get_running_loop()
        with self._cond:
            if self._closing or self.load_error is not None:
                raise SchedulerClosedError("the server is shutting down")
            if len(self._pending) + len(requests) > self.max_queue:
                raise QueueFullError(self.retry_after)
            handles = [
                RequestHandle(
                    request=r, request_id=next(self._ids), _loop=loop, _withdraw=self._withdraw
                )
                for r in requests
            ]
            self._pending.extend(handles)
            self._cond.notify()
        return handles

    # worker --------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # never a silent death that leaves the queue waiting
            logger.exception("the engine's worker thread failed")
            self.abort(exc)
        finally:
            release_worker_thread()

    def _serve(self) -> None:
        try:
            self.engine = self._engine_factory()
        except BaseException as exc:  # report, never die silently; wait_ready re-raises it
            logger.error("engine failed to load: %s: %s", type(exc).__name__, exc)
            self.load_error = exc
            self._ready.set()
            return
        self._ready.set()
        batch = self.engine.batch(self.max_batch)  # its capacity: at most max_batch rows
        while True:
            with self._cond:
                while not self._pending and not self._rows and not self._closing:
                    self._cond.wait()
                if self._closing:
                    for handle in self._rows.values():
                        self._drop(batch, handle.request_id)
                        handle._post(_END)
                    self._rows.clear()
                    return
                # FIFO admission into free rows; a newcomer starts at this very step.
                while self._pending and len(self._rows) < batch.capacity:
                    handle = self._pending.popleft()
                    handle.started_at = time.monotonic()
                    self._rows[handle.request_id] = handle
                    self.peak_running = max(self.peak_running, len(self._rows))
                    batch.add(handle.request_id, handle.request, handle.is_cancelled)
            self._step(batch)

    def _step(self, batch: Batch) -> None:
        """One step of the batch; deliver its events, finish the rows that ended."""
        try:
            events = batch.step()
        except Exception as exc:  # the batch itself failed: every row it held fails
            logger.exception("a batched cycle failed")
            events = [(key, exc) for key in list(self._rows)]
            for key in list(self._rows):
                self._drop(batch, key)
        for key, item in events:
            handle = self._rows.get(key)
            if handle is None:
                continue
            if isinstance(item, BaseException):
                self._end(batch, handle, error=item)
                continue
            self._last[key] = item
            if item.finish_reason is not None:
                self._end(batch, handle, final=item)
            elif not handle._post(item):  # False: nobody reads any more
                self._end(batch, handle)
        for key, handle in list(self._rows.items()):
            if key not in batch:
                self._end(batch, handle)
            elif handle.cancelled:
                # The engine polls ``cancelled()`` before each cycle and ends the row with
                # "cancelled" (its caches consistent, its stats complete), so it gets one more
                # step; dropping the row is the backstop for an engine that does not poll.
                self._grace[key] = self._grace.get(key, 1) - 1
                if self._grace[key] < 0:
                    self._end(batch, handle)

    def _end(
        self,
        batch: Batch,
        handle: RequestHandle,
        error: BaseException | None = None,
        final: GenerationEvent | None = None,
    ) -> None:
        """Drop a row and tell its reader it ended: with ``final`` (its last event, posted
        here), a failure, or the end of a stream that had no final event. The finish hook
        (the server's metrics) runs first, so that a client that has read its reply finds
        the generation counted in /metrics."""
        key = handle.request_id
        with self._cond:
            self._rows.pop(key, None)
        self._grace.pop(key, None)
        last = self._last.pop(key, None)
        if key in batch:
            self._drop(batch, key)
        if error is not None:
            if isinstance(error, RequestError):  # answered as a 400: the client's to fix
                logger.info("generation %d rejected: %s", key, error)
            else:
                logger.error("generation %d failed: %s", key, error)
            self.failed += 1
        else:
            self.completed += 1
        self._finished(handle, last, error)
        if error is not None:
            handle._post(_Failure(error))
        elif final is not None:
            handle._post(final)
        elif last is None or last.finish_reason is None:
            handle._post(_END)

    @staticmethod
    def _drop(batch: Batch, key: int) -> None:
        """Remove a row; a failure there (the row's clean-up) must not end the worker."""
        try:
            batch.drop(key)
        except Exception:
            logger.exception("removing generation %s from the batch failed", key)

    def _finished(
        self, handle: RequestHandle, last: GenerationEvent | None, error: BaseException | None
    ) -> None:
        if self._on_finished is None:
            return
        with contextlib.suppress(Exception):
            self._on_finished(handle, last, error)
