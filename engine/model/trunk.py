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
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

from engine.model import products
from engine.model.activations import exp, gated_rms_norm, sigmoid, silu
from engine.model.attention import RowKVCache, attend_rows
from engine.model.products import linear


def delta_rule_chunk(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    log_g: mx.array,
    beta: mx.array,
    state: mx.array,
    substitution: bool = False,
) -> tuple[mx.array, VerifyCapture]:
    """T gated delta-rule steps at once, in closed form (no per-position loop).

    q, k: ``[B, T, H, Dk]``; v: ``[B, T, H, Dv]``; log_g, beta: ``[B, T, H]``; state:
    ``[B, H, Dv, Dk]`` (float32). Returns y ``[B, T, H, Dv]`` and what ``state_after`` needs.

    The recurrence (mlx-lm's ``gated_delta_update``) is, per head,
    ``S_t = g_t S_{t-1} + u_t k_t^T`` with ``u_t = beta_t (v_t - g_t S_{t-1} k_t)`` and
    ``y_t = S_t q_t``. With ``c_t = sum_{s<=t} log g_s`` and ``D[t, s] = exp(c_t - c_s)`` for
    ``s <= t`` (0 above the diagonal), unrolling gives

        S_t = exp(c_t) S_0 + sum_{s<=t} D[t, s] u_s k_s^T
        (I + N) U = beta * (V - exp(c) * K S_0^T),   N = beta * (D_strict * K K^T)
        Y = exp(c) * Q S_0^T + (D * Q K^T) U

    N is strictly lower triangular (nilpotent). For a verify pass (T = K+1 <= 10)
    ``(I + N)^-1 = (I - N)(I + N^2)(I + N^4)..`` with ceil(log2 T) factors: plain products on
    any device, so the block compiles, and the op count no longer grows with T (on CPUs, where
    a small decode step is bound by per-op dispatch, the per-position loop made every extra
    verified position cost ~0.1 ms per layer). That series is exact only in exact arithmetic:
    its partial sums hold powers of N whose entries grow like binomial coefficients C(T-1, j)
    when keys repeat (the same token again, with little decay), ~126 at T = 10 but past
    float32's range by T = 32. A prefill's blocks of 64 (``delta_rule_prefill``, CPUs) pass
    ``substitution``: ``I + N`` is inverted by triangular substitution (LAPACK's ``trtri`` on
    the CPU stream), backward stable at any T.
    The state after any position n is a masked sum over the captured U and K (``state_after``),
    so rolling back to the accepted position re-runs nothing.
    """
    f32 = mx.float32
    q, k, v = (t.astype(f32).transpose(0, 2, 1, 3) for t in (q, k, v))  # [B, H, T, D]
    c = mx.cumsum(log_g.astype(f32).transpose(0, 2, 1), axis=-1)  # [B, H, T]
    beta = beta.astype(f32).transpose(0, 2, 1)[..., None]  # [B, H, T, 1]
    T = q.shape[2]
    rows, cols = mx.arange(T)[:, None], mx.arange(T)[None, :]
    diff = c[..., :, None] - c[..., None, :]  # c_t - c_s
    decay = exp(mx.where(cols <= rows, diff, -mx.inf))  # D, zero above the diagonal
    strict = mx.where(cols < rows, decay, 0.0)
    gamma = exp(c)[..., None]  # [B, H, T, 1]
    state_t = state.swapaxes(-1, -2)  # S_0^T: [B, H, Dk, Dv]
    rhs = beta * (v - gamma * (k @ state_t))
    power = -(beta * (strict * (k @ k.swapaxes(-1, -2))))  # -N
    if substitution:
        u = mx.linalg.tri_inv(mx.eye(T) - power, upper=False, stream=mx.cpu) @ rhs
    else:
        u, covered = rhs, 1
        while covered < T:
            u = u + power @ u
            covered *= 2
            if covered < T:
                power = power @ power
    y = gamma * (q @ state_t) + (decay * (q @ k.swapaxes(-1, -2))) @ u
    return y.transpose(0, 2, 1, 3), VerifyCapture(state, u, k, decay, gamma)


