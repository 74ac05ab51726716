"""The messages rank 0 announces to the followers: their layout, the operation codes, and a
follower's reading of the tokens a message carries."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

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


def received_tokens(values: list[int], n: int, group: Any) -> mx.array:
    """A follower's copy of the ``[1, n]`` tokens rank 0 announced with ``values``."""
    if n <= INLINE_TOKENS:
        start = 1 + 4 * MAX_OPS
        return mx.array(values[start : start + n], dtype=mx.int32)[None]
    return mx.distributed.all_sum(mx.zeros((n,), mx.int32), group=group)[None]
