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

# The package's face: what the CLI, the server and the tests reach through ``engine.distributed``.
from engine.distributed.engine import DistributedEngine
from engine.distributed.follower import run_follower
from engine.distributed.group import rank, world
from engine.distributed.leader import lost_message
from engine.runtime import Engine

__all__ = [
    "DistributedEngine",
    "engine_class",
    "lost_message",
    "rank",
    "run_follower",
    "world",
]


def engine_class() -> type[Engine]:
    """``Engine``, or ``DistributedEngine`` on rank 0 of a group."""
    return DistributedEngine if world() is not None else Engine