#: Positions per closed-form block of a prefill's recurrence on CPUs. Blocks end at multiples of
#: it counted from position 0 (as prefill chunks do, and it divides them), so a prefill resumed
#: at a chunk boundary — a conversation-cache block end — computes the floats a cold prefill of
#: the same tokens computes. 64: of 16..128, the fastest here (docs/BENCHMARKS.md,
#: "CPU choices and what they measured").
PREFILL_GDN_BLOCK = 64


def delta_rule_prefill(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    log_g: mx.array,
    beta: mx.array,
    state: mx.array,
    start: int,
) -> tuple[mx.array, mx.array]:
    """The gated delta rule over a prompt chunk at positions ``start..start+T-1``, in closed-form
    blocks of ``PREFILL_GDN_BLOCK`` positions (``delta_rule_chunk``'s arguments); returns y and
    the state after the last position.

    mlx-lm's recurrence runs position by position where it has no kernel (CPUs): ~10 primitives
    a position and layer, most of a CPU prefill's time. A block of 64 costs ~35 primitives."""
    T = q.shape[1]
    ys: list[mx.array] = []
    t = 0
    while t < T:
        end = min(T, t + PREFILL_GDN_BLOCK - (start + t) % PREFILL_GDN_BLOCK)
        part = (x[:, t:end] for x in (q, k, v, log_g, beta))
        y, capture = delta_rule_chunk(*part, state, substitution=True)
        state = capture.state_after(end - t)
        ys.append(y)
        t = end
    return (ys[0] if len(ys) == 1 else mx.concatenate(ys, axis=1)), state


def delta_rule_step(
    q: mx.array, k: mx.array, v: mx.array, log_g: mx.array, beta: mx.array, state: mx.array
) -> tuple[mx.array, StepCapture]:
    """One gated delta-rule step (T = 1: a plain cycle), with ``delta_rule_chunk``'s arguments
    and result: ``S_1 = g S_0 + u k^T``, ``u = beta (v - g S_0 k)``, ``y = S_1 q``.

    The closed form's T x T decay and triangular inverse are a third of a plain step's GDN
    primitives, all for one position; here the new state is computed in the block, so the
    commit of the one position runs nothing either."""
    f32 = mx.float32
    B, _, H, Dk = q.shape
    Dv = v.shape[-1]
    k = k.astype(f32)
    g = mx.exp(log_g.astype(f32)).reshape(B, H, 1, 1)
    decayed = g * state  # [B, H, Dv, Dk]
    u = beta.astype(f32).reshape(B, H, 1, 1) * (
        v.astype(f32).reshape(B, H, Dv, 1) - decayed @ k.reshape(B, H, Dk, 1)
    )  # [B, H, Dv, 1]
    final = decayed + u * k.reshape(B, H, 1, Dk)
    y = final @ q.astype(f32).reshape(B, H, Dk, 1)  # [B, H, Dv, 1]
    return y.reshape(B, 1, H, Dv), StepCapture(final)


@dataclass
class StepCapture:
    """What a one-position pass keeps of a GDN layer: the state after its position."""

    final: mx.array  # [B, H, Dv, Dk]

    def arrays(self) -> list[mx.array]:
        return [self.final]

    def outputs(self) -> list[mx.array]:
        """What a compiled block returns of it (``capture_of`` rebuilds it)."""
        return [self.final]

    def state_after(self, n: int) -> mx.array:
        if n != 1:
            raise ValueError("a one-position pass keeps exactly its one position")
        return self.final

    def row(self, b: int) -> StepCapture:
        return StepCapture(self.final[b : b + 1])

    def states_after(self, last: mx.array) -> mx.array:
        """Every row's state after its position ``last[b]`` (always 0 here)."""
        return self.final


