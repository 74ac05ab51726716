"""The native gated delta rule (engine/model/native/delta_rule*) against numpy in float64: odd
head sizes, grouped key heads, several rows, the l2 norm of q and k, every instruction set this
CPU runs; and the
bit-identities decoding relies on — a pass over T positions computes position by position the
floats of T one-position passes, and a replay of the first n positions the state the pass had
there — whatever the instruction set or thread count."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.model import delta_rule, products

native = products.native()
pytestmark = pytest.mark.skipif(native is None, reason="the native kernel is not built")

ISAS = native.supported_isas() if native is not None else []


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest):
    native.set_isa(request.param)
    yield request.param
    native.set_isa("")


def _operands(
    B: int, T: int, Hk: int, Hv: int, Dk: int, Dv: int, seed: int
) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    f32 = np.float32
    q = rng.standard_normal((B, T, Hk, Dk)).astype(f32)  # raw: the kernel normalizes them
    k = rng.standard_normal((B, T, Hk, Dk)).astype(f32)
    v = rng.standard_normal((B, T, Hv, Dv)).astype(f32)
    log_g = -rng.random((B, T, Hv)).astype(f32)
    beta = rng.random((B, T, Hv)).astype(f32)
    state = rng.standard_normal((B, Hv, Dv, Dk)).astype(f32)
    return q, k, v, log_g, beta, state


def _l2(x: np.ndarray, scale: float = 1.0) -> np.ndarray:
    x = x.astype(np.float64)
    return scale * x / np.sqrt((x * x).sum(axis=-1, keepdims=True) + 1e-6)


def _reference(q, k, v, log_g, beta, state) -> tuple[np.ndarray, list[np.ndarray]]:
    """y and the state after each position, in float64, position by position, from q and k as
    the layer's conv emits them (l2-normalized here, q also scaled by Dk^-0.5)."""
    T, Hk, Hv = q.shape[1], q.shape[2], v.shape[2]
    q, k = _l2(q, q.shape[-1] ** -0.5), _l2(k)
    S = state.astype(np.float64).copy()
    y = np.zeros(v.shape)
    states = []
    for t in range(T):
        for h in range(Hv):
            hk = h // (Hv // Hk)
            kt, qt = k[:, t, hk].astype(np.float64), q[:, t, hk].astype(np.float64)
            g = np.exp(log_g[:, t, h].astype(np.float64))
            u = beta[:, t, h, None] * (
                v[:, t, h] - g[:, None] * np.einsum("bij,bj->bi", S[:, h], kt)
            )
            S[:, h] = g[:, None, None] * S[:, h] + u[:, :, None] * kt[:, None, :]
            y[:, t, h] = np.einsum("bij,bj->bi", S[:, h], qt)
        states.append(S.copy())
    return y, states


