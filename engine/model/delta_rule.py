"""The Gated-DeltaNet recurrence on one layer's q, k, v: the native kernel's pass over the
positions of a decode step or verify (CPUs with the kernel), the closed-form (WY) chunk that
keeps the state after every position (verify) and the one-position step (decode) in mlx ops,
the blocked closed form for prefill, and the captures those passes leave for the commit."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from engine.model import products
from engine.model.activations import exp

#: the reference's l2-norm epsilon for the query and key heads (added to the sum of squares)
L2_EPS = 1e-6


def native_delta_rule() -> bool:
    """Whether decode steps and verifies run the recurrence on the native kernel."""
    return products.on_native()


def delta_rule_native(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    log_g: mx.array,
    beta: mx.array,
    state: mx.array,
) -> tuple[mx.array, Capture]:
    """The recurrence over T positions on the native kernel (``delta_rule_chunk``'s arguments
    and result, except that q and k come as the layer's conv emits them, at the key heads: the
    kernel l2-normalizes each head vector, ``x / sqrt(sum x^2 + L2_EPS)``, scales q by
    ``Dk^-0.5`` as mlx-lm's ``normalize_qk`` does, and serves value head h from key head
    ``h // (Hv / Hk)``; two norms of three primitives each fewer a layer).

    The kernel runs ``S_t = g_t S_{t-1} + u_t k_t^T``, ``u_t = beta_t (v_t - g_t S_{t-1} k_t)``,
    ``y_t = S_t q_t`` position by position, one row of the state at a time (row i needs only
    its own ``(S k)_i``, so it stays in cache for all T positions: the state is read once and
    written once, on every core). Each position computes the same bits whether it runs alone
    or among T, and the state after any kept position is replayed from u (``ReplayCapture``)
    bit for bit, so a verify's states and outputs are exactly those of T plain steps."""
    f32 = mx.float32
    log_g = log_g.astype(f32)
    y, u, final = products.native().delta_rule(q, k, v, log_g, beta.astype(f32), state, eps=L2_EPS)
    if q.shape[1] == 1:
        return y, StepCapture(final)
    return y, ReplayCapture(state, k, u, log_g, final)


def delta_rule_layer(
    m: nn.Module, conv_out: mx.array, a: mx.array, b: mx.array, state: mx.array
) -> tuple[mx.array, Capture]:
    """``delta_rule_native`` from what the layer ``m`` has before its recurrence: its conv's
    output ``[B, T, q | k | v]`` and its projections a and b ``[B, T, Hv]``. The kernel splits
    q, k and v itself and computes ``beta = sigmoid(b)`` and the log-decay
    ``-exp(A_log) * softplus(a + dt_bias)`` (mlx-lm's ``compute_g``, in float32 libm
    functions) in the same op: six ops of mlx's fewer a layer (the split, three reshapes, the
    gate's compiled kernel and the sigmoid). Returns y ``[B, T, Hv, Dv]`` (float32) and the
    capture, whose replay takes the keys as the conv's slice and the log-decays the op wrote."""
    y, u, final, log_g = products.native().delta_rule_layer(
        conv_out, a, b, m.A_log, m.dt_bias, state, m.num_k_heads, eps=L2_EPS
    )
    if conv_out.shape[1] == 1:
        return y, StepCapture(final)
    # the keys as the conv's slice: their heads split (a copy) only when a replay reads them
    return y, ReplayCapture(state, conv_out[..., m.key_dim : 2 * m.key_dim], u, log_g, final)


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
#: the same tokens computes. 64: of 16..128, the fastest here (docs/CPU_CHOICES.md).
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


@dataclass
class ReplayCapture:
    """What the native kernel's pass over T positions keeps of one GDN layer: the state before
    it, its keys, u and log-decays, and the state after the last position. The state after
    position n < T is the kernel's replay of the first n updates from ``start``
    (``S_t = g_t S_{t-1} + u_t k_t^T`` with the pass's own u): no product of the state with a
    key is re-run, and the floats are bit for bit the ones the pass computed there."""

    start: mx.array  # S_0 [B, H, Dv, Dk]
    k: mx.array  # [B, T, Hk, Dk] or [B, T, Hk * Dk], as the pass took it (the replay normalizes
    # it the same way)
    u: mx.array  # [B, T, H, Dv]
    log_g: mx.array  # [B, T, H]
    final: mx.array  # the state after position T

    def arrays(self) -> list[mx.array]:
        return [self.start, self.k, self.u, self.log_g, self.final]

    def outputs(self) -> list[mx.array]:
        """What a compiled block returns of it (the caller holds ``start``: ``capture_of``)."""
        return [self.k, self.u, self.log_g, self.final]

    def state_after(self, n: int) -> mx.array:
        """The recurrent state after the first ``n`` positions."""
        if n == self.k.shape[1]:
            return self.final
        # a constant, not an op (``mx.full`` is two a layer, on every partly accepted cycle)
        return self._replay(mx.array([n] * self.k.shape[0], dtype=mx.int32))

    def row(self, b: int) -> ReplayCapture:
        return ReplayCapture(*(a[b : b + 1] for a in self.arrays()))

    def states_after(self, last: mx.array) -> mx.array:
        """Every row's state after its position ``last[b]`` (0-based): one replay for all rows."""
        return self._replay((last + 1).astype(mx.int32))

    def _replay(self, keep: mx.array) -> mx.array:
        # the keys as the pass took them (heads joined or split): the op splits them itself
        return products.native().delta_rule_replay(
            self.start, self.k, self.u, self.log_g, keep, eps=L2_EPS
        )


def capture_of(start: mx.array, positions: int, outputs: list[mx.array]) -> Capture:
    """A capture from what a compiled GDN block returned (``outputs()``) over ``positions``."""
    if positions == 1:
        return StepCapture(*outputs)
    if native_delta_rule():
        return ReplayCapture(start, *outputs)
    return VerifyCapture(start, *outputs)


Capture = VerifyCapture | ReplayCapture | StepCapture
