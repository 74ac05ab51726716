"""One model split across processes or machines with ``mx.distributed`` (tensor parallel).

Under ``mlx.launch`` (ring, JACCL or MPI backend) every rank loads only its shard of the trunk
through mlx-lm's own ``Model.shard()`` for qwen3_5: the Gated-DeltaNet and attention projections
and the MLP (or the experts) are split by heads / columns, and each layer ends in an
``all_sum`` (two per layer: after the mixer's output projection and after the MLP's down
projection). The embedding is replicated (every rank embeds its input); the output projection
and the MTP head live on rank 0 only, because only rank 0 looks at logits.

Who decides what (why the ranks cannot diverge):

* **Rank 0 runs the whole engine** — HTTP, scheduler, the speculative cycle, the head, sampling,
  acceptance, auto K, stop conditions. Followers run no sampler, no head, no policy: they hold
  trunk caches and execute trunk forwards.
* **Rank 0 broadcasts every trunk-cache operation, in order.** Every forward over a trunk cache
  on rank 0 first sends one message (an ``all_sum`` of a small int32 vector to which followers
  contribute zeros): the cache operations since the previous message — create, commit
  (``n_keep`` of ``n_fed``: the accepted length), snapshot, restore, drop — and the forward's
  input tokens (for a verify pass: the last token and the K drafts). Rank 0's own forward reads
  its tokens *from the broadcast result*, so the message is in the graph ahead of the forward's
  per-layer collectives, on every rank, in the same order. A follower's cache therefore goes
  through exactly rank 0's sequence of operations with exactly rank 0's tokens; the tokens a
  follower sees are by construction the ones rank 0 sampled and accepted, never recomputed. One
  small collective per cycle (49 int32s), plus the tensor-parallel ones inside the forward.
* The per-position GDN capture and commit (engine.model.trunk) run unchanged on every rank, each on
  its own heads: the capture is per head, so a shard of the heads commits its own shard of the
  state.

A rank that dies or cannot be reached: the ring backend raises at the next collective when a
peer's socket closes ("connection to a peer was lost"); a peer that hangs or whose link is gone
without a reset is caught by a watchdog (no progress for ``MTPSERVE_DISTRIBUTED_TIMEOUT``
seconds, default 120, while a generation runs). Either way rank 0 fails the running and queued
requests with ``EngineUnavailable`` (HTTP 503), then stops the process: a SIGTERM to itself, on
which uvicorn shuts down gracefully and then re-raises it (``generate``/``bench``: the error
propagates, exit status 1). The group cannot be re-formed in-process.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import json
import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.api import EngineUnavailable, GenerationEvent, GenerationRequest
from engine.blas import all_cores
from engine.model import loader
from engine.model.trunk import TrunkCache, trunk_hidden
from engine.runtime import Engine

log = logging.getLogger("mtpserve.distributed")

# Message layout: [n_ops, (code, cache_id, a, b) x MAX_OPS, tokens x INLINE_TOKENS].
OP_NEW, OP_DROP, OP_COMMIT, OP_SNAPSHOT, OP_RESTORE, OP_FORWARD = 1, 2, 3, 4, 5, 6
OP_MEMORY, OP_PROBE, OP_PING, OP_SHUTDOWN = 7, 8, 9, 10
MAX_OPS = 8
INLINE_TOKENS = 16  # verify passes (K+1 <= 9) travel inline; prefill chunks follow separately
MESSAGE_SIZE = 1 + 4 * MAX_OPS + INLINE_TOKENS
#: snapshots a follower keeps per cache (rank 0 restores only its latest look-ahead's)
KEEP_SNAPSHOTS = 4
DEFAULT_TIMEOUT_S = 120.0
#: after a loss: time for the 503s to reach the clients before the process stops
EXIT_GRACE_S = 1.0

_world: Any = None
_world_checked = False
_lost: str | None = None


def world() -> Any | None:
    """The distributed group when this process is one of several ranks, else None."""
    global _world, _world_checked
    if not _world_checked:
        group = mx.distributed.init()
        _world = group if group.size() > 1 else None
        _world_checked = True
    return _world


def rank() -> int:
    group = world()
    return group.rank() if group is not None else 0


def lost_message() -> str | None:
    """Why the group was lost (None while it works): the CLI's exit status."""
    return _lost


def engine_class() -> type[Engine]:
    """``Engine``, or ``DistributedEngine`` on rank 0 of a group."""
    return DistributedEngine if world() is not None else Engine


# -- sharding ------------------------------------------------------------------------------------


