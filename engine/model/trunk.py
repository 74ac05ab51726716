"""Trunk forward passes and the per-sequence trunk cache, with hybrid-state rollback.

mlx-lm's Qwen3.5 modules hold the weights; this file walks their layers itself because the
verify pass needs something mlx-lm does not expose: the Gated-DeltaNet state *after each* of the
T verified positions, so that the state can be committed at the accepted position without
re-running anything:

* conv state: the window ``[conv_state | qkv_1..qkv_T]`` is kept; keeping n positions takes rows
  ``n .. n+kernel-2`` of it (the last kernel-1 inputs up to position n);
* recurrent state: the state after every step is kept (they are computed anyway by the
  recurrence; keeping the references costs only their memory), and the n-th is committed;
* attention KV caches are trimmed by the rejected count.

The GDN layer itself (its state, commit and forward) is engine.model.gated_deltanet; the
recurrence it runs is engine.model.delta_rule. This module owns the cache of a whole trunk and
the walk over its layers.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from engine.model import products
from engine.model.activations import sigmoid, swiglu
from engine.model.attention import RowKVCache, attend_rows
from engine.model.delta_rule import capture_of
from engine.model.gated_deltanet import BatchCommit, GDNLayerState, gated_deltanet
from engine.model.products import linear, linears
from engine.model.tape import Taped


class TrunkCache:
    """Per-sequence caches of every trunk layer: KV caches and GDN states."""

    def __init__(self, trunk: Any) -> None:
        self.kernel = trunk.args.linear_conv_kernel_dim
        self.layers: list[KVCache | GDNLayerState] = [
            GDNLayerState() if layer.is_linear else RowKVCache() for layer in trunk.layers
        ]

    @property
    def length(self) -> int:
        """Number of positions held (read off an attention layer)."""
        for c in self.layers:
            if isinstance(c, KVCache):
                return c.offset
        raise RuntimeError("trunk without attention layers")

    def commit(self, n_keep: int, n_fed: int) -> None:
        """After a capturing forward over ``n_fed`` positions keep only the first ``n_keep``."""
        for c in self.layers:
            if isinstance(c, KVCache):
                c.trim(n_fed - n_keep)
            else:
                c.commit(n_keep, self.kernel)

    def snapshot(self) -> list[tuple[Any, ...]]:
        """What a forward changes, per layer: a KV cache's length (positions past it are
        ignored and overwritten, as after ``trim``), a GDN layer's state references (replaced,
        never mutated)."""
        return [
            (c.offset,)
            if isinstance(c, KVCache)
            else (c.conv, c.recurrent, c.conv_window, c.capture)
            for c in self.layers
        ]

    def restore(self, snapshot: list[tuple[Any, ...]]) -> None:
        """Undo the forwards run since ``snapshot``."""
        for c, saved in zip(self.layers, snapshot, strict=True):
            if isinstance(c, KVCache):
                c.trim(c.offset - saved[0])
            else:
                # set together, without reading: a batched forward run since (a batch's
                # cycle launched ahead) left the state pending on the other rows' commits
                conv, recurrent, c.conv_window, c.capture = saved
                c.settled(conv, recurrent)

    def embed(self, trunk: Any, token_ids: mx.array, capture: bool) -> mx.array:
        """The input of a forward about to run over this cache: ``token_ids [1, T]`` embedded.
        Rank 0 of a sharded model first announces the forward to the other ranks, and every
        rank embeds with its part of the vocabulary (engine.distributed)."""
        return embed(trunk, token_ids)

    def forwarded(self, hidden: mx.array) -> mx.array:
        """A forward's output over this cache (rank 0 of a sharded model orders the next
        collective after it: engine.distributed)."""
        return hidden

    def arrays(self) -> list[mx.array]:
        """Every array the next cycle will read (for evaluation together with a cycle)."""
        out: list[mx.array] = []
        for c in self.layers:
            if isinstance(c, RowKVCache):
                out += c.buffers()
            elif isinstance(c, KVCache):
                if c.keys is not None:
                    out += [c.keys, c.values]
            elif c.batch is not None and c.batch.recurrent is None:  # a batched verify's
                out += [c.batch.window, *c.batch.capture.arrays()]
            else:
                out += [a for a in (c.conv_window, c.conv, c.recurrent) if a is not None]
                out += c.capture.arrays() if c.capture is not None else []
        return out


def new_trunk_cache(trunk: Any) -> TrunkCache:
    """A cache for ``trunk``; a sharded trunk supplies its own (engine.distributed)."""
    make = getattr(trunk, "mtpserve_new_cache", None)
    return make() if make is not None else TrunkCache(trunk)


def leads_a_group(trunk: Any) -> bool:
    """Rank 0 of a sharded model (engine.distributed): its forwards and the head's uses of the
    vocabulary tables hold collectives, which stay out of compiled blocks and are evaluated
    synchronously."""
    return getattr(trunk, "mtpserve_leader", None) is not None


def trunk_hidden(trunk: Any, token_ids: mx.array, cache: TrunkCache, capture: bool) -> mx.array:
    """Run the trunk over ``token_ids [1, T]``; return post-final-norm hidden states [1, T, H].

    With ``capture`` (the decode cycle: T = K+1 small) every layer runs as a compiled block and
    the GDN layers keep per-position states; the caller must ``cache.commit(n_keep, T)`` before
    the next forward. Without it (prefill: long, varying T) the same layers run eagerly and the
    GDN layers keep no per-position states: on the native kernel's recurrence on a CPU, else
    through ``delta_rule_prefill``'s closed-form blocks (mlx-lm's recurrence elsewhere: its
    kernel on Metal).
    """
    x = cache.embed(trunk, token_ids, capture)
    if capture and token_ids.shape[1] <= MAX_COMPILED_T:
        return cache.forwarded(_trunk_rows(trunk, x, [cache]))
    start = cache.length
    for layer, c in zip(trunk.layers, cache.layers, strict=True):
        if layer.is_linear:
            x = gated_deltanet(layer.linear_attn, x, c, capture, start, layer.input_layernorm)
            x = mlp(layer, x)
        else:
            x = attention_block(layer, x, c)
    return cache.forwarded(trunk.model.norm(x))


def trunk_hidden_rows(trunk: Any, token_ids: mx.array, caches: list[TrunkCache]) -> mx.array:
    """The decode cycle's capturing forward of B sequences at once: ``token_ids [B, T]`` (T =
    K+1 <= ``MAX_COMPILED_T``), row b continuing ``caches[b]``; returns ``[B, T, H]``.

    Every product (projections, MLP or experts, the vocabulary) runs once over all B x T
    positions: on a decode step, bound by reading the weights and by per-op dispatch, B rows
    cost little more than one. What depends on a row's history stays per row: each attention
    layer attends over the row's own KV cache (their lengths differ), and each GDN layer's conv
    and recurrent states are stacked for the block and its per-position captures handed back
    as row views, so every row commits its own accepted length (``TrunkCache.commit``).
    """
    return _trunk_rows(trunk, embed(trunk, token_ids), caches)


def embed(trunk: Any, token_ids: mx.array) -> mx.array:
    """``token_ids [B, T]`` embedded as the layers carry them (``products.embedded``): a
    compiled block up to ``MAX_COMPILED_T`` positions, on the kernel one tape."""
    table = trunk.model.embed_tokens
    if type(table) is not nn.Embedding and not products.embeds_in_one_op(table):
        # quantized off the kernel, or split over ranks (engine.distributed)
        return products.activations(table(token_ids))
    length = token_ids.shape[1]
    return block(table, "embed", lambda t: partial(products.embedded, t), length)(token_ids)


def _trunk_rows(trunk: Any, x: mx.array, caches: list[TrunkCache]) -> mx.array:
    """``trunk_hidden_rows`` from the embedded input ``x [B, T, H]``."""
    for index, layer in enumerate(trunk.layers):
        layer_caches = [c.layers[index] for c in caches]
        if layer.is_linear:
            x = gdn_block_captured(layer, x, layer_caches)
        else:
            x = attention_block_rows(layer, x, layer_caches, [c.offset for c in layer_caches])
    return compiled(trunk.model.norm, "norm", lambda n: n)(x)


# -- compiled blocks for the decode cycle ---------------------------------------------------------
# Small models on CPUs are bound by per-op dispatch, not arithmetic: a decode step is ~150 mlx
# ops. mx.compile turns each layer into one call with fused elementwise kernels. Shapes depend
# only on T (= K+1), never on the context length, so each block compiles once per K.

#: Largest T that runs compiled: the longest verify pass (K <= 8, engine.runtime's
#: MAX_DRAFT_TOKENS). Longer inputs — prefill, and the head's catch-up after a stretch of plain
#: cycles — run eagerly instead of compiling a graph for every length (a compile costs tens of
#: ms; auto K's probes after 16..128 plain cycles compiled a new length nearly every time).
MAX_COMPILED_T = 9


def compiled(
    module: Any, kind: str, build: Callable[[Any], Callable[..., Any]]
) -> Callable[..., Any]:
    """The compiled ``build(module)``, cached on the module itself (it dies with the model); a
    prompt's (``products.prompt_products``) apart from decoding's, whose products it traced."""
    blocks = module.__dict__.setdefault("_mtpserve_compiled", {})
    key = (kind, products.in_prompt())
    if key not in blocks:
        blocks[key] = Taped(mx.compile(build(module)))
    return blocks[key]


def mlp(layer: nn.Module, h: mx.array) -> mx.array:
    """``h`` plus the layer's MLP of ``post_attention_layernorm(h)``: mlx-lm's dense SwiGLU by
    ``linears`` and ``swiglu_linear`` (the norm inside the gate and up projections' op, the
    activation and the residual inside the down projection's where the kernel takes them); any
    other (experts) as it is."""
    m = layer.mlp
    if not all(n in m for n in ("gate_proj", "up_proj", "down_proj")):
        return h + m(layer.post_attention_layernorm(h))
    gate, up = linears([m.gate_proj, m.up_proj], h, layer.post_attention_layernorm)
    out = products.swiglu_linear(m.down_proj, gate, up, residual=h)
    return linear(m.down_proj, swiglu(gate, up), residual=h) if out is None else out


def _gdn_block(layer: nn.Module) -> Callable[..., Any]:
    m = layer.linear_attn

    def block(x: mx.array, conv: mx.array, recurrent: mx.array) -> tuple[mx.array, ...]:
        state = GDNLayerState(conv, recurrent)
        h = gated_deltanet(m, x, state, capture=True, norm=layer.input_layernorm)
        h = mlp(layer, h)
        return (h, state.conv_window, *state.capture.outputs())

    return block


def gdn_block_captured(
    layer: nn.Module, x: mx.array, states: GDNLayerState | list[GDNLayerState]
) -> mx.array:
    """A GDN decoder layer over ``x [B, T, H]`` capturing the state after each position; row b
    continues ``states[b]`` (one state: B = 1)."""
    rows = states if isinstance(states, list) else [states]
    m = layer.linear_attn
    if len(rows) > 1 and rows[0].batch is not None:
        stacked = rows[0].batch.stacked(rows)
        if stacked is not None:  # the same rows as the last batched cycle: no re-stacking
            h, window, *captured = compiled(layer, "gdn", _gdn_block)(x, *stacked)
            capture = capture_of(stacked[1], x.shape[1], captured)
            BatchCommit(rows, window, capture, m.conv_kernel_size)
            return h
    convs, recurrents = [], []
    for state in rows:
        conv, recurrent = state.conv, state.recurrent
        if conv is None:
            conv = mx.zeros((1, m.conv_kernel_size - 1, m.conv_dim), dtype=x.dtype)
        if recurrent is None:
            recurrent = mx.zeros((1, m.num_v_heads, m.head_v_dim, m.head_k_dim), dtype=mx.float32)
        convs.append(conv)
        recurrents.append(recurrent)
    if len(rows) == 1:
        h, window, *captured = compiled(layer, "gdn", _gdn_block)(x, convs[0], recurrents[0])
        rows[0].conv_window = window
        rows[0].capture = capture_of(recurrents[0], x.shape[1], captured)
        return h
    stacked = (mx.concatenate(convs), mx.concatenate(recurrents))
    h, window, *captured = compiled(layer, "gdn", _gdn_block)(x, *stacked)
    BatchCommit(rows, window, capture_of(stacked[1], x.shape[1], captured), m.conv_kernel_size)
    return h


def _attention_in(layer: nn.Module) -> Callable[..., Any]:
    """mlx-lm's gated attention up to the cache update (q_proj emits [query | gate] per head),
    the queries scaled by 1/sqrt(head_dim) here (fused into the block, one op less per layer);
    RoPE takes the offset as an array so the block does not recompile at every position."""
    a = layer.self_attn

    def block(x: mx.array, offset: mx.array) -> tuple[mx.array, ...]:
        B, L, _ = x.shape
        queries, keys, values = linears([a.q_proj, a.k_proj, a.v_proj], x, layer.input_layernorm)
        queries = queries.reshape(B, L, a.num_attention_heads, -1)
        queries, gate = mx.split(queries, 2, -1)
        keys = keys.reshape(B, L, a.num_key_value_heads, -1)
        values = values.reshape(B, L, a.num_key_value_heads, -1)
        queries = rotated(a.rope, queries, offset, a.scale, a.q_norm)
        keys = rotated(a.rope, keys, offset, norm=a.k_norm)
        # the gate as the split leaves it, [B, L, heads, D]: joining its heads would copy it
        return queries, keys, values.transpose(0, 2, 1, 3), gate

    return block


def rotated(
    rope: nn.Module,
    x: mx.array,
    offset: mx.array,
    factor: float = 1.0,
    norm: nn.Module | None = None,
) -> mx.array:
    """``rope(norm(x).transpose(0, 2, 1, 3), offset=offset) * factor`` for ``x [B, L, H, D]``
    (no norm: x itself): on a CPU with the native kernel one op (``Rope``) for mlx-lm's plain
    ``nn.RoPE`` and an RMS norm, where mlx has no CPU kernel for ``mx.fast.rope`` and evaluates
    it as ~13 ops of its own, plus the norm, the transpose and the scale (the same formulas in
    float32: a few ulp from mlx's rotation, the norm bit for bit the ``RMSNorm`` primitive's;
    every path of an engine runs the same op, so exactness between them is unchanged). Other
    RoPE variants keep mlx-lm's."""
    native = products.native_for(x)
    if (
        native is not None
        and type(rope) is nn.RoPE
        and offset.dtype == mx.int32
        and (norm is None or isinstance(norm, nn.RMSNorm))
    ):
        weight, eps = (None, 0.0) if norm is None else (norm["weight"], norm.eps)
        return native.rope(
            x, offset, rope.dims, rope.base, rope.scale, rope.traditional, factor, weight, eps
        )
    x = x if norm is None else norm(x)
    out = rope(x.transpose(0, 2, 1, 3), offset=offset)
    return out if factor == 1.0 else out * factor


def _attention_out(layer: nn.Module) -> Callable[..., Any]:
    a = layer.self_attn

    def block(x: mx.array, attended: mx.array, gate: mx.array) -> mx.array:
        # attended [B, L, Hq * D]: each position's heads joined (attention.attend); the gate
        # [B, L, Hq, D] as _attention_in split it off, inside the projection's op on the kernel
        h = products.gated_linear(a.o_proj, attended, gate, residual=x)
        if h is None:
            h = linear(a.o_proj, attended * sigmoid(gate.reshape(attended.shape)), residual=x)
        return mlp(layer, h)

    return block


def block(
    module: Any, kind: str, build: Callable[[Any], Callable[..., Any]], length: int
) -> Callable[..., Any]:
    """``build(module)`` for an input of ``length`` positions: compiled (``compiled``) up to
    ``MAX_COMPILED_T``, eager beyond."""
    return compiled(module, kind, build) if length <= MAX_COMPILED_T else build(module)


def attention_block(
    layer: nn.Module,
    x: mx.array,
    cache: KVCache,
    position: int | None = None,
    last_only: bool = False,
    pick: mx.array | None = None,
) -> mx.array:
    """A full-attention decoder layer (trunk or MTP head) over T new positions with its cache.

    ``position`` is the sequence position of the first new token (RoPE); it defaults to the
    cache's length and differs only for a head cache that skipped positions (see
    ``engine.cycle.speculative``). With ``last_only`` every position's keys and values enter the
    cache but only the last position's output is computed and returned (``[B, 1, H]``): the
    rest of the layer (attention output, o_proj, MLP) is per position, and a one-layer head's
    earlier outputs are never used. ``pick`` (with ``last_only``; device indices ``[B]``): the
    output of that position of each row instead of the last, each position's query seeing only
    the keys up to its own (``attention.attend``), so the picked position has the bits it has
    as the last of ``pick + 1`` positions. Compiled up to ``MAX_COMPILED_T`` positions, eager
    beyond.
    """
    position = cache.offset if position is None else position
    return attention_block_rows(layer, x, [cache], [position], last_only, pick=pick)


def attention_block_rows(
    layer: nn.Module,
    x: mx.array,
    caches: list[KVCache],
    positions: list[int],
    last_only: bool = False,
    lengths: list[int] | None = None,
    pick: mx.array | None = None,
) -> mx.array:
    """``attention_block`` for B rows at once: ``x [B, T, H]``, row b continuing ``caches[b]``
    at sequence position ``positions[b]``. Projections, RoPE (one offset per row) and the MLP
    run over every row together; each row attends over its own cache. ``lengths`` (with
    ``last_only``): row b's real positions are its last ``lengths[b]`` columns, the earlier
    ones padding that never enters its cache."""
    length = x.shape[1]
    offset = mx.array(positions[0]) if len(positions) == 1 else mx.array(positions)
    queries, keys, values, gate = block(layer, "attn_in", _attention_in, length)(x, offset)
    if last_only and length > 1 and pick is None:
        # the last query sees every cached key: no mask
        x, queries, gate = x[:, -1:], queries[:, :, -1:], gate[:, -1:]
    if length <= MAX_COMPILED_T or last_only or products.on_native():
        # a cycle's positions, a head step, or on a CPU with the kernel any prompt chunk: each
        # query's numbers the same alone, in a batch or in a chunk split anywhere (a 3,700-token
        # demo prefill 2,023 -> 3,322 tokens/s against mlx's attention, 0.8B 2,048 113 -> 119)
        out = attend_rows(queries, keys, values, caches, lengths)
    else:  # a prompt chunk (one row) elsewhere
        attended = []
        for b, cache in enumerate(caches):
            row_keys, row_values = cache.update_and_fetch(keys[b : b + 1], values[b : b + 1])
            attended.append(
                mx.fast.scaled_dot_product_attention(
                    queries[b : b + 1], row_keys, row_values, scale=1.0, mask="causal"
                )
            )
        out = attended[0] if len(attended) == 1 else mx.concatenate(attended)
        out = out.transpose(0, 2, 1, 3).reshape(out.shape[0], out.shape[2], -1)  # heads joined
    if last_only and pick is not None and pick.shape[0] == 1:  # one row: one gather each
        x, out, gate = (mx.take(a, pick, axis=1) for a in (x, out, gate))
    elif last_only and pick is not None:
        x, out, gate = (
            mx.take_along_axis(a, pick.reshape(-1, *([1] * (a.ndim - 1))), axis=1)
            for a in (x, out, gate)
        )
    return block(layer, "attn_out", _attention_out, x.shape[1])(x, out, gate)
