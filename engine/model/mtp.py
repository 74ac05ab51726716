"""The Qwen3.5/3.6 multi-token-prediction head, attached to the loaded trunk.

The head owns only its own tensors (fc, three norms, one full-attention decoder layer). Token
embeddings and the output projection are the trunk's: every call takes the trunk ``TextModel``
and uses its ``embed_tokens`` and ``lm_head`` (the embedding when tied), so no weight is held
twice.

Forward for the pair (h_t, x_{t+1}) at position t, predicting x_{t+2}::

    e = pre_fc_norm_embedding(embed(x_{t+1}))
    h = pre_fc_norm_hidden(h_t)          # h_t: trunk output AFTER the final norm
    z = fc(concat([e, h]))               # embedding first, then hidden
    z = layer(z, position t, own KV cache)
    out = norm(z)                        # fed back as "h" for the next draft step
    logits = lm_head(out)
"""

from __future__ import annotations

from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3_5 import DecoderLayer, TextModelArgs

from engine.model import products
from engine.model.products import linear, product
from engine.model.trunk import (
    attention_block,
    attention_block_rows,
    block,
    embed,
    leads_a_group,
)


class MTPHead(nn.Module):
    def __init__(self, args: TextModelArgs) -> None:
        super().__init__()
        h = args.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(h, eps=args.rms_norm_eps)
        # A full-attention layer (never GDN): mlx-lm picks the layer type from its index.
        self.layers = [DecoderLayer(args, layer_idx=args.full_attention_interval - 1)]
        self.norm = nn.RMSNorm(h, eps=args.rms_norm_eps)

    def __call__(
        self,
        trunk: Any,
        token_ids: mx.array,
        hidden: mx.array,
        cache: KVCache | list[KVCache],
        position: int | list[int] | None = None,
        lengths: list[int] | None = None,
        pick: mx.array | None = None,
    ) -> tuple[mx.array, mx.array]:
        """Run pairs (hidden[:, j], token_ids[:, j]) at the cache's next positions.

        Args:
            trunk: the mlx-lm ``TextModel`` whose embedding and lm_head are shared.
            token_ids: ``[1, T]`` the tokens x_{t+1}.
            hidden: ``[1, T, H]`` post-final-norm trunk states h_t (or the head's own ``out``).
            cache: the head's persistent KV cache; T positions are appended.
            position: sequence position t of the first pair (default: the cache's length;
                larger when the cache skipped positions).

            Several sequences at once (a batched draft step): ``token_ids [B, T]``, ``hidden
            [B, T, H]``, one cache and one position per row; ``lengths``: each row's real
            pairs, right-aligned (the columns before them are padding that no cache keeps).
            pick: device indices ``[B]``: row b's output is its pair ``pick[b]``'s instead of
                its last's, bit for bit what it is as the last of ``pick[b] + 1`` pairs (the
                pairs after it enter the cache too, for the caller to trim).

        Returns:
            ``(out, logits)``: ``[1, 1, H]`` post-norm state and ``[1, 1, V]`` draft logits of
            the last pair. Earlier pairs only fill the cache: of them the layer computes keys
            and values alone (one layer, so no later computation reads their outputs), which
            keeps a catch-up after plain cycles to a quarter to a third of the whole layer's cost
            (``scripts/experiments/plain_stretch.py catch-up``).
        """
        embedded = embed(trunk, token_ids)
        length = token_ids.shape[1]  # eager beyond MAX_COMPILED_T (a long prompt's prefill)
        z = block(self, "combine", lambda head: head.combine, length)(embedded, hidden)
        if isinstance(cache, list):
            z = attention_block_rows(
                self.layers[0], z, cache, position, last_only=True, lengths=lengths, pick=pick
            )
        else:
            z = attention_block(self.layers[0], z, cache, position, last_only=True, pick=pick)
        if leads_a_group(trunk):
            return self.output(trunk, z)  # the projection is a collective: not in a compiled block
        return block(self, "output", lambda head: partial(head.output, trunk), 1)(z)

    def combine(self, embedded: mx.array, hidden: mx.array) -> mx.array:
        """fc over the normed embedding, then the normed hidden state: on the kernel one op."""
        out = products.joined_linear(
            self.fc, embedded, self.pre_fc_norm_embedding, hidden, self.pre_fc_norm_hidden
        )
        if out is not None:
            return out
        e = self.pre_fc_norm_embedding(embedded)
        h = self.pre_fc_norm_hidden(hidden)
        return linear(self.fc, mx.concatenate([e, h], axis=-1))  # embedding first, then hidden

    def output(self, trunk: Any, z: mx.array) -> tuple[mx.array, mx.array]:
        last = self.norm(z)  # one row: only the last position drafts
        draft = self.__dict__.get("_draft_vocab")
        if draft is None:
            return last, project_to_vocab(trunk, last)
        ids, weight = draft
        subset = products.multiply(last, weight).astype(mx.float32)
        if (native := products.native_for(subset)) is not None:  # one op where mlx takes three
            return last, native.scatter_columns(subset, ids, trunk.args.vocab_size)
        # put_along_axis, not `logits[..., ids] = ...`: on CPU the indexed assignment costs as
        # much as the projection itself (185 vs 13 us on the demo model).
        empty = mx.full((*last.shape[:-1], trunk.args.vocab_size), -mx.inf, dtype=mx.float32)
        index = mx.broadcast_to(ids, subset.shape)
        return last, mx.put_along_axis(empty, index, subset, axis=-1)

    def set_draft_vocab(self, trunk: Any, ids: list[int] | None) -> int:
        """Draft only over ``ids`` (others get probability 0 in q); None restores the full
        vocabulary. Returns the bytes of the gathered projection rows this costs.

        Why: with a small trunk the head's full-vocabulary projection is most of a draft step
        (docs/BENCHMARKS.md, "The draft vocabulary"). Exactness is untouched: q is still the
        distribution the draft was drawn from, and the acceptance rule is exact for any q; only
        acceptance can drop, by at most the target mass outside ``ids``.
        """
        self.__dict__.pop("_mtpserve_compiled", None)  # the output block closes over it
        if ids is None:
            self.__dict__.pop("_draft_vocab", None)
            return 0
        if trunk.args.tie_word_embeddings:
            table = trunk.model.embed_tokens
        else:
            table = trunk.lm_head
        index = mx.array(sorted(set(ids)), dtype=mx.int32)
        if hasattr(table, "rows"):  # split by vocabulary over ranks (engine.distributed)
            weight = table.rows(index[None])[0].astype(self.norm.weight.dtype)
        else:
            # A quantized table's rows come dequantized (on CPUs a float matmul over the subset
            # is also faster than mlx's quantized kernels) in the head's float type (norms are
            # never quantized).
            weight = table_rows(table, index).astype(self.norm.weight.dtype)
        mx.eval(weight)
        self.__dict__["_draft_vocab"] = (index, weight)
        return weight.nbytes


def table_rows(table: nn.Module, index: mx.array) -> mx.array:
    """Rows ``index`` of a vocabulary table (an embedding or an output projection, quantized
    or not), as floats."""
    if "scales" not in table:
        return table.weight[index]
    return products.dequantized_rows(table, index)


def project_to_vocab(trunk: Any, hidden: mx.array) -> mx.array:
    """The trunk's output projection (the embedding matrix when tied)."""
    if trunk.args.tie_word_embeddings:
        table = trunk.model.embed_tokens
        out = product(table, hidden)
        return table.as_linear(hidden) if out is None else out
    return linear(trunk.lm_head, hidden)