@dataclass
class VerifyCapture:
    """What a verify pass keeps of one GDN layer to produce the state after any position.

    ``decay`` and ``gamma`` derive from the cumulative log-decay, but the verify block computes
    them anyway; keeping them makes ``state_after`` (run every cycle, eagerly, per GDN layer)
    two slices and one product instead of re-deriving them with ~6 more dispatched ops.
    """

    start: mx.array  # S_0 [B, H, Dv, Dk]
    u: mx.array  # [B, H, T, Dv]
    k: mx.array  # [B, H, T, Dk]
    decay: mx.array  # D [B, H, T, T]
    gamma: mx.array  # exp(c) [B, H, T, 1]

    def arrays(self) -> list[mx.array]:
        return [self.start, self.u, self.k, self.decay, self.gamma]

    def outputs(self) -> list[mx.array]:
        """What a compiled block returns of it (the caller holds ``start``: ``capture_of``)."""
        return [self.u, self.k, self.decay, self.gamma]

    def state_after(self, n: int) -> mx.array:
        """The recurrent state after the first ``n`` (>= 1) positions."""
        w = self.decay[:, :, n - 1, :, None]  # [B, H, T, 1]
        return (
            self.gamma[:, :, n - 1, :, None] * self.start + (self.u * w).swapaxes(-1, -2) @ self.k
        )

    def row(self, b: int) -> VerifyCapture:
        return VerifyCapture(*(a[b : b + 1] for a in self.arrays()))

    def states_after(self, last: mx.array) -> mx.array:
        """Every row's state after its position ``last[b]`` (0-based), with one set of ops (a
        per-row gather along the captured positions) instead of one ``state_after`` per row."""
        rows, heads, positions = self.decay.shape[0], self.decay.shape[1], self.decay.shape[2]
        pick = mx.broadcast_to(last[:, None, None, None], (rows, heads, 1, positions))
        w = mx.take_along_axis(self.decay, pick, axis=2).swapaxes(-1, -2)  # [B, H, T, 1]
        gamma = mx.take_along_axis(self.gamma, pick[..., :1], axis=2)  # [B, H, 1, 1]
        return gamma * self.start + (self.u * w).swapaxes(-1, -2) @ self.k


def capture_of(start: mx.array, positions: int, outputs: list[mx.array]) -> Capture:
    """A capture from what a compiled GDN block returned (``outputs()``) over ``positions``."""
    return StepCapture(*outputs) if positions == 1 else VerifyCapture(start, *outputs)


Capture = VerifyCapture | StepCapture


class GDNLayerState:
    """Conv window and recurrent state of one Gated-DeltaNet layer, plus verify captures.

    After a batched verify the row's commit may be deferred (``BatchCommit``): ``conv`` and
    ``recurrent`` then form on first read, for every row of the batch at once when all have
    committed."""

    def __init__(self, conv: mx.array | None = None, recurrent: mx.array | None = None) -> None:
        self._conv, self._recurrent = conv, recurrent
        # Filled by a capturing forward over T positions; consumed by ``commit``.
        self.conv_window: mx.array | None = None
        self.capture: Capture | None = None
        #: a batched verify's captures this row committed to but has not formed yet
        self.batch: BatchCommit | None = None
        self.row = 0

    @property
    def conv(self) -> mx.array | None:
        if self.batch is not None:
            self.batch.settle(self.row)
        return self._conv

    @conv.setter
    def conv(self, value: mx.array | None) -> None:
        self.settled(value, self.recurrent)

    @property
    def recurrent(self) -> mx.array | None:
        if self.batch is not None:
            self.batch.settle(self.row)
        return self._recurrent

    @recurrent.setter
    def recurrent(self, value: mx.array | None) -> None:
        self.settled(self.conv, value)

    def settled(self, conv: mx.array | None, recurrent: mx.array | None) -> None:
        """Set both states (no commit pending any more)."""
        self._conv, self._recurrent, self.batch = conv, recurrent, None

    def commit(self, n_keep: int, kernel: int) -> None:
        if self.batch is not None and self.capture is None:
            self.batch.keep(self.row, n_keep)
            return
        if self.conv_window is None:
            return
        self.settled(
            self.conv_window[:, n_keep : n_keep + kernel - 1], self.capture.state_after(n_keep)
        )
        self.conv_window = None
        self.capture = None


