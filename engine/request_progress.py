"""One request's output so far (``Progress``): what each committed cycle adds to its events and
stats, the stop conditions that cut a cycle's tokens (``apply_stops``), the commit of the kept
tokens (``commit_for_request``) and their logprobs. ``Engine.row_steps`` (``engine.runtime``)
runs the loop that feeds it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx

from engine.api import (
    MAX_DRAFT_TOKENS,
    GenerationEvent,
    GenerationRequest,
    GenerationStats,
    RequestError,
    TokenLogprob,
)
from engine.cycle.sequence import Sequence
from engine.cycle.speculative import CycleResult, commit
from engine.scheduling.policy import DraftPolicy
from sampling.constraint import GrammarDeadEnd
from sampling.distribution import top_k_ids


@dataclass
class Progress:
    """One request's output so far: what each cycle adds to its events and stats."""

    request: GenerationRequest
    policy: DraftPolicy
    stats: GenerationStats
    trace: Callable[[dict[str, Any]], None] | None
    stop_ids: frozenset[int]
    started: float
    generated: int = 0
    #: reasoning tokens the thinking budget still allows (None: no budget, or the reasoning
    #: has ended)
    reasoning_left: int | None = None
    #: the prompt's scores (``GenerationRequest.prompt_logprobs``), until the first event
    prompt_logprobs: list[TokenLogprob] | None = None

    @classmethod
    def start(
        cls,
        request: GenerationRequest,
        policy: DraftPolicy,
        seq: Sequence,
        trace: Callable[[dict[str, Any]], None] | None,
        prompt_seconds: float,
        prompt_logprobs: list[TokenLogprob] | None = None,
    ) -> Progress:
        stats = GenerationStats(prompt_tokens=len(request.prompt_ids), cached_tokens=seq.restored)
        stats.prompt_seconds = prompt_seconds
        stats.draft_tokens = policy.fixed if policy.fixed is not None else MAX_DRAFT_TOKENS
        stats.k_histogram = [0] * (MAX_DRAFT_TOKENS + 1)
        stats.accepted_per_position = [0] * MAX_DRAFT_TOKENS
        stats.proposed_per_position = [0] * MAX_DRAFT_TOKENS
        stop_ids = frozenset() if request.ignore_eos else request.stop_token_ids
        return cls(
            request,
            policy,
            stats,
            trace,
            stop_ids,
            time.perf_counter(),
            reasoning_left=request.reasoning_budget,
            prompt_logprobs=prompt_logprobs,
        )

    @property
    def remaining(self) -> int:
        return self.request.max_tokens - self.generated

    def reach(self, remaining: int) -> int:
        """The most tokens the next cycle may emit: ``remaining``, and under a thinking budget
        up to the token that closes the reasoning at the latest."""
        if self.reasoning_left is None:
            return remaining
        return min(remaining, self.reasoning_left + 1)

    def bound_reasoning(self, result: CycleResult) -> CycleResult:
        """``result`` under the thinking budget: its token past the budget replaced by the
        reasoning's end when the reasoning has not ended before it (``reach`` kept the cycle
        from emitting more). The replaced token is the cycle's last, not yet fed to the model,
        so the caches are as they would be had the model drawn it."""
        left = self.reasoning_left
        if left is None:
            return result
        end = self.request.reasoning_end
        emitted = result.emitted
        if end in emitted:
            self.reasoning_left = None
            return result
        if len(emitted) <= left:
            self.reasoning_left = left - len(emitted)
            return result
        if result.committed or len(emitted) != left + 1:
            raise RuntimeError("a cycle ran past the thinking budget")
        self.reasoning_left = None
        return replace(result, emitted=[*emitted[:-1], end])

    def finished_empty(self) -> GenerationEvent:
        """The one event of a request for no tokens (``max_tokens`` 0): its prompt's scores."""
        self.stats.generation_seconds = time.perf_counter() - self.started
        scored, self.prompt_logprobs = self.prompt_logprobs, None
        return GenerationEvent([], finish_reason="length", stats=self.stats, prompt_logprobs=scored)

    def cancelled(self) -> GenerationEvent:
        self.stats.generation_seconds = time.perf_counter() - self.started
        return GenerationEvent([], finish_reason="cancelled", stats=self.stats)

    def event(
        self,
        result: CycleResult,
        emitted: list[int],
        finish: str | None,
        context_len: int,
        commit_seconds: float,
    ) -> GenerationEvent:
        """The event of a committed cycle: ``emitted`` = accepted drafts, then the trunk's
        token, cut at a stop; the first min(n_accepted, len(emitted)) tokens are drafts and
        usage counts exactly those."""
        drafted = [i < result.n_accepted for i in range(len(emitted))]
        self.generated += len(emitted)
        _record(self.stats, result, sum(drafted), self.generated, commit_seconds)
        if self.trace is not None:
            self.trace(
                {
                    "context_len": context_len,
                    "draft": result.draft_ids,
                    "accepted": result.n_accepted,
                    "emitted": emitted,
                }
            )
        top = self.request.top_logprobs
        logprobs = _logprobs(result, emitted, top) if top is not None else None
        self.stats.generation_seconds = time.perf_counter() - self.started
        if finish is not None and self.policy.fixed is None:
            used = [k for k, n in enumerate(self.stats.k_histogram) if n]
            self.stats.draft_tokens = max(used, default=0)
        scored, self.prompt_logprobs = self.prompt_logprobs, None
        return GenerationEvent(
            emitted,
            logprobs,
            finish,
            self.stats,
            drafted=drafted,
            cycle_draft_tokens=len(result.draft_ids),
            prompt_logprobs=scored,
        )