def _run(operands: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    return tuple(np.array(a) for a in native.delta_rule(*(mx.array(a) for a in operands)))


SHAPES = [  # B, T, Hk, Hv, Dk, Dv
    (1, 1, 2, 4, 64, 64),  # the demo model's heads, a plain step
    (2, 5, 3, 6, 37, 19),  # a partial 16-lane vector, a partial row group
    (3, 4, 1, 3, 16, 5),
    (2, 9, 16, 16, 128, 128),  # Qwen3.5-0.8B's heads, the longest verify: on every thread
    (1, 3, 1, 2, 260, 6),  # keys past the kernel's row buffer: the rows updated in place
]


@pytest.mark.parametrize("shape", SHAPES)
def test_against_float64(isa: str, shape: tuple[int, ...]) -> None:
    operands = _operands(*shape, seed=1)
    y, u, final = _run(operands)
    want_y, states = _reference(*operands)
    assert np.abs(y - want_y).max() < 1e-5 * (np.abs(want_y).max() + 1)
    assert np.abs(final - states[-1]).max() < 1e-5 * (np.abs(states[-1]).max() + 1)


@pytest.mark.parametrize("shape", SHAPES[1:])
def test_a_pass_is_its_steps_and_a_replay_its_state_bit_for_bit(
    isa: str, shape: tuple[int, ...]
) -> None:
    operands = _operands(*shape, seed=2)
    q, k, v, log_g, beta, state = operands
    B, T = q.shape[:2]
    y, u, final = _run(operands)
    # T one-position passes, each from the state the last one left
    running, ys, states = state, [], []
    for t in range(T):
        step = tuple(a[:, t : t + 1] for a in (q, k, v, log_g, beta))
        yt, _, running = _run((*step, running))
        ys.append(yt)
        states.append(running)
    assert np.array_equal(np.concatenate(ys, axis=1), y)
    assert np.array_equal(states[-1], final)
    # each row keeps its own number of positions (0..T)
    keep = np.arange(B, dtype=np.int32) * (T // max(B - 1, 1)) % (T + 1)
    replayed = np.array(
        native.delta_rule_replay(
            mx.array(state), mx.array(k), mx.array(u), mx.array(log_g), mx.array(keep)
        )
    )
    for b, n in enumerate(keep):
        want = state[b] if n == 0 else states[n - 1][b]
        assert np.array_equal(replayed[b], want), (b, n)
    # the keys with their heads joined, as a verify's conv leaves them: the same bits
    joined = mx.array(k).reshape(B, T, -1)
    replayed_joined = native.delta_rule_replay(
        mx.array(state), joined, mx.array(u), mx.array(log_g), mx.array(keep)
    )
    assert np.array_equal(np.array(replayed_joined), replayed)


def test_the_same_bits_on_every_instruction_set_and_thread_count() -> None:
    operands = _operands(2, 5, 16, 16, 128, 128, seed=3)  # large enough to use every thread
    native.set_isa("")
    want = _run(operands)
    before = native.threads()
    try:
        for name in ISAS:
            native.set_isa(name)
            for threads in (1, 2, 3):
                native.set_threads(threads)
                got = _run(operands)
                assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)), (
                    name,
                    threads,
                )
    finally:
        native.set_threads(before)
        native.set_isa("")


def test_lazy_compiled_strided_and_half_precision() -> None:
    """A node of the graph like any op: inside mx.compile, on transposed and bf16 inputs (read
    through their strides, widened to float32)."""
    q, k, v, log_g, beta, state = (mx.array(a) for a in _operands(1, 3, 2, 4, 32, 24, seed=4))
    want = [np.array(a) for a in native.delta_rule(q, k, v, log_g, beta, state)]
    q_strided = mx.array(np.ascontiguousarray(np.array(q).transpose(0, 2, 1, 3))).transpose(
        0, 2, 1, 3
    )

    @mx.compile
    def f(*a: mx.array) -> list[mx.array]:
        return native.delta_rule(*a)

    got = [np.array(a) for a in f(q_strided, k, v, log_g, beta, state)]
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    half = native.delta_rule(q.astype(mx.bfloat16), k, v.astype(mx.bfloat16), log_g, beta, state)
    assert np.allclose(np.array(half[0]), want[0], atol=5e-2, rtol=5e-2)


def test_bad_operands_raise() -> None:
    q, k, v, log_g, beta, state = (mx.array(a) for a in _operands(1, 2, 2, 4, 8, 8, seed=5))
    with pytest.raises(ValueError):
        native.delta_rule(q, k, v, log_g, beta, state.astype(mx.bfloat16))  # state: float32
    with pytest.raises(ValueError):
        native.delta_rule(q, k, v[:, :, :3], log_g, beta, state)  # 3 value heads, 2 key heads
    with pytest.raises(ValueError):
        native.delta_rule(q[:, :1], k, v, log_g, beta, state)
    with pytest.raises(ValueError):
        native.delta_rule_replay(state, k, v, log_g, mx.array([1.0]))  # keep: int32


