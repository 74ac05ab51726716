"""One model split across processes or machines with ``mx.distributed`` (tensor parallel).

Under ``mlx.launch`` (ring, JACCL or MPI backend) every rank loads only its shard of the trunk
through mlx-lm's own ``Model.shard()`` for qwen3_5: the Gated-DeltaNet and attention projections
and the MLP (or the experts) are split by heads / columns, and each layer ends in an
``all_sum`` (two per layer: after the mixer's output projection and after the MLP's down
projection). The embedding and the output projection (one table when tied) are split by
vocabulary (``VocabEmbedding``, ``VocabProjection``): a lookup is an ``all_sum`` of every rank's
rows (each token's row from the rank that holds it, zeros from the others: the row itself,
exactly), a projection an ``all_gather`` of every rank's logits. So each rank holds 1/n of the
weights; rank 0 holds the MTP head too (one layer, and it reads the split tables).

Who decides what (why the ranks cannot diverge):

* **Rank 0 runs the whole engine** — HTTP, scheduler, the speculative cycle, the head, sampling,
  acceptance, auto K, stop conditions. Followers run no sampler, no head layer, no policy: they
  hold trunk caches and their part of the vocabulary tables, and execute what rank 0 announces.
* **Rank 0 announces every step, in order.** Each trunk forward, and each use of the vocabulary
  tables outside one (the head's lookup of its tokens, a projection to logits, the rows of a
  draft vocabulary), first sends one message (an ``all_sum`` of a small int32 vector to which
  followers contribute zeros): the cache operations since the previous message — create, commit
  (``n_keep`` of ``n_fed``: the accepted length), snapshot, restore, drop — and the step with
  its tokens (for a verify pass: the last token and the K drafts). Every rank computes with the
  tokens *as the broadcast result carries them*; a projection's input states travel as one more
  ``all_sum`` from rank 0. A follower's cache therefore goes through exactly rank 0's sequence
  of operations with exactly rank 0's tokens: the tokens rank 0 sampled and accepted, never
  recomputed. Rank 0 builds its graph lazily, so each of its collectives is made to depend on
  the one before it and on the last forward's output (``Leader.collective``): mlx cannot
  evaluate them in another order than the followers, who run them as the messages arrive.
* The per-position GDN capture and commit (engine.model.trunk) run unchanged on every rank, each on
  its own heads: the capture is per head, so a shard of the heads commits its own shard of the
  state.

Per verify pass: a message, the embedded input, the 2 per layer, then a message, the states and
the gather of the logits. Per draft step: a message and the lookup, a message, the head's state
and the gather (docs/BENCHMARKS.md, "One model on two ranks", times one ``all_sum``).

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
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from engine.api import EngineUnavailable, GenerationRequest, RequestError
from engine.blas import all_cores
from engine.cycle.sequence import Sequence
from engine.cycle.speculative import CycleResult
from engine.model import loader, products
from engine.model.mlx_products import prefill_on_all_cores
from engine.model.mtp import table_rows
from engine.model.trunk import TrunkCache, trunk_hidden
from engine.runtime import Engine
from engine.scheduling.batching import BatchDecoder

log = logging.getLogger("mtpserve.distributed")

# Message layout: [n_ops, (code, cache_id, a, b) x MAX_OPS, tokens x INLINE_TOKENS].
OP_NEW, OP_DROP, OP_COMMIT, OP_SNAPSHOT, OP_RESTORE, OP_FORWARD = 1, 2, 3, 4, 5, 6
OP_MEMORY, OP_PROBE, OP_PING, OP_SHUTDOWN = 7, 8, 9, 10
OP_EMBED, OP_PROJECT, OP_ROWS = 11, 12, 13  # the vocabulary tables, outside a trunk forward
FLOAT_TYPES = (mx.float32, mx.bfloat16, mx.float16)  # OP_PROJECT's states, by index
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
    """mlx-lm's ``shard()`` splits heads and columns evenly, and the vocabulary tables are split
    by rows; say which dimension does not divide."""
    text = config.get("text_config", config)
    dims = {
        "num_attention_heads": text["num_attention_heads"],
        "linear_num_key_heads": text["linear_num_key_heads"],
        "linear_num_value_heads": text["linear_num_value_heads"],
        "intermediate_size": text.get("intermediate_size") or n,
        "moe_intermediate_size": text.get("moe_intermediate_size") or n,
        "shared_expert_intermediate_size": text.get("shared_expert_intermediate_size") or n,
        "vocab_size": text["vocab_size"],
    }
    bad = {k: v for k, v in dims.items() if v % n}
    if bad:
        raise ValueError(f"cannot split this model over {n} ranks: {bad} not divisible by {n}")


def shard_trunk(net: nn.Module, group: Any) -> None:
    """Split the trunk with mlx-lm's ``Model.shard`` (lazy: only the shard is ever read), and
    the embedding and output projection by vocabulary (``VocabEmbedding``, ``VocabProjection``).
    """
    lm = net.language_model
    args = lm.args
    tied = args.tie_word_embeddings
    args.tie_word_embeddings = True  # shard() then leaves lm_head to us
    try:
        net.shard(group)
    finally:
        args.tie_word_embeddings = tied
    lm.model.embed_tokens = VocabEmbedding(lm.model.embed_tokens, group)
    if not tied:
        lm.lm_head = VocabProjection(lm.lm_head, group)


class VocabShard(nn.Module):
    """This rank's rows of a vocabulary table: rows ``[start, start + V/ranks)``.

    What reads the whole table becomes a collective: a lookup sums every rank's rows (each
    token's row comes from the one rank that holds it, zeros from the others, so the sum is
    the row itself, exactly); a projection gathers every rank's logits. On rank 0 (``leader``
    set) each use outside a trunk forward is first announced, so that the followers take part.
    """

    def __init__(self, table: nn.Module, group: Any) -> None:
        super().__init__()
        rows = table.weight.shape[0] // group.size()
        self.start = group.rank() * rows
        self.rows_per_rank = rows
        for name in ("weight", "scales", "biases"):
            if name in table:  # a lazy slice: only these rows are ever read from disk
                table[name] = mx.contiguous(table[name][self.start : self.start + rows])
        self.table = table
        self.group = group
        self.leader: Leader | None = None

    @property
    def weight(self) -> mx.array:
        return self.table.weight

    def _collective(self, fn: Callable[..., mx.array], x: mx.array) -> mx.array:
        if self.leader is not None:
            return self.leader.collective(fn, x)
        return fn(x, group=self.group)

    def _mine(self, ids: mx.array) -> tuple[mx.array, mx.array]:
        local = ids.astype(mx.int32) - self.start
        inside = (local >= 0) & (local < self.rows_per_rank)
        return mx.where(inside, local, 0), inside

    def collect_rows(self, ids: mx.array) -> mx.array:
        """The table's rows for ``ids [1, n]`` (quantized tables: dequantized), on every rank:
        a step every rank has been told of."""
        local, inside = self._mine(ids)
        mine = mx.where(inside[..., None], table_rows(self.table, local), 0)
        return self._collective(mx.distributed.all_sum, mine)

    def rows(self, ids: mx.array) -> mx.array:
        """``collect_rows`` of ``ids [1, n]``, announced first on rank 0 (the head's draft
        vocabulary gathers its projection rows with it)."""
        if self.leader is not None:
            ids = self.leader.announce((OP_ROWS, 0, ids.shape[1], 0), ids)
        return self.collect_rows(ids)

    def project(self, x: mx.array) -> mx.array:
        """Logits ``[..., V]`` of the states ``x [..., H]``, on every rank."""
        lead, H = x.shape[:-1], x.shape[-1]
        positions = x.size // H
        if self.leader is not None:
            self.leader.announce((OP_PROJECT, 0, positions, FLOAT_TYPES.index(x.dtype)))
            x = self._collective(mx.distributed.all_sum, x.reshape(1, positions, H))  # + zeros
        local = self._local_logits(x).reshape(positions, -1)
        gathered = self._collective(mx.distributed.all_gather, local.T)  # by vocabulary rows
        return gathered.T.reshape(*lead, -1)

    def _local_logits(self, x: mx.array) -> mx.array:
        raise NotImplementedError


class VocabEmbedding(VocabShard):
    """The embedding split by vocabulary (and the output projection when tied)."""

    def lookup(self, ids: mx.array) -> mx.array:
        """Embed ``ids [1, T]`` within a forward that rank 0 has announced."""
        return self.collect_rows(ids)

    def __call__(self, ids: mx.array) -> mx.array:
        """Embed ``ids [1, T]`` (on rank 0: the head's tokens; announced first)."""
        if self.leader is not None:
            ids = self.leader.announce((OP_EMBED, 0, ids.shape[1], 0), ids)
        return self.lookup(ids)

    def as_linear(self, x: mx.array) -> mx.array:
        return self.project(x)

    def _local_logits(self, x: mx.array) -> mx.array:
        return self.table.as_linear(x)


class VocabProjection(VocabShard):
    """An untied output projection split by vocabulary."""

    def __call__(self, x: mx.array) -> mx.array:
        return self.project(x)

    def _local_logits(self, x: mx.array) -> mx.array:
        return self.table(x)


def output_table(trunk: Any) -> VocabShard:
    """The table the output projection reads (the embedding when tied)."""
    return trunk.model.embed_tokens if trunk.args.tie_word_embeddings else trunk.lm_head


def attach_leader(trunk: Any, leader: Leader) -> None:
    """Make rank 0's vocabulary tables announce their uses to the followers."""
    trunk.model.embed_tokens.leader = leader
    if not trunk.args.tie_word_embeddings:
        trunk.lm_head.leader = leader


def received_tokens(values: list[int], n: int, group: Any) -> mx.array:
    """A follower's copy of the ``[1, n]`` tokens rank 0 announced with ``values``."""
    if n <= INLINE_TOKENS:
        start = 1 + 4 * MAX_OPS
        return mx.array(values[start : start + n], dtype=mx.int32)[None]
    return mx.distributed.all_sum(mx.zeros((n,), mx.int32), group=group)[None]


def load_sharded(
    model: str, *, mtp_weights: str | None, dtype: str, memory_limit: int | None = None
) -> loader.LoadedModel:
    """This rank's shard (rank 0: plus the head)."""
    group = world()
    lead = group.rank() == 0
    config = json.loads((loader.resolve_model_dir(model) / "config.json").read_text())
    check_shardable(config, group.size())
    return loader.load(
        model,
        mtp_weights=mtp_weights,
        dtype=dtype,
        with_head=lead,
        prepare=lambda net: shard_trunk(net, group),
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
        return _gather_memory(self.group, self.weight_bytes)

    def probe_collectives(
        self, positions: int, hidden: int, dtype: Any, reps: int, gather: bool = False
    ) -> float:
        """Seconds per ``all_sum`` of ``[1, positions, hidden]`` (what a layer sends), or with
        ``gather`` per ``all_gather`` of that much from every rank (a logits shard)."""
        kind = {mx.int32: 1}.get(dtype, 0) + 2 * gather
        self.flush((OP_PROBE, hidden, positions, reps * 4 + kind))
        return _time_collectives(self.group, positions, hidden, dtype, reps, gather)

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


# -- every rank ----------------------------------------------------------------------------------


@dataclass
class FollowerClock:
    """Where a follower's time goes: waiting for rank 0's next message (rank 0 running the
    head's layer, sampling, or idle) against running the announced steps (forwards and uses of
    the vocabulary tables: its compute and the collectives inside)."""

    waiting: float = 0.0
    steps: float = 0.0


def weight_bytes(net: nn.Module) -> int:
    """The bytes of the weights this rank holds."""
    return sum(a.nbytes for _, a in tree_flatten(net.parameters()))


def _gather_memory(
    group: Any, weights: int, clock: FollowerClock | None = None
) -> list[dict[str, Any]]:
    """Every rank's peak and active memory and its weights' bytes (``weights``: this rank's)
    and, for followers, their clock."""
    n, me = group.size(), group.rank()
    mine = mx.zeros((n, 5), dtype=mx.float32)
    mib = 1 << 20
    mine[me, 0] = mx.get_peak_memory() / mib
    mine[me, 1] = mx.get_active_memory() / mib
    mine[me, 2] = weights / mib
    if clock is not None:
        mine[me, 3] = clock.waiting
        mine[me, 4] = clock.steps
    rows = mx.distributed.all_sum(mine, group=group).tolist()
    return [
        {
            "peak_bytes": int(p * mib),
            "active_bytes": int(a * mib),
            "weight_bytes": int(w * mib),
            "waiting_s": waiting,
            "steps_s": steps,
        }
        for p, a, w, waiting, steps in rows
    ]


def _time_collectives(
    group: Any, positions: int, hidden: int, dtype: Any, reps: int, gather: bool = False
) -> float:
    x = mx.ones((1, positions, hidden), dtype=dtype)
    collective = mx.distributed.all_gather if gather else mx.distributed.all_sum
    mx.eval(collective(x, group=group))
    t = time.perf_counter()
    for _ in range(reps):
        mx.eval(collective(x, group=group))
    return (time.perf_counter() - t) / max(reps, 1)


def follow(trunk: Any, group: Any) -> None:
    """A follower's loop: apply rank 0's cache operations and run the steps it announces until
    told to stop (or the group fails, which raises)."""
    caches: dict[int, TrunkCache] = {}
    snapshots: dict[int, dict[int, list[tuple[Any, ...]]]] = {}
    empty = mx.zeros((MESSAGE_SIZE,), dtype=mx.int32)
    hidden_size = trunk.args.hidden_size
    dtype = trunk.model.norm.weight.dtype
    clock = FollowerClock()
    weights = weight_bytes(trunk)
    while True:
        t = time.perf_counter()
        values = mx.distributed.all_sum(empty, group=group).tolist()
        t_steps = time.perf_counter()
        clock.waiting += t_steps - t
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
                tokens = received_tokens(values, a, group)
                cache = caches[cid]
                if b:
                    hidden = trunk_hidden(trunk, tokens, cache, capture=True)
                    mx.eval(hidden, cache.arrays())
                else:
                    with all_cores(prefill_on_all_cores(trunk, tokens.shape[1])):
                        hidden = trunk_hidden(trunk, tokens, cache, capture=False)
                        mx.eval(hidden, cache.arrays())
            elif code == OP_EMBED:  # the head embeds its tokens
                mx.eval(trunk.model.embed_tokens.lookup(received_tokens(values, a, group)))
            elif code == OP_PROJECT:  # logits of a = positions: rank 0 sends their states
                shared = mx.zeros((1, a, hidden_size), FLOAT_TYPES[b])
                hidden = mx.distributed.all_sum(shared, group=group)
                mx.eval(output_table(trunk).project(hidden))
            elif code == OP_ROWS:  # the head's draft vocabulary
                mx.eval(output_table(trunk).collect_rows(received_tokens(values, a, group)))
            elif code == OP_MEMORY:
                clock.steps += time.perf_counter() - t_steps
                t_steps = time.perf_counter()
                _gather_memory(group, weights, clock)
            elif code == OP_PROBE:
                kind, reps = b % 4, b // 4
                _time_collectives(group, a, cid, mx.int32 if kind % 2 else dtype, reps, kind >= 2)
            elif code == OP_PING:
                time_send(group, a, hidden_size, dtype, b)
            elif code == OP_SHUTDOWN:
                return
        clock.steps += time.perf_counter() - t_steps


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
        leader.weight_bytes = weight_bytes(loaded.model)
        attach_leader(loaded.trunk, leader)
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

    def batch(self, capacity: int) -> BatchDecoder:
        """One row at a time: the followers mirror one sequence's cache operations at a time."""
        return BatchDecoder(self, 1)

    def row_steps(
        self,
        request: GenerationRequest,
        cancelled: Callable[[], bool] = lambda: False,
        trace: Callable[[dict[str, Any]], None] | None = None,
        seq: Sequence | None = None,
    ) -> Generator[Any, CycleResult | None, None]:
        """``Engine.row_steps`` watched by the leader: progress at every step, and a failure
        after anything reached the group loses the group (the ranks' caches may differ)."""
        leader = self.leader
        leader.check_alive()
        sent = leader.messages
        leader.active += 1
        leader.progress()
        steps = super().row_steps(request, cancelled, trace, seq)
        try:
            reply: Any = None
            thrown: BaseException | None = None
            while True:
                try:
                    item = steps.send(reply) if thrown is None else steps.throw(thrown)
                except StopIteration:
                    return
                thrown = None
                leader.progress()
                try:
                    reply = yield item
                except GeneratorExit:
                    steps.close()
                    raise
                except BaseException as exc:  # the batch's account of this row's cycle
                    thrown = exc
        except (EngineUnavailable, RequestError):
            # a request's own error (a grammar's dead end) is raised where the caches of
            # every rank agree: it fails that request, never the group
            raise
        except Exception as exc:
            if leader.messages == sent:  # refused before anything reached the group
                raise
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