class BatchCommit:
    """One GDN layer's captures from a batched verify of B rows, committed for all rows at once.

    Each row's ``commit`` records how many positions it keeps; when every row has, the states
    at the kept lengths are formed for all rows with one set of ops (a per-row gather along
    the captured positions) instead of one set per row, and the next batched forward over the
    same rows in the same order takes the stacked states as they are (``stacked``). A row read
    before the others have committed (one that finishes while the others go on) forms its own
    state from its rows of the captures, exactly as a single sequence does.

    The rows' states point at their ``BatchCommit`` and it points back only weakly: a finished
    row's states (a layer's window and captures each) are then freed with its sequence, not
    whenever Python's cycle collector next reaches them (which left the demo model's server
    holding 10-25 MiB more after a burst of requests)."""

    def __init__(
        self, states: list[GDNLayerState], window: mx.array, capture: Capture, kernel: int
    ) -> None:
        self.states = [weakref.ref(state) for state in states]
        self.window, self.capture, self.kernel = window, capture, kernel
        self.keeps: list[int | None] = [None] * len(states)
        self.conv: mx.array | None = None
        self.recurrent: mx.array | None = None
        for row, state in enumerate(states):
            state.batch, state.row = self, row
            state.conv_window = state.capture = None

    def keep(self, row: int, n_keep: int) -> None:
        self.keeps[row] = n_keep
        if all(k is not None for k in self.keeps):
            self._form_all()

    def settle(self, row: int) -> None:
        """Form row ``row``'s states now (all rows' if all have committed)."""
        n_keep = self.keeps[row]
        if n_keep is None:
            raise RuntimeError("a GDN state read between a verify and its commit")
        if self.recurrent is None:
            one = self.capture.row(row)
            window = self.window[row : row + 1]
            self.states[row]().settled(
                window[:, n_keep : n_keep + self.kernel - 1], one.state_after(n_keep)
            )

    def stacked(self, states: list[GDNLayerState]) -> tuple[mx.array, mx.array] | None:
        """The stacked states if ``states`` are exactly this batch's rows, in order, formed
        together and untouched since."""
        if self.recurrent is None or len(states) != len(self.states):
            return None
        rows = zip(states, self.states, strict=True)
        if any(state is not ref() or state.batch is not self for state, ref in rows):
            return None
        return self.conv, self.recurrent

    def _form_all(self) -> None:
        last = mx.array(self.keeps) - 1  # [B]: each row's last kept position
        self.recurrent = self.capture.states_after(last)
        window_rows = (last + 1)[:, None] + mx.arange(self.kernel - 1)[None]  # [B, kernel-1]
        self.conv = mx.take_along_axis(self.window, window_rows[..., None], axis=1)
        for row, ref in enumerate(self.states):
            if (state := ref()) is not None:  # a row that left has nothing to form
                state._conv = self.conv[row : row + 1]
                state._recurrent = self.recurrent[row : row + 1]


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
        return products.activations(trunk.model.embed_tokens(token_ids))

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


