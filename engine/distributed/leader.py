"""Rank 0's side of the group: the queue and broadcast of cache operations (``Leader``), the
trunk cache that mirrors itself on the followers (``LeaderTrunkCache``), and losing the group
(the watchdog, the stop of the process)."""

from __future__ import annotations

import atexit
import collections
import itertools
import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from engine.api import EngineUnavailable
from engine.distributed.measure import gather_memory, time_collectives
from engine.distributed.protocol import (
    INLINE_TOKENS,
    MAX_OPS,
    OP_COMMIT,
    OP_DROP,
    OP_FORWARD,
    OP_MEMORY,
    OP_NEW,
    OP_PROBE,
    OP_RESTORE,
    OP_SHUTDOWN,
    OP_SNAPSHOT,
)
from engine.model import products
from engine.model.trunk import TrunkCache

log = logging.getLogger("mtpserve.distributed")


DEFAULT_TIMEOUT_S = 120.0
#: after a loss: time for the 503s to reach the clients before the process stops
EXIT_GRACE_S = 1.0

_lost: str | None = None


def lost_message() -> str | None:
    """Why the group was lost (None while it works): the CLI's exit status."""
    return _lost


def clear_lost() -> None:
    """Forget a loss: a ``Leader`` made outside a group (a test) leaves the process usable."""
    global _lost
    _lost = None


class Leader:
    """Rank 0's side: queues cache operations and sends them with the next forward."""

    def __init__(self, group: Any, timeout: float, stop: Callable[[], None] | None = None) -> None:
        self.group = group
        self._stop = stop or _stop_process
        self.timeout = timeout
        self._ops: collections.deque[tuple[int, int, int, int]] = collections.deque()
        self._cache_ids = itertools.count(1)
        self._snapshot_ids = itertools.count(1)
        self.messages = 0
        self.last_progress = time.monotonic()
        self.active = 0  # generations running (the watchdog watches only then)
        self.on_lost: list[Callable[[BaseException], None]] = []
        self._lock = threading.Lock()
        self._closed = False
        self.weight_bytes = 0  # rank 0's, once loaded
        #: the last collective (or forward) rank 0 issued: the next one depends on it
        self._tail: mx.array | None = None

    # bookkeeping called by LeaderTrunkCache --------------------------------------------------
    def new_cache_id(self) -> int:
        cid = next(self._cache_ids)
        self._ops.append((OP_NEW, cid, 0, 0))
        return cid

    def queue(self, code: int, cid: int, a: int = 0, b: int = 0) -> None:
        self._ops.append((code, cid, a, b))

    def new_snapshot_id(self) -> int:
        return next(self._snapshot_ids)

    def progress(self) -> None:
        self.last_progress = time.monotonic()

    # messages ----------------------------------------------------------------------------------
    def _header(self, ops: list[tuple[int, int, int, int]]) -> list[int]:
        flat = [len(ops)]
        for op in ops:
            flat.extend(op)
        return flat + [0] * (1 + 4 * MAX_OPS - len(flat))

    def collective(self, fn: Callable[..., mx.array], x: mx.array) -> mx.array:
        """``fn(x, group=...)`` after every collective rank 0 issued before it.

        Rank 0 builds its graph lazily and mlx evaluates independent branches in an order of
        its own; the followers run their collectives in the order of rank 0's messages. Making
        each collective depend on the one before (and on the last forward's output) keeps the
        two orders the same."""
        if self._tail is not None:
            x = mx.depends(x, self._tail)
        self._tail = fn(x, group=self.group)
        return self._tail

    def forwarded(self, hidden: mx.array) -> mx.array:
        """A forward's output: the next collective comes after its per-layer collectives."""
        self._tail = hidden
        return hidden

    def _broadcast(self, values: mx.array) -> mx.array:
        self.messages += 1
        return self.collective(mx.distributed.all_sum, values)

    def _take(self, room: int) -> list[tuple[int, int, int, int]]:
        return [self._ops.popleft() for _ in range(min(room, len(self._ops)))]

    def flush(self, extra: tuple[int, int, int, int] | None = None) -> None:
        """Send every queued operation (and ``extra``) now, waiting for the collective."""
        self.check_alive()
        while len(self._ops) > MAX_OPS - 1:
            self.flush_some()
        ops = self._take(MAX_OPS - 1) + ([extra] if extra is not None else [])
        message = mx.array(self._header(ops) + [0] * INLINE_TOKENS, dtype=mx.int32)
        mx.eval(self._broadcast(message))
        self.progress()

    def announce(
        self, op: tuple[int, int, int, int], token_ids: mx.array | None = None
    ) -> mx.array | None:
        """Send the queued operations and ``op`` (a forward, or a step on the vocabulary
        tables) with its ``token_ids [1, n]`` (``n`` = ``op[2]``); return the tokens as the
        broadcast carries them, which is what rank 0 must compute with."""
        self.check_alive()
        while len(self._ops) > MAX_OPS - 1:
            self.flush_some()
        ops = self._take(MAX_OPS - 1) + [op]
        header = mx.array(self._header(ops), dtype=mx.int32)
        self.progress()
        n = 0 if token_ids is None else token_ids.shape[1]
        if n <= INLINE_TOKENS:
            tokens = [] if token_ids is None else [token_ids.reshape(-1).astype(mx.int32)]
            pad = mx.zeros((INLINE_TOKENS - n,), dtype=mx.int32)
            # Not evaluated asynchronously: the chain makes the next evaluated collective send
            # it, and mlx's async eval of a collective can block for good when a rank dies.
            message = self._broadcast(mx.concatenate([header, *tokens, pad]))
            start = 1 + 4 * MAX_OPS
            return None if token_ids is None else message[start : start + n][None]
        # A prefill chunk: the header says how long; the tokens follow as a second collective.
        self._broadcast(mx.concatenate([header, mx.zeros((INLINE_TOKENS,), mx.int32)]))
        received = self._broadcast(token_ids.reshape(-1).astype(mx.int32))
        return received[None]

    def flush_some(self) -> None:
        ops = self._take(MAX_OPS)
        message = mx.array(self._header(ops) + [0] * INLINE_TOKENS, dtype=mx.int32)
        mx.eval(self._broadcast(message))

    def memory_per_rank(self) -> list[dict[str, Any]]:
        """Peak and active memory of every rank (bytes) and the followers' clocks
        (``FollowerClock``), gathered with one collective."""
        self.flush((OP_MEMORY, 0, 0, 0))
        return gather_memory(self.group, self.weight_bytes)

    def probe_collectives(
        self, positions: int, hidden: int, dtype: Any, reps: int, gather: bool = False
    ) -> float:
        """Seconds per ``all_sum`` of ``[1, positions, hidden]`` (what a layer sends), or with
        ``gather`` per ``all_gather`` of that much from every rank (a logits shard)."""
        kind = {mx.int32: 1}.get(dtype, 0) + 2 * gather
        self.flush((OP_PROBE, hidden, positions, reps * 4 + kind))
        return time_collectives(self.group, positions, hidden, dtype, reps, gather)

    def shutdown(self) -> None:
        """Tell the followers to exit (best effort: a lost group has nobody to tell)."""
        with self._lock:
            if self._closed or _lost is not None:
                return
            self._closed = True
        try:
            self.flush((OP_SHUTDOWN, 0, 0, 0))
        except Exception as exc:  # the followers may be gone already
            log.warning("could not tell the followers to stop: %s", exc)

    # failure -----------------------------------------------------------------------------------
    def check_alive(self) -> None:
        if _lost is not None:
            raise EngineUnavailable(_lost)

    def lose(self, why: str) -> EngineUnavailable:
        """Mark the group lost (once), fail what waits, and stop the process shortly after."""
        global _lost
        with self._lock:
            first = _lost is None
            if first:
                _lost = (
                    f"a rank of the distributed group ({self.group.size()} ranks) failed or "
                    f"cannot be reached ({why}); this server is shutting down"
                )
        error = EngineUnavailable(_lost)
        if first:
            log.error("%s", _lost)
            for callback in list(self.on_lost):
                try:
                    callback(error)
                except Exception:
                    log.exception("on_lost callback failed")
            threading.Thread(target=self._stop, name="mtpserve-stop", daemon=True).start()
        return error

    def watch(self) -> None:
        """Watchdog: a generation with no progress for ``timeout`` seconds means a peer hangs."""
        stop = threading.Event()

        def run() -> None:
            while not stop.wait(min(1.0, self.timeout / 4)):
                if _lost is not None:
                    return
                idle = time.monotonic() - self.last_progress
                if self.active and idle > self.timeout:
                    self.lose(f"no answer for {idle:.0f}s")
                    return

        threading.Thread(target=run, name="mtpserve-watchdog", daemon=True).start()
        atexit.register(stop.set)