def check_shardable(config: dict[str, Any], n: int) -> None:
    """mlx-lm's ``shard()`` splits heads and columns evenly; say which dimension does not."""
    text = config.get("text_config", config)
    dims = {
        "num_attention_heads": text["num_attention_heads"],
        "linear_num_key_heads": text["linear_num_key_heads"],
        "linear_num_value_heads": text["linear_num_value_heads"],
        "intermediate_size": text.get("intermediate_size") or n,
        "moe_intermediate_size": text.get("moe_intermediate_size") or n,
        "shared_expert_intermediate_size": text.get("shared_expert_intermediate_size") or n,
    }
    bad = {k: v for k, v in dims.items() if v % n}
    if bad:
        raise ValueError(f"cannot split this model over {n} ranks: {bad} not divisible by {n}")


def shard_trunk(net: nn.Module, group: Any, keep_output: bool) -> None:
    """Split the trunk with mlx-lm's ``Model.shard`` (lazy: only the shard is ever read).

    The output projection stays whole on the rank that keeps it (``keep_output``: rank 0,
    where the head and the sampler run) and is removed elsewhere; mlx-lm would split it by
    vocabulary and gather the logits, a collective per forward that only rank 0 needs.
    """
    lm = net.language_model
    args = lm.args
    tied = args.tie_word_embeddings
    args.tie_word_embeddings = True  # shard() then leaves lm_head alone
    try:
        net.shard(group)
    finally:
        args.tie_word_embeddings = tied
    if not tied and not keep_output:
        lm.pop("lm_head")


def load_sharded(
    model: str, *, mtp_weights: str | None, dtype: str, memory_limit: int | None = None
) -> loader.LoadedModel:
    """This rank's shard (rank 0: plus the output projection and the head)."""
    group = world()
    lead = group.rank() == 0
    config = json.loads((loader.resolve_model_dir(model) / "config.json").read_text())
    check_shardable(config, group.size())
    return loader.load(
        model,
        mtp_weights=mtp_weights,
        dtype=dtype,
        with_head=lead,
        prepare=lambda net: shard_trunk(net, group, keep_output=lead),
        memory_limit=memory_limit,
        ranks=group.size(),
    )


# -- rank 0: the broadcast of cache operations ---------------------------------------------------


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

    def _broadcast(self, values: mx.array) -> mx.array:
        self.messages += 1
        return mx.distributed.all_sum(values, group=self.group)

    def _take(self, room: int) -> list[tuple[int, int, int, int]]:
        return [self._ops.popleft() for _ in range(min(room, len(self._ops)))]

    def flush(self, extra: tuple[int, int, int, int] | None = None) -> None:
        """Send every queued operation (and ``extra``) now, waiting for the collective."""
        self._check()
        while len(self._ops) > MAX_OPS - 1:
            self.flush_some()
        ops = self._take(MAX_OPS - 1) + ([extra] if extra is not None else [])
        message = mx.array(self._header(ops) + [0] * INLINE_TOKENS, dtype=mx.int32)
        mx.eval(self._broadcast(message))
        self.progress()

    def announce(self, cid: int, token_ids: mx.array, capture: bool) -> mx.array:
        """Send the queued operations and a forward of ``token_ids [1, T]`` over cache
        ``cid``; return the tokens as the broadcast carries them (the forward's input)."""
        self._check()
        while len(self._ops) > MAX_OPS - 1:
            self.flush_some()
        n = token_ids.shape[1]
        ops = self._take(MAX_OPS - 1) + [(OP_FORWARD, cid, n, int(capture))]
        header = mx.array(self._header(ops), dtype=mx.int32)
        tokens = token_ids.reshape(-1).astype(mx.int32)
        self.progress()
        if n <= INLINE_TOKENS:
            pad = mx.zeros((INLINE_TOKENS - n,), dtype=mx.int32)
            message = self._broadcast(mx.concatenate([header, tokens, pad]))
            mx.async_eval(message)  # every announced forward is sent, read or not
            start = 1 + 4 * MAX_OPS
            return message[start : start + n][None]
        # A prefill chunk: the header says how long; the tokens follow as a second collective
        # (rank 0 waits for the first so the two cannot be reordered).
        mx.eval(self._broadcast(mx.concatenate([header, mx.zeros((INLINE_TOKENS,), mx.int32)])))
        received = self._broadcast(tokens)
        mx.async_eval(received)
        return received[None]

    def flush_some(self) -> None:
        ops = self._take(MAX_OPS)
        message = mx.array(self._header(ops) + [0] * INLINE_TOKENS, dtype=mx.int32)
        mx.eval(self._broadcast(message))

    def memory_per_rank(self) -> list[dict[str, Any]]:
        """Peak and active memory of every rank (bytes) and the followers' clocks
        (``FollowerClock``), gathered with one collective."""
        self.flush((OP_MEMORY, 0, 0, 0))
        return _gather_memory(self.group)

    def probe_collectives(self, positions: int, hidden: int, dtype: Any, reps: int) -> float:
        """Seconds per ``all_sum`` of ``[1, positions, hidden]`` (what a layer sends)."""
        kind = {mx.int32: 1}.get(dtype, 0)
        self.flush((OP_PROBE, hidden, positions, reps * 2 + kind))
        return _time_collectives(self.group, positions, hidden, dtype, reps)

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
    def _check(self) -> None:
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

    def announce(self, token_ids: mx.array, capture: bool) -> mx.array:
        return self.leader.announce(self.cache_id, token_ids, capture)

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


