"""The single-worker scheduler (server/core/scheduler.py): order, backpressure,
cancellation, and that one failing request never takes the worker down."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fake_engine import OneAtATime

from engine.api import GenerationEvent, GenerationRequest, GenerationStats, RequestError
from sampling.params import SamplingParams
from server.core.scheduler import (
    GenerationFailedError,
    QueueFullError,
    Scheduler,
    SchedulerClosedError,
)

pytestmark = pytest.mark.fast  # no model: the whole file is quick

#: a prompt the counting engine refuses as the real one refuses a bad request
REFUSED = -2


class CountingEngine:
    """Emits prompt_ids[0]*1000 + i for i < max_tokens, one token per cycle."""

    def __init__(self, delay: float = 0.0, gate: threading.Semaphore | None = None) -> None:
        self.delay = delay
        #: when set, each cycle waits for one permit (the consumer's pace, not the clock's)
        self.gate = gate
        self.order: list[int] = []
        self.threads: set[int] = set()
        self.active = 0
        self.max_active = 0
        self.polls_after_cancel: dict[int, int] = {}

    def batch(self, capacity: int) -> OneAtATime:
        return OneAtATime(self.generate)

    def generate(
        self, request: GenerationRequest, cancelled: Callable[[], bool] = lambda: False
    ) -> Iterator[GenerationEvent]:
        tag = request.prompt_ids[0]
        self.threads.add(threading.get_ident())
        self.order.append(tag)
        if tag == REFUSED:
            raise RequestError("refused by the engine", "draft_tokens")
        if tag < 0:
            raise RuntimeError(f"bad request {tag}")
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            for i in range(request.max_tokens):
                if self.gate is not None and not self.gate.acquire(timeout=30):
                    raise TimeoutError("the test never released the next cycle")
                if cancelled():
                    yield GenerationEvent([], finish_reason="cancelled")
                    return
                if self.delay:
                    time.sleep(self.delay)
                last = i == request.max_tokens - 1
                yield GenerationEvent(
                    [tag * 1000 + i],
                    finish_reason="length" if last else None,
                    stats=GenerationStats(completion_tokens=i + 1),
                )
        finally:
            self.active -= 1


def req(tag: int, n: int = 3) -> GenerationRequest:
    return GenerationRequest(prompt_ids=[tag], sampling=SamplingParams(temperature=0), max_tokens=n)


async def collect(handle) -> list[int]:
    out: list[int] = []
    async for event in handle:
        out.extend(event.token_ids)
    return out


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def make(engine, **kw) -> Scheduler:
    s = Scheduler(lambda: engine, **kw)
    s.start()
    s.wait_ready(10)
    return s


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll observable state (never a fixed sleep standing in for another thread's progress)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_fifo_order_and_single_worker_thread() -> None:
    engine = CountingEngine(delay=0.001)
    sched = make(engine)

    async def main() -> list[list[int]]:
        handles = [h for t in range(1, 6) for h in sched.submit([req(t)])]
        return await asyncio.gather(*(collect(h) for h in handles))

    results = run(main())
    sched.shutdown()
    assert results == [[t * 1000, t * 1000 + 1, t * 1000 + 2] for t in range(1, 6)]
    assert engine.order == [1, 2, 3, 4, 5]
    assert len(engine.threads) == 1 and threading.get_ident() not in engine.threads
    assert engine.max_active == 1


def test_engine_is_built_on_the_worker_thread() -> None:
    built_on: list[int] = []

    def factory() -> CountingEngine:
        built_on.append(threading.get_ident())
        return CountingEngine()

    sched = Scheduler(factory)
    sched.start()
    engine = sched.wait_ready(10)

    async def main() -> list[int]:
        return await collect(sched.submit([req(1)])[0])

    assert run(main()) == [1000, 1001, 1002]
    assert built_on == list(engine.threads)
    sched.shutdown()


def test_load_failure_is_reported() -> None:
    def factory() -> CountingEngine:
        raise FileNotFoundError("no such model")

    sched = Scheduler(factory)
    sched.start()
    with pytest.raises(FileNotFoundError):
        sched.wait_ready(10)
    assert not sched.alive

    async def main() -> None:
        sched.submit([req(1)])

    with pytest.raises(SchedulerClosedError):
        run(main())


def test_queue_full_rejects_whole_batch() -> None:
    engine = CountingEngine(delay=0.02)
    sched = make(engine, max_queue=3, retry_after=2.0)

    async def main() -> None:
        first = sched.submit([req(1, 10_000)])  # runs until cancelled
        await until(lambda: sched.running > 0)
        sched.submit([req(2), req(3)])  # 2 waiting
        with pytest.raises(QueueFullError) as info:
            sched.submit([req(4), req(5)])  # would be 4 waiting > 3
        assert info.value.retry_after == 2.0
        more = sched.submit([req(6)])  # exactly 3 waiting
        first[0].cancel()
        await collect(more[0])

    run(main())
    sched.shutdown()
    assert 4 not in engine.order and 5 not in engine.order


def test_cancel_running_request_stops_within_a_cycle() -> None:
    """The engine runs one cycle per token the consumer has read (a gate), so it cannot run
    ahead of a slow consumer: the cancel is seen at the very next poll."""
    gate = threading.Semaphore(1)
    engine = CountingEngine(gate=gate)
    sched = make(engine)

    async def main() -> tuple[list[int], list[int]]:
        long, nxt = sched.submit([req(1, 10_000), req(2)])
        got: list[int] = []
        async for event in long:
            got.extend(event.token_ids)
            if len(got) == 3:
                long.cancel()
            gate.release()
        for _ in range(3):  # the next request's cycles
            gate.release()
        return got, await collect(nxt)

    got, nxt = run(main())
    sched.shutdown()
    assert got == [1000, 1001, 1002]  # cancelled at the first poll after the flag was set
    assert nxt == [2000, 2001, 2002]


def test_cancel_while_queued_never_runs() -> None:
    engine = CountingEngine(delay=0.01)
    sched = make(engine)

    async def main() -> list[int]:
        a, b, c = sched.submit([req(1, 5), req(2, 5), req(3, 2)])
        b.cancel()
        assert await collect(b) == []
        await collect(a)
        return await collect(c)

    assert run(main()) == [3000, 3001]
    sched.shutdown()
    assert engine.order == [1, 3]


def test_failure_reaches_only_its_request_and_worker_survives() -> None:
    engine = CountingEngine()
    sched = make(engine)

    async def main() -> list[int]:
        bad, good = sched.submit([req(-1), req(7)])
        with pytest.raises(GenerationFailedError) as info:
            await collect(bad)
        assert isinstance(info.value.error, RuntimeError)
        return await collect(good)

    assert run(main()) == [7000, 7001, 7002]
    assert sched.alive and sched.failed == 1
    sched.shutdown()


def test_a_refused_request_is_logged_as_no_fault(caplog: pytest.LogCaptureFixture) -> None:
    """A request the engine refuses reaches its client as that error (a 400 in the server),
    and the log says so without an error or a traceback: the client's mistake is not the
    server's fault."""
    sched = make(CountingEngine())

    async def main() -> list[int]:
        refused, good = sched.submit([req(REFUSED), req(7)])
        with pytest.raises(GenerationFailedError) as info:
            await collect(refused)
        assert isinstance(info.value.error, RequestError)
        return await collect(good)

    with caplog.at_level(logging.INFO):
        assert run(main()) == [7000, 7001, 7002]
    sched.shutdown()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("rejected: refused by the engine" in r.getMessage() for r in caplog.records)


