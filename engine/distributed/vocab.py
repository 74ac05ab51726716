"""Splitting a model over the ranks: mlx-lm's ``shard()`` for the trunk, and the vocabulary
tables split by rows (``VocabShard``), whose uses become collectives; loading this rank's shard."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn

from engine.distributed.group import world
from engine.distributed.protocol import FLOAT_TYPES, OP_EMBED, OP_PROJECT, OP_ROWS
from engine.model import loader
from engine.model.mtp import table_rows

if TYPE_CHECKING:
    from engine.distributed.leader import Leader


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
