"""A Gated-DeltaNet layer's state and forward: its conv window and recurrent state
(``GDNLayerState``), the deferred batched commit of those states (``BatchCommit``), and the
layer's forward over q, k, v projections into the recurrence (``gated_deltanet``)."""

from __future__ import annotations

import weakref

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

from engine.model import products
from engine.model.activations import silu
from engine.model.delta_rule import (
    L2_EPS,
    Capture,
    delta_rule_chunk,
    delta_rule_layer,
    delta_rule_prefill,
    delta_rule_step,
    native_delta_rule,
)
from engine.model.norms import gated_rms_norm
from engine.model.products import linear, linears


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
    at the kept lengths are formed for all rows with one set of ops (slices where every row
    kept as many, else a per-row pick along the captured positions) instead of one set per
    row, and the next batched forward over the same rows in the same order takes the stacked
    states as they are (``stacked``). A row read before the others have committed (one that
    finishes while the others go on) forms its own state from its rows of the captures,
    exactly as a single sequence does.

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
        keeps, width = self.keeps, self.kernel - 1
        if all(keep == keeps[0] for keep in keeps):
            # every row kept as many positions (every plain cycle): the states there as one
            # row's, a slice of the windows and, after the last position, the pass's own final
            # state (docs/CPU_CHOICES.md, "A batch's GDN states formed by slices")
            self.recurrent = self.capture.state_after(keeps[0])
            self.conv = self.window[:, keeps[0] : keeps[0] + width]
        else:
            self.recurrent = self.capture.states_after(mx.array(keeps) - 1)
            # each row's kept window as whole rows of the flattened windows (mlx's CPU take
            # copies a row at a time; take_along_axis computes every element's index)
            B, P, C = self.window.shape
            rows = mx.array([b * P + n + j for b, n in enumerate(keeps) for j in range(width)])
            self.conv = mx.take(self.window.reshape(B * P, C), rows, axis=0).reshape(B, width, C)
        for row, ref in enumerate(self.states):
            if (state := ref()) is not None:  # a row that left has nothing to form
                state._conv = self.conv[row : row + 1]
                state._recurrent = self.recurrent[row : row + 1]


def causal_conv(conv: nn.Conv1d, window: mx.array) -> mx.array:
    """The layer's depthwise causal conv1d over ``window [B, T + K - 1, C]`` (the K - 1 kept
    positions, then the T new ones): ``out[t] = sum_j window[t + j] * w[j]`` as K shifted
    multiply-adds, which mx.compile fuses into one elementwise kernel.

    mlx's CPU ``conv1d`` unfolds the window and runs a grouped product per call: ~0.4 ms a
    0.8B layer for one position against ~0.05 ms here, and over a prompt chunk ~2x slower.
    Each position sums its own K products in the same order whatever T is, so a position's
    output is the same bits in a plain step, a verify and a prefill."""
    columns = _taps(conv)[0]
    positions = window.shape[1] - len(columns) + 1
    out = window[:, :positions] * columns[0]
    for j in range(1, len(columns)):
        out = out + window[:, j : j + positions] * columns[j]
    return out if "bias" not in conv else out + conv.bias


def causal_conv_silu(conv: nn.Conv1d, window: mx.array) -> mx.array:
    """``silu(causal_conv(conv, window))``: on a CPU with the native kernel one op (the same
    products and sums in the same order; silu's exp a 16-lane polynomial within ~2 ulp), where
    mlx's compiled elementwise kernel, calling powf an element at a time, took ~55 us a 0.8B
    layer for one position and ~255 us for five (the op: ~20 / ~100 us)."""
    if native := products.native_for(window):
        return native.causal_conv_silu(window, _taps(conv)[1], conv.get("bias"))
    return silu(causal_conv(conv, window))


def conv_window_silu(conv: nn.Conv1d, state: mx.array, new: mx.array) -> tuple[mx.array, mx.array]:
    """The window ``[state | new]`` along the positions and ``causal_conv_silu`` over it: on a
    CPU with the native kernel one op (the same conv, bit for bit), where mlx takes two."""
    if native := products.native_for(state, new):
        return tuple(native.causal_conv_silu_window(state, new, _taps(conv)[1], conv.get("bias")))
    window = mx.concatenate([state, new], axis=1)
    return window, causal_conv_silu(conv, window)


def _taps(conv: nn.Conv1d) -> tuple[list[mx.array], mx.array]:
    """The conv's taps, split once and kept on the module (slicing them in the block cost two
    primitives a tap and layer every step): each tap's weights over the channels, and all of
    them as one ``[K, C]`` array."""
    taps = conv.__dict__.get("_mtpserve_taps")
    if taps is None or taps[0] is not conv.weight:
        columns = [mx.contiguous(conv.weight[:, j, 0]) for j in range(conv.weight.shape[1])]
        stacked = mx.stack(columns).astype(mx.float32)  # the kernel reads float32 as it is
        mx.eval(columns, stacked)
        taps = conv.__dict__["_mtpserve_taps"] = (conv.weight, columns, stacked)
    return taps[1], taps[2]