def test_abandoned_handle_does_not_block_the_worker() -> None:
    """A caller that stops reading (its loop ended) must not wedge the worker."""
    engine = CountingEngine()
    sched = make(engine)

    async def first() -> None:
        sched.submit([req(1, 50)])

    run(first())  # loop closes with the request unread

    async def second() -> list[int]:
        return await collect(sched.submit([req(2)])[0])

    assert run(second()) == [2000, 2001, 2002]
    sched.shutdown()


def test_shutdown_ends_pending_handles() -> None:
    engine = CountingEngine(delay=0.01)
    sched = make(engine)

    async def main() -> list[int]:
        a, b = sched.submit([req(1, 10_000), req(2)])
        await until(lambda: sched.running > 0)
        await asyncio.to_thread(sched.shutdown)
        await collect(a)
        return await collect(b)

    assert run(main()) == []
    assert not sched.alive


def test_scheduler_does_not_import_mlx() -> None:
    import server.core.scheduler  # noqa: F401

    assert "server.core.scheduler" in sys.modules
    # importing the scheduler (and the server) alone must not pull mlx in
    import subprocess

    code = "import server.core.scheduler, server.app, sys; print('mlx' in sys.modules)"
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root
    )
    assert out.stdout.strip() == "False"


def test_a_request_cancelled_in_the_queue_leaves_it_at_once() -> None:
    """Cancelling a queued request frees its place in ``max_queue`` right away: a new request
    fits where it did not, the cancelled one ends without ever reaching the engine."""
    engine = CountingEngine(delay=0.02)
    sched = make(engine, max_queue=2)

    async def main() -> None:
        first = sched.submit([req(1, 10_000)])  # runs until cancelled
        await until(lambda: sched.running > 0)
        waiting = sched.submit([req(2), req(3)])
        with pytest.raises(QueueFullError):
            sched.submit([req(4)])
        waiting[0].cancel()
        assert sched.queue_depth == 1
        assert await collect(waiting[0]) == []
        later = sched.submit([req(5)])  # fits now
        first[0].cancel()
        assert await collect(later[0]) == [5000, 5001, 5002]

    run(main())
    sched.shutdown()
    assert 2 not in engine.order and 4 not in engine.order