def test_the_capture_commits_the_state_of_the_kept_positions() -> None:
    """``delta_rule_native``'s capture (what a verify leaves for the commit): the state after any
    kept count, alone or per row of a batch, is the state of that many one-position passes."""
    q, k, v, log_g, beta, state = (mx.array(a) for a in _operands(2, 4, 2, 4, 32, 16, seed=6))
    _, capture = delta_rule.delta_rule_native(q, k, v, log_g, beta, state)
    running, states = state, []
    for t in range(4):
        step = (a[:, t : t + 1] for a in (q, k, v, log_g, beta))
        _, one = delta_rule.delta_rule_native(*step, running)
        running = one.state_after(1)
        states.append(np.array(running))
    for n in range(1, 5):
        assert np.array_equal(np.array(capture.state_after(n)), states[n - 1]), n
    per_row = np.array(capture.states_after(mx.array([2, 0])))
    assert np.array_equal(per_row[0], states[2][0])
    assert np.array_equal(per_row[1], states[0][1])
    assert np.array_equal(np.array(capture.row(1).state_after(3)), states[2][1:2])


def test_the_layer_form_splits_and_gates_as_mlx_and_replays_its_steps_bit_for_bit() -> None:
    """``delta_rule_layer`` (the recurrence from a layer's conv output, a and b): the outputs of
    ``delta_rule_native`` on the split heads and mlx's beta and log-decay, within float32
    rounding of the gate's libm functions; its pass over T positions is T one-position passes
    bit for bit, and its capture replays each kept count's state bit for bit."""
    import types

    import mlx.nn as nn

    B, T, Hk, Hv, Dk, Dv = 2, 4, 2, 4, 32, 16
    rng = np.random.default_rng(7)
    key = Hk * Dk
    conv = mx.array(rng.standard_normal((B, T, 2 * key + Hv * Dv)).astype(np.float32))
    a, b = (mx.array(rng.standard_normal((B, T, Hv)).astype(np.float32) * 3) for _ in "ab")
    state = mx.array(rng.standard_normal((B, Hv, Dv, Dk)).astype(np.float32))
    m = types.SimpleNamespace(
        A_log=mx.array(rng.standard_normal(Hv).astype(np.float32)),
        dt_bias=mx.array(rng.standard_normal(Hv).astype(np.float32)),
        num_k_heads=Hk,
        key_dim=key,
        head_k_dim=Dk,
    )
    y, capture = delta_rule.delta_rule_layer(m, conv, a, b, state)
    q = conv[..., :key].reshape(B, T, Hk, Dk)
    k = conv[..., key : 2 * key].reshape(B, T, Hk, Dk)
    v = conv[..., 2 * key :].reshape(B, T, Hv, Dv)
    log_g = -mx.exp(m.A_log) * nn.softplus(a + m.dt_bias)
    want, _ = delta_rule.delta_rule_native(q, k, v, log_g, mx.sigmoid(b), state)
    assert np.abs(np.array(y) - np.array(want)).max() < 1e-4 * (np.abs(np.array(want)).max() + 1)
    assert np.allclose(np.array(capture.log_g), np.array(log_g), rtol=1e-5, atol=1e-6)
    running, ys, states = state, [], []
    for t in range(T):
        sl = slice(t, t + 1)
        yt, one = delta_rule.delta_rule_layer(m, conv[:, sl], a[:, sl], b[:, sl], running)
        running = one.state_after(1)
        ys.append(np.array(yt))
        states.append(np.array(running))
    assert np.array_equal(np.concatenate(ys, axis=1), np.array(y))
    for n in range(1, T + 1):
        assert np.array_equal(np.array(capture.state_after(n)), states[n - 1]), n
    per_row = np.array(capture.states_after(mx.array([2, 0])))
    assert np.array_equal(per_row[0], states[2][0])
    assert np.array_equal(per_row[1], states[0][1])
    with pytest.raises(ValueError):
        native.delta_rule_layer(conv[..., 1:], a, b, m.A_log, m.dt_bias, state, Hk)