# -- every rank ----------------------------------------------------------------------------------


@dataclass
class FollowerClock:
    """Where a follower's time goes: waiting for rank 0's next message (rank 0 drafting,
    sampling, or idle) against running forwards (its compute and the collectives inside)."""

    waiting: float = 0.0
    forwards: float = 0.0


def _gather_memory(group: Any, clock: FollowerClock | None = None) -> list[dict[str, Any]]:
    """Every rank's peak and active memory (bytes) and, for followers, their clock."""
    n, me = group.size(), group.rank()
    mine = mx.zeros((n, 4), dtype=mx.float32)
    mib = 1 << 20
    mine[me, 0] = mx.get_peak_memory() / mib
    mine[me, 1] = mx.get_active_memory() / mib
    if clock is not None:
        mine[me, 2] = clock.waiting
        mine[me, 3] = clock.forwards
    rows = mx.distributed.all_sum(mine, group=group).tolist()
    return [
        {"peak_bytes": int(p * mib), "active_bytes": int(a * mib), "waiting_s": w, "forward_s": f}
        for p, a, w, f in rows
    ]


def _time_collectives(group: Any, positions: int, hidden: int, dtype: Any, reps: int) -> float:
    x = mx.ones((1, positions, hidden), dtype=dtype)
    mx.eval(mx.distributed.all_sum(x, group=group))
    t = time.perf_counter()
    for _ in range(reps):
        mx.eval(mx.distributed.all_sum(x, group=group))
    return (time.perf_counter() - t) / max(reps, 1)