#: A server stopped just before its process exits: the worker thread ran mlx-compiled code (the
#: engine's blocks, kept on the model) and ends while the interpreter finalizes.
STOPPED_AT_EXIT = """
import asyncio, sys, time
import mlx.core as mx
from engine.api import GenerationEvent, GenerationRequest
from server.core.scheduler import Scheduler
from sampling.params import SamplingParams

block = mx.compile(lambda x: (mx.exp(x) + 1, {"half": x / 2}))  # kept, as the engine's are


class CompilingEngine:
    capacity = 1

    def batch(self, capacity):
        self.rows = set()
        return self

    def __len__(self):
        return len(self.rows)

    def __contains__(self, key):
        return key in self.rows

    def add(self, key, request, cancelled):
        self.rows.add(key)

    def drop(self, key):
        self.rows.discard(key)

    def step(self):
        mx.eval(block(mx.ones(4))[0])
        return [(key, GenerationEvent([1], finish_reason="length")) for key in self.rows.copy()]


class BlocksInFinalization:  # releases the GIL after finalizing began, as closing files do
    def __del__(self, sleep=time.sleep):
        sleep(0.2)


sys.setswitchinterval(5.0)  # the main thread keeps the GIL until it blocks
holder = BlocksInFinalization()
sched = Scheduler(CompilingEngine)
sched.start()
sched.wait_ready(10)


async def main():
    request = GenerationRequest([1], SamplingParams(temperature=0), 1)
    async for _ in sched.submit([request])[0]:
        pass


asyncio.run(main())
sched.shutdown()
"""


def test_a_server_stopped_as_its_process_exits_exits_cleanly(tmp_path: Path) -> None:
    """mlx keeps a compile cache per thread whose entries hold Python objects; freed by the
    worker thread's exit once the interpreter is finalizing, they aborted the process
    ("terminate called without an active exception", status 134: 3 runs in 4 here). The
    worker frees them itself before it ends (``engine.model.memory.release_thread``)."""
    script = tmp_path / "stopped_at_exit.py"
    script.write_text(STOPPED_AT_EXIT)
    root = Path(__file__).resolve().parents[2]
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, str(script)], cwd=root, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr


class FailingCleanupBatch:
    """A batch whose cycle fails once and whose row clean-up then raises too (the row's
    snapshot for the conversation cache, say, on a full disk)."""

    capacity = 4

    def __init__(self, engine: CountingEngine) -> None:
        self.rows: dict[int, Iterator[GenerationEvent]] = {}
        self.engine = engine
        self.failed_once = False

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, key: int) -> bool:
        return key in self.rows

    def add(self, key: int, request: GenerationRequest, cancelled: Callable[[], bool]) -> None:
        self.rows[key] = iter(self.engine.generate(request, cancelled))

    def drop(self, key: int) -> None:
        self.rows.pop(key, None)
        raise OSError(28, "No space left on device")

    def step(self) -> list[tuple[int, GenerationEvent | BaseException]]:
        if not self.failed_once:
            self.failed_once = True
            raise RuntimeError("a batched cycle failed")
        out: list[tuple[int, GenerationEvent | BaseException]] = []
        for key, events in list(self.rows.items()):
            try:
                out.append((key, next(events)))
            except StopIteration:
                del self.rows[key]
        return out


def test_a_failing_row_cleanup_never_ends_the_worker() -> None:
    engine = CountingEngine()
    engine.batch = lambda capacity: FailingCleanupBatch(engine)  # type: ignore[attr-defined]
    sched = make(engine, max_batch=4)

    async def main() -> list[int]:
        (first,) = sched.submit([req(3)])
        with pytest.raises(GenerationFailedError):
            await collect(first)
        (second,) = sched.submit([req(7)])
        return await collect(second)

    assert run(main()) == [7000, 7001, 7002]
    assert sched.alive
    sched.shutdown()


def test_a_generation_is_counted_before_its_last_event_reaches_the_reader(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The finish hook (the server's /metrics) runs before the final event is handed to the
    reader: a client that has read its whole reply finds its generation counted, whatever the
    threads' timing (a server test once scraped /metrics between the two)."""
    from server.core import scheduler as scheduler_module

    order: list[str] = []
    post = scheduler_module.RequestHandle._post

    def recording_post(self, item) -> bool:
        if isinstance(item, GenerationEvent) and item.finish_reason is not None:
            order.append("final event posted")
        return post(self, item)

    monkeypatch.setattr(scheduler_module.RequestHandle, "_post", recording_post)
    sched = Scheduler(
        lambda: CountingEngine(),
        on_finished=lambda handle, last, error: order.append("counted"),
    )
    sched.start()
    sched.wait_ready(10)

    async def main() -> list[list[int]]:
        handles = [h for t in (1, 2) for h in sched.submit([req(t)])]
        return await asyncio.gather(*(collect(h) for h in handles))

    assert run(main()) == [[1000, 1001, 1002], [2000, 2001, 2002]]
    sched.shutdown()
    assert order == ["counted", "final event posted"] * 2
