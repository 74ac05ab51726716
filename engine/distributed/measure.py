"""What the ranks measure together: memory and weights per rank, a follower's clock, and the
time of one collective or one send between ranks."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten


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


def gather_memory(
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


def time_collectives(
    group: Any, positions: int, hidden: int, dtype: Any, reps: int, gather: bool = False
) -> float:
    x = mx.ones((1, positions, hidden), dtype=dtype)
    collective = mx.distributed.all_gather if gather else mx.distributed.all_sum
    mx.eval(collective(x, group=group))
    t = time.perf_counter()
    for _ in range(reps):
        mx.eval(collective(x, group=group))
    return (time.perf_counter() - t) / max(reps, 1)


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
