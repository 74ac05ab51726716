"""A follower rank: load its shard, then apply rank 0's announced cache operations and steps
until told to stop."""

from __future__ import annotations

import logging
import time
from typing import Any

import mlx.core as mx

from engine.blas import all_cores
from engine.distributed.group import world
from engine.distributed.measure import (
    FollowerClock,
    gather_memory,
    time_collectives,
    time_send,
    weight_bytes,
)
from engine.distributed.protocol import (
    FLOAT_TYPES,
    KEEP_SNAPSHOTS,
    MESSAGE_SIZE,
    OP_COMMIT,
    OP_DROP,
    OP_EMBED,
    OP_FORWARD,
    OP_MEMORY,
    OP_NEW,
    OP_PING,
    OP_PROBE,
    OP_PROJECT,
    OP_RESTORE,
    OP_ROWS,
    OP_SHUTDOWN,
    OP_SNAPSHOT,
    received_tokens,
)
from engine.distributed.vocab import load_sharded, output_table
from engine.model.mlx_products import prefill_on_all_cores
from engine.model.trunk import TrunkCache, trunk_hidden

log = logging.getLogger("mtpserve.distributed")


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
                gather_memory(group, weights, clock)
            elif code == OP_PROBE:
                kind, reps = b % 4, b // 4
                time_collectives(group, a, cid, mx.int32 if kind % 2 else dtype, reps, kind >= 2)
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