def gated_deltanet(
    m: nn.Module, x: mx.array, state: GDNLayerState, capture: bool, start: int = 0
) -> mx.array:
    """mlx-lm's ``GatedDeltaNet`` forward over positions ``start..start+T-1``, optionally
    capturing the state after each position.

    Without capture (prefill) the recurrence is ``delta_rule_prefill``'s closed-form blocks on
    CPUs and mlx-lm's elsewhere (its kernel on Metal)."""
    B, T, _ = x.shape
    flat = x.reshape(B * T, -1)  # 2-D products: no flatten/unflatten around each of them
    qkv = linear(m.in_proj_qkv, flat).reshape(B, T, -1)
    z = linear(m.in_proj_z, flat).reshape(B, T, m.num_v_heads, m.head_v_dim)
    b = linear(m.in_proj_b, flat).reshape(B, T, -1)
    a = linear(m.in_proj_a, flat).reshape(B, T, -1)

    conv_state = state.conv
    if conv_state is None:
        conv_state = mx.zeros((B, m.conv_kernel_size - 1, m.conv_dim), dtype=x.dtype)
    window = mx.concatenate([conv_state, qkv], axis=1)
    conv_out = silu(m.conv1d(window))
    q, k, v = mx.split(conv_out, [m.key_dim, 2 * m.key_dim], axis=-1)
    q = q.reshape(B, T, m.num_k_heads, m.head_k_dim)
    k = k.reshape(B, T, m.num_k_heads, m.head_k_dim)
    v = v.reshape(B, T, m.num_v_heads, m.head_v_dim)
    q, k = normalize_qk(q, k, inv_scale=m.head_k_dim**-0.5, eps=1e-6)

    recurrent = state.recurrent
    if recurrent is None:
        recurrent = mx.zeros((B, m.num_v_heads, m.head_v_dim, m.head_k_dim), dtype=mx.float32)
    if not capture and mx.default_device().type != mx.DeviceType.cpu:
        y, recurrent = gated_delta_update(
            q, k, v, a, b, m.A_log, m.dt_bias, recurrent, None, use_kernel=True
        )
    else:
        beta = mx.sigmoid(b)
        # log of mlx-lm's compute_g: g = exp(-exp(A_log) * softplus(a + dt_bias))
        log_g = -mx.exp(m.A_log.astype(mx.float32)) * nn.softplus(a + m.dt_bias)
        if (repeat := m.num_v_heads // m.num_k_heads) > 1:
            q = mx.repeat(q, repeat, axis=-2)
            k = mx.repeat(k, repeat, axis=-2)
        if capture:
            rule = delta_rule_step if T == 1 else delta_rule_chunk
            y, state.capture = rule(q, k, v, log_g, beta, recurrent)
        else:
            y, recurrent = delta_rule_prefill(q, k, v, log_g, beta, recurrent, start)
        y = y.astype(x.dtype)
    if capture:
        state.conv_window = window
    else:
        state.conv = window[:, -(m.conv_kernel_size - 1) :]
        state.recurrent = recurrent
    out = linear(m.out_proj, gated_rms_norm(m.norm, y, z).reshape(B * T, -1)).reshape(B, T, -1)
    if getattr(m, "sharding_group", None) is not None:
        # tensor parallel (mlx-lm's shard()): out_proj holds this rank's rows of the heads
        out = mx.distributed.all_sum(out, group=m.sharding_group)
    return out


def leads_a_group(trunk: Any) -> bool:
    """Rank 0 of a sharded model (engine.distributed): its forwards and the head's uses of the
    vocabulary tables hold collectives, which stay out of compiled blocks and are evaluated
    synchronously."""
    return getattr(trunk, "mtpserve_leader", None) is not None


def trunk_hidden(trunk: Any, token_ids: mx.array, cache: TrunkCache, capture: bool) -> mx.array:
    """Run the trunk over ``token_ids [1, T]``; return post-final-norm hidden states [1, T, H].

    With ``capture`` (the decode cycle: T = K+1 small) every layer runs as a compiled block and
    the GDN layers keep per-position states; the caller must ``cache.commit(n_keep, T)`` before
    the next forward. Without it (prefill: long, varying T) the same layers run eagerly, the
    GDN layers through ``delta_rule_prefill``'s closed-form blocks on CPUs (mlx-lm's recurrence
    elsewhere: its kernel on Metal), keeping no per-position states.
    """
    x = cache.embed(trunk, token_ids, capture)
    if capture and token_ids.shape[1] <= MAX_COMPILED_T:
        return cache.forwarded(_trunk_rows(trunk, x, [cache]))
    start = cache.length
    for layer, c in zip(trunk.layers, cache.layers, strict=True):
        if layer.is_linear:
            normed = layer.input_layernorm(x)
            x = x + gated_deltanet(layer.linear_attn, normed, c, capture, start)
            x = x + mlp(layer, layer.post_attention_layernorm(x))
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
    return _trunk_rows(trunk, products.activations(trunk.model.embed_tokens(token_ids)), caches)


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
    """The compiled ``build(module)``, cached on the module itself (it dies with the model)."""
    blocks = module.__dict__.setdefault("_mtpserve_compiled", {})
    if kind not in blocks:
        blocks[kind] = mx.compile(build(module))
    return blocks[kind]


def mlp(layer: nn.Module, x: mx.array) -> mx.array:
    """The layer's MLP: mlx-lm's dense SwiGLU by ``linear``; any other (experts) as it is."""
    m = layer.mlp
    if not all(n in m for n in ("gate_proj", "up_proj", "down_proj")):
        return m(x)
    flat = x.reshape(-1, x.shape[-1])  # 2-D products: no flatten/unflatten around each
    out = linear(m.down_proj, silu(linear(m.gate_proj, flat)) * linear(m.up_proj, flat))
    return out.reshape(x.shape)


def _gdn_block(layer: nn.Module) -> Callable[..., Any]:
    m = layer.linear_attn

    def block(x: mx.array, conv: mx.array, recurrent: mx.array) -> tuple[mx.array, ...]:
        state = GDNLayerState(conv, recurrent)
        h = x + gated_deltanet(m, layer.input_layernorm(x), state, capture=True)
        h = h + mlp(layer, layer.post_attention_layernorm(h))
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
        normed = layer.input_layernorm(x).reshape(B * L, -1)  # 2-D products
        queries = linear(a.q_proj, normed).reshape(B, L, a.num_attention_heads, -1)
        queries, gate = mx.split(queries, 2, -1)
        keys = linear(a.k_proj, normed).reshape(B, L, a.num_key_value_heads, -1)
        values = linear(a.v_proj, normed).reshape(B, L, a.num_key_value_heads, -1)
        queries = a.rope(a.q_norm(queries).transpose(0, 2, 1, 3), offset=offset) * a.scale
        keys = a.rope(a.k_norm(keys).transpose(0, 2, 1, 3), offset=offset)
        return queries, keys, values.transpose(0, 2, 1, 3), gate.reshape(B, L, -1)

    return block


def _attention_out(layer: nn.Module) -> Callable[..., Any]:
    a = layer.self_attn

    def block(x: mx.array, attended: mx.array, gate: mx.array) -> mx.array:
        B, L, H = x.shape
        attended = attended.transpose(0, 2, 1, 3).reshape(B * L, -1)
        out = linear(a.o_proj, attended * sigmoid(gate.reshape(B * L, -1)))
        h = x + out.reshape(B, L, H)
        return h + mlp(layer, layer.post_attention_layernorm(h))

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
) -> mx.array:
    """A full-attention decoder layer (trunk or MTP head) over T new positions with its cache.

    ``position`` is the sequence position of the first new token (RoPE); it defaults to the
    cache's length and differs only for a head cache that skipped positions (see
    ``engine.cycle.speculative``). With ``last_only`` every position's keys and values enter the
    cache but only the last position's output is computed and returned (``[B, 1, H]``): the
    rest of the layer (attention output, o_proj, MLP) is per position, and a one-layer head's
    earlier outputs are never used. Compiled up to ``MAX_COMPILED_T`` positions, eager beyond.
    """
    position = cache.offset if position is None else position
    return attention_block_rows(layer, x, [cache], [position], last_only)