def cancelled_in_prefill(request: GenerationRequest, started: float) -> GenerationEvent:
    """The one event of a request cancelled while its prompt was prefilled."""
    stats = GenerationStats(prompt_tokens=len(request.prompt_ids))
    stats.prompt_seconds = time.perf_counter() - started
    return GenerationEvent([], finish_reason="cancelled", stats=stats)


def commit_for_request(seq: Sequence, result: CycleResult, n_keep: int) -> list[int]:
    """``commit``; a grammar dead end the kept tokens ran into is this request's error (the
    caches were committed first, so the sequence stays consistent)."""
    try:
        return commit(seq, result, n_keep)
    except GrammarDeadEnd as exc:
        raise RequestError(str(exc), "grammar", code="unsatisfiable_grammar") from exc


def apply_stops(
    emitted: list[int], stop_ids: frozenset[int], remaining: int
) -> tuple[int, str | None]:
    """How many emitted tokens survive (EOS included) and why generation ends, if it does."""
    for j, token in enumerate(emitted[:remaining]):
        if token in stop_ids:
            return j + 1, "stop"
    if len(emitted) >= remaining:
        return remaining, "length"
    return len(emitted), None


def _record(
    stats: GenerationStats, result: CycleResult, kept_drafts: int, generated: int, commit_s: float
) -> None:
    """Add one cycle. ``kept_drafts``: its accepted drafts that were emitted (a stop token
    among the drafts cuts the rest), so ``accepted`` counts drafted tokens of the output."""
    k = len(result.draft_ids)
    stats.cycles += 1
    stats.k_histogram[k] += 1
    stats.proposed += k
    stats.accepted += kept_drafts
    for i in range(k):
        stats.proposed_per_position[i] += 1
        if i < kept_drafts:
            stats.accepted_per_position[i] += 1
    stats.completion_tokens = generated
    stats.draft_seconds += result.draft_seconds
    stats.verify_seconds += result.verify_seconds
    stats.accept_seconds += result.accept_seconds
    stats.commit_seconds += commit_s


def _logprobs(result: CycleResult, emitted: list[int], top: int | None) -> list[TokenLogprob]:
    """Log-probabilities of the emitted tokens under the model (raw logits, no sampler)."""
    return token_logprobs(result.verify_logits[: len(emitted)], emitted, top)


def token_logprobs(logits: mx.array, ids: list[int], top: int | None) -> list[TokenLogprob]:
    """``ids[i]``'s log-probability under ``logits[i]`` (log-softmax of the raw logits, no
    sampler), with the ``top`` most likely tokens of each row (none for 0 or None), most likely
    first (equal values by token id). The top are picked out of the row (``top_k_ids``), not
    sorted with it: a scored prompt's chunk is 128 rows of the whole vocabulary, which a sort
    took ~30 ms a row to order at Qwen3.5's 248,320 tokens, and mlx's argpartition ~6 ms."""
    n = len(ids)
    logp = logits.astype(mx.float32)
    logp = logp - mx.logsumexp(logp, axis=-1, keepdims=True)
    chosen = logp[mx.arange(n), mx.array(ids)]
    if top:
        top = min(top, logp.shape[-1])
        top_ids = top_k_ids(logp, top)
        top_vals = mx.take_along_axis(logp, top_ids, axis=-1)
        mx.eval(chosen, top_ids, top_vals)
        pairs = [
            sorted(zip(i, v, strict=True), key=lambda pair: (-pair[1], pair[0]))
            for i, v in zip(top_ids.tolist(), top_vals.tolist(), strict=True)
        ]
    else:
        mx.eval(chosen)
        pairs = [[] for _ in range(n)]
    return [TokenLogprob(t, lp, p) for t, lp, p in zip(ids, chosen.tolist(), pairs, strict=True)]
