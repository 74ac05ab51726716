"""The one truncation function: logits -> the distribution every token is drawn from.

``truncate`` is used for the first token after prefill, every draft distribution q, every
target distribution p, the residual, the bonus token and plain (K=0) decoding. Using one function
everywhere is what makes speculative sampling exact: q and p are truncated identically, so the
acceptance rule compares the same kind of distribution the plain sampler would draw from.

Order (vLLM / HF): logit_bias and penalties -> temperature -> top_k -> top_p -> min_p, each step
on the renormalised result of the previous one. Temperature 0 (or top_k 1) yields a point mass on
the argmax, so greedy decoding is the same code path: with point masses the acceptance rule
accepts exactly when the draft equals the target argmax.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache, partial
from types import ModuleType

import mlx.core as mx

from engine.model.products import native, on_native
from sampling.params import SamplingParams


class PenaltyHistory:
    """What the penalties need to know about a sequence, kept on device.

    ``output_counts[v]`` counts occurrences of token v among *generated* tokens (presence and
    frequency penalties, OpenAI semantics); ``seen[v]`` marks tokens in prompt or output
    (repetition penalty, HF/vLLM semantics).
    """

    def __init__(self, vocab_size: int, prompt_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.output_counts = mx.zeros((vocab_size,), dtype=mx.float32)
        seen = mx.zeros((vocab_size,), dtype=mx.bool_)
        if prompt_ids:
            seen[mx.array(prompt_ids)] = True
        self.seen = seen

    def extend(self, token_ids: list[int] | mx.array) -> None:
        """Count generated tokens (host ids, or a device array not read back yet)."""
        if len(token_ids) == 0:
            return
        ids = token_ids if isinstance(token_ids, mx.array) else mx.array(token_ids)
        self.output_counts = self.output_counts.at[ids].add(1.0)
        self.seen = mx.logical_or(self.seen, self.output_counts > 0)

    def row_after(self, draft_ids: list[mx.array]) -> tuple[mx.array, mx.array]:
        """One row of (counts, seen) with the given (device) draft tokens appended."""
        counts = self.output_counts
        for d in draft_ids:
            counts = counts + (mx.arange(self.vocab_size) == d).astype(mx.float32).reshape(-1)
        return counts[None], mx.logical_or(self.seen, counts > 0)[None]

    def rows(self, draft_ids: mx.array | None, n_rows: int) -> tuple[mx.array, mx.array]:
        """Per-row (counts, seen) for rows 0..n_rows-1, where row i also counts draft_ids[:i].

        That is the history the i-th speculative position would have under plain decoding.
        """
        counts = mx.broadcast_to(self.output_counts, (n_rows, self.vocab_size))
        if draft_ids is not None and n_rows > 1:
            onehot = (draft_ids[: n_rows - 1, None] == mx.arange(self.vocab_size)[None]).astype(
                mx.float32
            )
            prefix = mx.concatenate([mx.zeros((1, self.vocab_size)), mx.cumsum(onehot, axis=0)])
            counts = counts + prefix
        seen = mx.logical_or(self.seen[None], counts > 0)
        return counts, seen


def apply_penalties(
    logits: mx.array, params: SamplingParams, counts: mx.array, seen: mx.array
) -> mx.array:
    if params.repetition_penalty != 1.0:
        r = params.repetition_penalty
        penalised = mx.where(logits > 0, logits / r, logits * r)
        logits = mx.where(seen, penalised, logits)
    if params.frequency_penalty != 0.0:
        logits = logits - params.frequency_penalty * counts
    if params.presence_penalty != 0.0:
        logits = logits - params.presence_penalty * (counts > 0).astype(logits.dtype)
    return logits


def adjusted_logits(
    logits: mx.array, params: SamplingParams, history: tuple[mx.array, mx.array] | None
) -> mx.array:
    """First step of the truncation: logit_bias and penalties, in float32."""
    logits = logits.astype(mx.float32)
    if params.logit_bias:
        ids = mx.array(list(params.logit_bias.keys()))
        bias = mx.zeros((logits.shape[-1],), dtype=mx.float32)
        bias[ids] = mx.array(list(params.logit_bias.values()), dtype=mx.float32)
        logits = logits + bias
    if params.uses_history:
        if history is None:
            raise ValueError("penalties need the token history")
        logits = apply_penalties(logits, params, *history)
    return logits


def greedy_tokens(
    logits: mx.array, params: SamplingParams, history: tuple[mx.array, mx.array] | None = None
) -> mx.array:
    """The support of ``truncated_probs`` when ``params.greedy``: its argmax, without building
    the one-hot rows (the hot path of greedy decoding). int32 ``[T]``."""
    return argmax_ids(adjusted_logits(logits, params, history))


def argmax_ids(logits: mx.array) -> mx.array:
    """The index of each row's largest logit (ties: the first), int32 ``[...]`` for ``[..., V]``:
    on a CPU with mtpserve's kernels one native op (mlx's CPU argmax walks a row element by
    element: ~0.23 ms a 248,320-token row, 1.2 ms for a verify's five against ~0.1 ms),
    elsewhere ``mx.argmax``.

    On NaN logits the two differ: the native op counts a NaN as -inf (a NaN is picked only
    where nothing in its row exceeds -inf), where ``mx.argmax``, like numpy's, may return a
    NaN's index. A process runs one of them for every greedy draw, draft and target alike, so the
    acceptance rule compares argmaxes taken by one rule and greedy decoding stays exact within
    a process; no op is spent on the mlx path to make it agree."""
    if on_native() and logits.dtype == mx.float32:
        return native().argmax(logits)
    return mx.argmax(logits, axis=-1).astype(mx.int32)


@dataclass(frozen=True)
class Truncated:
    """Rows of truncated, renormalised distributions: ``probs[t, j]`` is the probability of
    token ``ids[t, j]`` (each row's ids in increasing order). With top_k set (< vocabulary) a
    row holds its k candidates only, every other token having probability 0 — so drafting, the
    acceptance rule and the draws work on k entries instead of the vocabulary; without top_k
    ``ids`` is None and column j is token j
    (``probs`` is ``[T, V]``)."""

    probs: mx.array
    ids: mx.array | None

    def dense(self, vocab_size: int) -> mx.array:
        """The rows over the whole vocabulary, ``[T, V]``."""
        if self.ids is None:
            return self.probs
        zeros = mx.zeros((self.probs.shape[0], vocab_size), dtype=mx.float32)
        return mx.put_along_axis(zeros, self.ids, self.probs, axis=-1)

    @staticmethod
    def concatenate(rows: list[Truncated]) -> Truncated:
        ids = None if rows[0].ids is None else mx.concatenate([r.ids for r in rows])
        return Truncated(mx.concatenate([r.probs for r in rows]), ids)


def truncate(
    logits: mx.array,
    params: SamplingParams,
    history: tuple[mx.array, mx.array] | None = None,
) -> Truncated:
    """Map logits ``[T, V]`` to the truncated, renormalised distributions (float32).

    ``history`` is ``(counts, seen)`` per row (see ``PenaltyHistory.rows``); required when the
    params use penalties. Invariants: every row sums to 1; a token with probability 0 here is
    never emitted by any path of the engine.
    """
    logits = adjusted_logits(logits, params, history)
    if params.greedy:
        # Point mass on the argmax: greedy decoding through the same acceptance rule.
        top = argmax_ids(logits)[..., None]
        return Truncated(mx.ones(top.shape, dtype=mx.float32), top)
    if (op := _native_truncation(logits, params)) is not None:
        probs, ids = op.top_k_truncate(
            logits, params.temperature, params.top_k, params.top_p, params.min_p
        )
        return Truncated(probs, ids)
    truncation = _compiled_truncation(params.temperature, params.top_k, params.top_p, params.min_p)
    probs, *ids = truncation(logits)
    return Truncated(probs, ids[0] if ids else None)


def truncate_and_sample(
    logits: mx.array,
    params: SamplingParams,
    uniforms: mx.array,
    history: tuple[mx.array, mx.array] | None = None,
) -> tuple[Truncated, mx.array]:
    """``truncate`` and one inverse-CDF draw per row (``draw_tokens_with``, row t drawn by
    ``uniforms[t]``, e.g. ``keyed_uniforms``) in one compiled call: a draft step runs both, and
    on CPUs the one dispatch group instead of two saved ~50 us a step (~0.2 ms of a sampled K=4
    cycle). Same truncation, same draw."""
    if params.greedy:
        rows = truncate(logits, params, history)
        return rows, rows.ids[:, 0]
    logits = adjusted_logits(logits, params, history)
    if (op := _native_truncation(logits, params)) is not None:
        probs, ids, tokens = op.top_k_truncate(
            logits, params.temperature, params.top_k, params.top_p, params.min_p, uniforms
        )
        return Truncated(probs, ids), tokens
    fused = _compiled_truncation(
        params.temperature, params.top_k, params.top_p, params.min_p, draw=True
    )
    probs, *ids, token = fused(logits, uniforms)
    return Truncated(probs, ids[0] if ids else None), token


def truncated_probs(
    logits: mx.array,
    params: SamplingParams,
    history: tuple[mx.array, mx.array] | None = None,
) -> mx.array:
    """``truncate`` over the whole vocabulary, ``[T, V]``."""
    return truncate(logits, params, history).dense(logits.shape[-1])


def _native_truncation(logits: mx.array, params: SamplingParams) -> ModuleType | None:
    """The native op module when this truncation runs as one op (``top_k_truncate``, the rules
    of ``_truncate`` and ``inverse_cdf_index`` row by row in C++): on a CPU that runs mtpserve's
    kernels, with top_k narrower than the vocabulary (Qwen's defaults). mlx's formulation is
    ~45 primitives, each its own task on the CPU stream's one thread (a sampled plain step of
    the demo model spent ~0.2 ms of ~1.2 ms on them). Elsewhere, and without top_k, None: the
    compiled mlx formulation runs.

    The two give each row the same distribution except where logits tie at the k-th place:
    the native op keeps the lower token ids, mlx's argpartition (``top_k_ids``) may keep
    either; the native op also counts a NaN logit as -inf, where mlx's partition gives it no
    defined place. Their probabilities may differ in the last bits. A process uses one of the
    two for every draft, target and plain draw, so each such row is resolved one way
    throughout and q and p stay truncated alike."""
    if 0 < params.top_k < logits.shape[-1] and logits.ndim == 2 and on_native():
        return native()
    return None


@lru_cache(maxsize=64)
def _compiled_truncation(
    temperature: float, top_k: int, top_p: float, min_p: float, draw: bool = False
) -> Callable[..., tuple[mx.array, ...]]:
    """``_truncate`` for one setting, compiled (with ``draw``, followed by an inverse-CDF draw
    from its rows, taking one uniform per row): a sampled cycle runs it on every draft step and
    on the verify rows, and on CPUs its ~20 small ops cost more dispatched one by one (T=2
    rows: 256 -> 153 us). The settings are compile-time constants; T recompiles per shape."""
    settings = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    if not draw:
        return mx.compile(partial(_truncate, **settings))

    def truncate_and_draw(logits: mx.array, uniforms: mx.array) -> tuple[mx.array, ...]:
        probs, *ids = _truncate(logits, **settings)
        return (probs, *ids, draw_tokens_with(probs, ids[0] if ids else None, uniforms))

    return mx.compile(truncate_and_draw)


def _truncate(
    logits: mx.array, temperature: float, top_k: int, top_p: float, min_p: float
) -> tuple[mx.array, ...]:
    """temperature -> top_k -> top_p -> min_p on adjusted float32 logits ``[T, V]``: ``(probs,
    ids)`` as ``Truncated`` holds them, ``(probs,)`` without top_k (a compiled function returns
    arrays only)."""
    vocab = logits.shape[-1]
    logits = logits / temperature
    if 0 < top_k < vocab:
        # Everything after top_k happens on the k candidates only (the rest have probability
        # 0 from here on): no full-vocabulary sort, scatter or cumulative sum on the hot path.
        # In token order: an inverse-CDF draw walks the candidates in their column order, and
        # the selection's order moves with rounding (a batch row's logits can differ from the
        # same row's alone in the last bits); in token order a draw's outcome moves only when
        # its uniform lies within that rounding of a boundary.
        ids = mx.sort(top_k_ids(logits, top_k), axis=-1)
        kept = softmax(mx.take_along_axis(logits, ids, axis=-1))
        return _top_p_min_p(kept, top_p, min_p), ids
    return (_top_p_min_p(softmax(logits), top_p, min_p),)


#: narrower rows keep mlx's one-primitive softmax (``softmax``)
WIDE_SOFTMAX = 2048


def softmax(logits: mx.array) -> mx.array:
    """Softmax over the last axis of float32 logits.

    On CPUs a row of ``WIDE_SOFTMAX`` or more (a vocabulary: most of a sampled row's
    truncation without top_k) takes its exponential from ``power(e, x)``, a third of mlx's CPU
    ``exp``; the four primitives that costs instead of one lose below ~2,000 columns, so
    narrower rows and other devices use ``mx.softmax`` (docs/CPU_CHOICES.md)."""
    if logits.shape[-1] < WIDE_SOFTMAX or mx.default_device().type != mx.DeviceType.cpu:
        return mx.softmax(logits, axis=-1, precise=True)
    weights = mx.power(math.e, logits - mx.max(logits, axis=-1, keepdims=True))
    return weights / mx.sum(weights, axis=-1, keepdims=True)


def _top_p_min_p(probs: mx.array, top_p: float, min_p: float) -> mx.array:
    """top_p then min_p on rows of probabilities (any width), each renormalised."""
    if top_p < 1.0:
        order = mx.argsort(-probs, axis=-1)
        sorted_probs = mx.take_along_axis(probs, order, axis=-1)
        mass_before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
        # Smallest set of most likely tokens whose mass reaches top_p: keep a token while the
        # mass of the more likely ones is still below top_p.
        keep_sorted = mass_before < top_p
        keep = mx.put_along_axis(mx.zeros(probs.shape, dtype=mx.bool_), order, keep_sorted, axis=-1)
        probs = mx.where(keep, probs, 0.0)
        probs = probs / probs.sum(axis=-1, keepdims=True)
    if min_p > 0.0:
        threshold = min_p * probs.max(axis=-1, keepdims=True)
        probs = mx.where(probs >= threshold, probs, 0.0)
        probs = probs / probs.sum(axis=-1, keepdims=True)
    return probs


#: vocabulary block width for ``top_k_ids``
TOP_K_BLOCK = 128


def top_k_ids(logits: mx.array, k: int) -> mx.array:
    """Indices of the k largest entries of each row of ``[T, V]`` (in no particular order), int32.

    In two stages over blocks of ``TOP_K_BLOCK`` tokens: the k blocks with the largest maxima,
    then the k largest entries among those blocks' tokens. Exact: a token among the k largest
    lies in a block whose maximum is at least its value, and fewer than k blocks can have a
    larger maximum (each holds a distinct larger token), so its block is among the k kept
    (with ties, the kept values are still the k largest). Why: mlx's CPU argpartition is slow
    on long rows — 5 rows of 8,192 took ~0.5 ms, most of a sampled verify's sampler work;
    the two stages partition 64 block maxima and 2,560 tokens instead (~0.1 ms).
    """
    rows, vocab = logits.shape
    blocks = vocab // TOP_K_BLOCK
    if vocab % TOP_K_BLOCK or blocks < 2 * k:
        return mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k].astype(mx.int32)
    by_block = logits.reshape(rows, blocks, TOP_K_BLOCK)
    top_blocks = mx.argpartition(-by_block.max(axis=-1), kth=k - 1, axis=-1)[:, :k]
    kept = mx.take_along_axis(by_block, top_blocks[..., None], axis=1).reshape(rows, -1)
    inner = mx.argpartition(-kept, kth=k - 1, axis=-1)[:, :k]
    block_of = mx.take_along_axis(top_blocks, inner // TOP_K_BLOCK, axis=-1)
    return (block_of * TOP_K_BLOCK + inner % TOP_K_BLOCK).astype(mx.int32)


def sample(rows: Truncated, key: mx.array) -> mx.array:
    """Draw one token per row of ``rows`` (``inverse_cdf_draw``); int32 ``[T]``."""
    if rows.ids is None:
        return _compiled_draw(rows.probs, key)
    return _compiled_sample_ids(rows.probs, rows.ids, key)


def inverse_cdf_draw(probs: mx.array, key: mx.array) -> mx.array:
    """Draw one column per row of ``probs [T, W]`` (rows need not be normalised) with one
    uniform per row from ``key``; int32 ``[T]`` (``inverse_cdf_index``)."""
    u = mx.random.uniform(shape=(probs.shape[0],), key=key)
    return inverse_cdf_index(probs, u)


def inverse_cdf_index(probs: mx.array, uniforms: mx.array) -> mx.array:
    """Column of each row of ``probs [T, W]`` at the uniform ``uniforms[t]`` in [0, 1); int32
    ``[T]``.

    Inverse CDF: with ``c`` the running sum of a row and its uniform ``u``, column i is drawn
    iff ``c[i-1] <= u * c[-1] < c[i]``: probability exactly ``p_i / sum(p)``, and a column with
    probability 0 has an empty interval, so it is never drawn. One random number per row
    instead of the V Gumbel draws of ``mx.random.categorical`` (~150 us per 8k-token row on a
    CPU, more than the rest of the sampler). Compiled by its callers (five ops, fewer
    dispatches).
    """
    cdf = mx.cumsum(probs.astype(mx.float32), axis=-1)
    index = (cdf <= uniforms.reshape(-1, 1) * cdf[:, -1:]).sum(axis=-1)
    # Rounding can put u * c[-1] on c[-1] itself (u just below 1): clamp to the last column
    # that has mass, never past it onto a zero-probability one.
    last = probs.shape[-1] - 1 - mx.argmax(probs[:, ::-1] > 0, axis=-1)
    return mx.minimum(index, last).astype(mx.int32)


def draw_tokens(probs: mx.array, ids: mx.array | None, key: mx.array) -> mx.array:
    """One draw per row of ``probs`` as ``Truncated`` holds them (``ids`` None: column j is
    token j): the drawn column's token id, int32 ``[T]``. Compiled by its callers."""
    index = inverse_cdf_draw(probs, key)
    return index if ids is None else mx.take_along_axis(ids, index[:, None], axis=-1)[:, 0]


def draw_tokens_with(probs: mx.array, ids: mx.array | None, uniforms: mx.array) -> mx.array:
    """``draw_tokens`` with the uniforms given, one per row (``keyed_uniforms``)."""
    index = inverse_cdf_index(probs, uniforms)
    return index if ids is None else mx.take_along_axis(ids, index[:, None], axis=-1)[:, 0]


_compiled_draw = mx.compile(inverse_cdf_draw)
_compiled_sample_ids = mx.compile(draw_tokens)


#: what a keyed uniform is for (``keyed_uniforms``): a position's draft draw, its acceptance
#: test, and the draw of the token emitted there (a residual, a bonus or a plain draw)
DRAFT, ACCEPT, EMIT = 0, 1, 2

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit integers in which every input bit moves
    every output bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def keyed_uniform(seed: int, position: int, purpose: int) -> float:
    """A uniform in (0, 1) fixed by (seed, sequence position, purpose): counter-based (a hash
    chain, no PRNG state), so a row's draw at a position is the same whichever cycle, batch or
    moment draws it. 24 bits, as float32 holds them: ``(h + 1/2) / 2^24``."""
    h = _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ position) ^ purpose)
    return ((h >> 40) + 0.5) / float(1 << 24)


def keyed_uniforms(seed: int, positions: range, purpose: int) -> mx.array:
    """``keyed_uniform`` for each of ``positions``: float32 ``[len(positions)]``."""
    return mx.array([keyed_uniform(seed, p, purpose) for p in positions], dtype=mx.float32)


def keyed_uniform_rows(seeds: list[int], firsts: list[int], count: int, purpose: int) -> mx.array:
    """``keyed_uniforms`` of B rows at once: row b holds seed ``seeds[b]``'s uniforms at
    positions ``firsts[b] .. firsts[b] + count - 1``; float32 ``[B, count]``."""
    return mx.array(
        [
            [keyed_uniform(seed, p, purpose) for p in range(first, first + count)]
            for seed, first in zip(seeds, firsts, strict=True)
        ],
        dtype=mx.float32,
    )