def repeat_heads(m: nn.Module, x: mx.array) -> mx.array:
    """Query or key heads repeated to the value heads (each key head serves ``Hv / Hk`` value
    heads in turn, as mlx-lm's layer has it)."""
    repeat = m.num_v_heads // m.num_k_heads
    return mx.repeat(x, repeat, axis=-2) if repeat > 1 else x


def _recurrence(
    m: nn.Module,
    conv_out: mx.array,
    a: mx.array,
    b: mx.array,
    state: GDNLayerState,
    recurrent: mx.array,
    capture: bool,
    start: int,
) -> tuple[mx.array, mx.array]:
    """The recurrence over the conv's output in mlx ops (no native kernel, or a prefill):
    y and the state after the last position (with ``capture`` the per-position captures go to
    ``state.capture`` instead)."""
    B, T, _ = conv_out.shape
    q, k, v = mx.split(conv_out, [m.key_dim, 2 * m.key_dim], axis=-1)
    q = q.reshape(B, T, m.num_k_heads, m.head_k_dim)
    k = k.reshape(B, T, m.num_k_heads, m.head_k_dim)
    v = v.reshape(B, T, m.num_v_heads, m.head_v_dim)
    q, k = normalize_qk(q, k, inv_scale=m.head_k_dim**-0.5, eps=L2_EPS)
    if not capture and mx.default_device().type != mx.DeviceType.cpu:
        return gated_delta_update(
            q, k, v, a, b, m.A_log, m.dt_bias, recurrent, None, use_kernel=True
        )
    beta = mx.sigmoid(b)
    # log of mlx-lm's compute_g: g = exp(-exp(A_log) * softplus(a + dt_bias))
    log_g = -mx.exp(m.A_log.astype(mx.float32)) * nn.softplus(a + m.dt_bias)
    q, k = repeat_heads(m, q), repeat_heads(m, k)
    if capture:
        rule = delta_rule_step if T == 1 else delta_rule_chunk
        y, state.capture = rule(q, k, v, log_g, beta, recurrent)
        return y, recurrent
    return delta_rule_prefill(q, k, v, log_g, beta, recurrent, start)


def gated_deltanet(
    m: nn.Module,
    x: mx.array,
    state: GDNLayerState,
    capture: bool,
    start: int = 0,
    norm: nn.Module | None = None,
) -> mx.array:
    """``x`` plus mlx-lm's ``GatedDeltaNet`` forward of ``norm(x)`` (the decoder layer's input
    norm) over positions ``start..start+T-1``, optionally capturing the state after each
    position. The norm runs inside the input projections' op and the residual inside the output
    projection's where the kernel takes them (``products.linears``, ``products.linear``).

    On a CPU with the native kernel the recurrence is the kernel's (``delta_rule_layer``), with
    capture (decode steps and verifies) or without (prefill: only the final state is kept);
    position by position, so a prompt gives the same state however its chunks split it. It
    made a 512-token prefill at the Qwen3.5-0.8B shape 89 → 145 tokens/s against
    ``delta_rule_prefill``'s closed-form blocks of 64 (docs/BENCHMARKS.md, "Prefill on the
    kernel"). Elsewhere ``delta_rule_step``/``delta_rule_chunk`` with capture, and without it
    ``delta_rule_prefill`` (mlx-lm's kernel on Metal)."""
    B, T, _ = x.shape
    qkv, z, b, a = linears([m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a], x, norm)

    conv_state = state.conv
    if conv_state is None:
        conv_state = mx.zeros((B, m.conv_kernel_size - 1, m.conv_dim), dtype=x.dtype)
    window, conv_out = conv_window_silu(m.conv1d, conv_state, qkv)
    recurrent = state.recurrent
    if recurrent is None:
        recurrent = mx.zeros((B, m.num_v_heads, m.head_v_dim, m.head_k_dim), dtype=mx.float32)
    if native_delta_rule():
        # the kernel splits, normalizes and gates q, k, v itself and serves each value head
        # from its key head: no split, reshape, gate or repeat here
        y, captured = delta_rule_layer(m, conv_out, a, b, recurrent)
        if capture:
            state.capture = captured
        else:
            recurrent = captured.final
    else:
        y, recurrent = _recurrence(m, conv_out, a, b, state, recurrent, capture, start)
    y = y.astype(x.dtype)
    if capture:
        state.conv_window = window
    else:
        state.conv = window[:, -(m.conv_kernel_size - 1) :]
        state.recurrent = recurrent
    gated = gated_rms_norm(m.norm, y, z)  # [B, T, Hv * Dv]
    if getattr(m, "sharding_group", None) is not None:
        # tensor parallel (mlx-lm's shard()): out_proj holds this rank's rows of the heads
        return x + mx.distributed.all_sum(linear(m.out_proj, gated), group=m.sharding_group)
    return linear(m.out_proj, gated, residual=x)