def attention_block_rows(
    layer: nn.Module,
    x: mx.array,
    caches: list[KVCache],
    positions: list[int],
    last_only: bool = False,
    lengths: list[int] | None = None,
) -> mx.array:
    """``attention_block`` for B rows at once: ``x [B, T, H]``, row b continuing ``caches[b]``
    at sequence position ``positions[b]``. Projections, RoPE (one offset per row) and the MLP
    run over every row together; each row attends over its own cache. ``lengths`` (with
    ``last_only``): row b's real positions are its last ``lengths[b]`` columns, the earlier
    ones padding that never enters its cache."""
    length = x.shape[1]
    offset = mx.array(positions[0]) if len(positions) == 1 else mx.array(positions)
    queries, keys, values, gate = block(layer, "attn_in", _attention_in, length)(x, offset)
    if last_only and length > 1:
        # the last query sees every cached key: no mask
        x, queries, gate = x[:, -1:], queries[:, :, -1:], gate[:, -1:]
    if length <= MAX_COMPILED_T or last_only:
        # a cycle's positions or a head step: the same numbers alone and in a batch
        out = attend_rows(queries, keys, values, caches, lengths)
    else:  # a prompt chunk (one row)
        attended = []
        for b, cache in enumerate(caches):
            row_keys, row_values = cache.update_and_fetch(keys[b : b + 1], values[b : b + 1])
            attended.append(
                mx.fast.scaled_dot_product_attention(
                    queries[b : b + 1], row_keys, row_values, scale=1.0, mask="causal"
                )
            )
        out = attended[0] if len(attended) == 1 else mx.concatenate(attended)
    return block(layer, "attn_out", _attention_out, x.shape[1])(x, out, gate)