def _stop_process() -> None:
    """SIGTERM ourselves (uvicorn then shuts down gracefully); a hard exit as the backstop
    when a thread stuck in a collective keeps the interpreter from finishing."""
    time.sleep(EXIT_GRACE_S)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(15.0)
    os._exit(1)


class LeaderTrunkCache(TrunkCache):
    """Rank 0's trunk cache: every operation is mirrored on the followers' caches."""

    def __init__(self, trunk: Any, leader: Leader) -> None:
        super().__init__(trunk)
        self.leader = leader
        self.cache_id = leader.new_cache_id()
        weakref.finalize(self, leader.queue, OP_DROP, self.cache_id)

    def embed(self, trunk: Any, token_ids: mx.array, capture: bool) -> mx.array:
        op = (OP_FORWARD, self.cache_id, token_ids.shape[1], int(capture))
        return products.activations(
            trunk.model.embed_tokens.lookup(self.leader.announce(op, token_ids))
        )

    def forwarded(self, hidden: mx.array) -> mx.array:
        return self.leader.forwarded(hidden)

    def commit(self, n_keep: int, n_fed: int) -> None:
        self.leader.queue(OP_COMMIT, self.cache_id, n_keep, n_fed)
        super().commit(n_keep, n_fed)

    def snapshot(self) -> list[tuple[Any, ...]]:
        sid = self.leader.new_snapshot_id()
        self.leader.queue(OP_SNAPSHOT, self.cache_id, sid)
        return _Snapshot(super().snapshot(), sid)

    def restore(self, snapshot: list[tuple[Any, ...]]) -> None:
        self.leader.queue(OP_RESTORE, self.cache_id, snapshot.sid)
        super().restore(snapshot)


class _Snapshot(list):
    def __init__(self, items: list[tuple[Any, ...]], sid: int) -> None:
        super().__init__(items)
        self.sid = sid