def follow(trunk: Any, group: Any) -> None:
    """A follower's loop: apply rank 0's cache operations and run its forwards until told to
    stop (or the group fails, which raises)."""
    caches: dict[int, TrunkCache] = {}
    snapshots: dict[int, dict[int, list[tuple[Any, ...]]]] = {}
    empty = mx.zeros((MESSAGE_SIZE,), dtype=mx.int32)
    hidden_size = trunk.args.hidden_size
    dtype = trunk.model.norm.weight.dtype
    clock = FollowerClock()
    while True:
        t = time.perf_counter()
        values = mx.distributed.all_sum(empty, group=group).tolist()
        clock.waiting += time.perf_counter() - t
        for i in range(values[0]):
            code, cid, a, b = values[1 + 4 * i : 5 + 4 * i]
            if code == OP_NEW:
                caches[cid] = TrunkCache(trunk)
            elif code == OP_DROP:
                caches.pop(cid, None)
                snapshots.pop(cid, None)
            elif code == OP_COMMIT:
                caches[cid].commit(a, b)
            elif code == OP_SNAPSHOT:
                kept = snapshots.setdefault(cid, {})
                kept[a] = caches[cid].snapshot()
                for old in sorted(kept)[:-KEEP_SNAPSHOTS]:
                    del kept[old]
            elif code == OP_RESTORE:
                caches[cid].restore(snapshots[cid].pop(a))
            elif code == OP_FORWARD:
                t = time.perf_counter()
                if a <= INLINE_TOKENS:
                    start = 1 + 4 * MAX_OPS
                    tokens = mx.array(values[start : start + a], dtype=mx.int32)
                else:
                    tokens = mx.distributed.all_sum(mx.zeros((a,), mx.int32), group=group)
                cache = caches[cid]
                if b:
                    hidden = trunk_hidden(trunk, tokens[None], cache, capture=True)
                    mx.eval(hidden, cache.arrays())
                else:
                    with all_cores():
                        hidden = trunk_hidden(trunk, tokens[None], cache, capture=False)
                        mx.eval(hidden, cache.arrays())
                clock.forwards += time.perf_counter() - t
            elif code == OP_MEMORY:
                _gather_memory(group, clock)
            elif code == OP_PROBE:
                _time_collectives(group, a, cid, mx.int32 if b % 2 else dtype, b // 2)
            elif code == OP_PING:
                time_send(group, a, hidden_size, dtype, b)
            elif code == OP_SHUTDOWN:
                return


def run_follower(model: str, dtype: str = "auto") -> int:
    """A follower process: load this rank's shard, then follow rank 0 until it stops."""
    group = world()
    loaded = load_sharded(model, mtp_weights=None, dtype=dtype)
    log.info("rank %d of %d: following rank 0", group.rank(), group.size())
    try:
        follow(loaded.trunk, group)
    except RuntimeError as exc:  # rank 0 is gone: nothing to serve
        log.error("rank %d: the group failed (%s); exiting", group.rank(), exc)
        return 1
    return 0


# -- rank 0's engine -----------------------------------------------------------------------------


@dataclass
class DistributedEngine(Engine):
    """``Engine`` on rank 0 of a group: the trunk is sharded and mirrored on the followers."""

    leader: Leader | None = field(default=None, repr=False)
    #: no batching: the followers mirror one sequence's cache operations at a time
    batch = None  # type: ignore[assignment]

    @classmethod
    def load_model(
        cls, model: str, *, mtp_weights: str | None, dtype: str, memory_limit: int | None = None
    ) -> loader.LoadedModel:
        group = world()
        if group is None or group.rank() != 0:
            raise RuntimeError("DistributedEngine runs on rank 0 of a group (mlx.launch)")
        loaded = load_sharded(
            model, mtp_weights=mtp_weights, dtype=dtype, memory_limit=memory_limit
        )
        timeout = float(os.environ.get("MTPSERVE_DISTRIBUTED_TIMEOUT", DEFAULT_TIMEOUT_S))
        leader = Leader(group, timeout)
        leader.active = 1  # start-up measures auto K's costs through the group: watched too
        loaded.trunk.mtpserve_new_cache = lambda: LeaderTrunkCache(loaded.trunk, leader)
        loaded.trunk.mtpserve_leader = leader
        leader.watch()
        atexit.register(leader.shutdown)
        return loaded

    @classmethod
    def load(cls, model: str, **kwargs: Any) -> DistributedEngine:
        engine = super().load(model, **kwargs)
        engine.leader.active -= 1  # loaded: the watchdog watches generations only
        return engine

    def __post_init__(self) -> None:
        self.leader = getattr(self.loaded.trunk, "mtpserve_leader", None)

    def enable_prefix_cache(self, budget_bytes: int, *args: Any, **kwargs: Any) -> None:
        """The conversation cache restores trunk caches by building new arrays, which the
        followers would never see (they mirror only ``TrunkCache`` operations): off here."""
        if budget_bytes > 0:
            log.warning("the conversation cache is off under mlx.launch (sharded trunk)")
        super().enable_prefix_cache(0)

    @property
    def on_lost(self) -> list[Callable[[BaseException], None]]:
        """Callbacks run once when the group is lost (the server fails its queue there)."""
        return self.leader.on_lost

    def generate(
        self,
        request: GenerationRequest,
        cancelled: Callable[[], bool] = lambda: False,
        trace: Callable[[dict[str, Any]], None] | None = None,
    ) -> Iterator[GenerationEvent]:
        leader = self.leader
        leader._check()
        sent = leader.messages
        leader.active += 1
        leader.progress()
        try:
            for event in super().generate(request, cancelled, trace):
                leader.progress()
                yield event
        except EngineUnavailable:
            raise
        except Exception as exc:
            if leader.messages == sent:  # refused before anything reached the group
                raise
            # After a collective the ranks' caches may differ: the group cannot go on.
            raise leader.lose(f"{type(exc).__name__}: {exc}") from exc
        finally:
            leader.active -= 1

    def shutdown(self) -> None:
        self.leader.shutdown()


def time_send(group: Any, positions: int, hidden: int, dtype: Any, reps: int) -> float:
    """Seconds per one-way ``send`` of ``[1, positions, hidden]`` between ranks 0 and 1 (a
    pipeline stage boundary): half a ping-pong."""
    x = mx.ones((1, positions, hidden), dtype=dtype)
    me = group.rank()
    t = time.perf_counter()
    for _ in range(reps + 1):
        if me == 0:
            mx.eval(mx.distributed.send(x, 1, group=group))
            x = mx.distributed.recv_like(x, 1, group=group)
            mx.eval(x)
        elif me == 1:
            x = mx.distributed.recv_like(x, 0, group=group)
            mx.eval(x)
            mx.eval(mx.distributed.send(x, 0, group=group))
        if _ == 0:
            t = time.perf_counter()  # the first round trip warms up
    return (time.perf_counter() - t) / max(reps, 1) / 2
