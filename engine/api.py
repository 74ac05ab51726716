"""The one narrow seam between callers (HTTP server, CLI, benchmarks) and the mlx engine.

Callers build a ``GenerationRequest`` (token ids in, sampler, limits) and consume
``GenerationEvent``s (token ids out, per-token logprobs, finish reason, statistics). Nothing in
this module imports mlx, so the server can import it freely.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

# where a --model argument lies (a folder, or a Hugging Face repo in the local cache)
from engine.model.location import ModelNotFound as ModelNotFound
from engine.model.location import resolve_model_dir as resolve_model_dir
from sampling.params import SamplingParams

FinishReason = Literal["stop", "length", "cancelled"]

#: ``draft_tokens=None``: the engine's default, which chooses K per cycle from measured costs
#: unless the engine was loaded with a fixed K (a request's ``"auto"`` chooses whatever it was).
AUTO_DRAFT = None
#: Largest K a request or a command-line flag may ask for (the verify pass's compiled shapes).
MAX_DRAFT_TOKENS = 8
#: The embedded demo model, served when no ``--model`` is given.
DEMO_MODEL = Path(__file__).resolve().parent.parent / "models" / "qwen3.5-demo"
#: What ``--draft-vocab`` means, for every command that takes it.
DRAFT_VOCAB_HELP = (
    "draft over the N most frequent tokens (0: full vocabulary; default: the checkpoint's "
    "draft_vocab.json default, else full)"
)


def parse_draft_tokens(value: str | int | None) -> int | None:
    """``'auto'`` (or None) -> None; an integer in 0..MAX_DRAFT_TOKENS -> itself; anything
    else -> ``ValueError`` naming the range (flags fail at start, not on every request)."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("auto", "")):
        return AUTO_DRAFT
    try:
        k = int(value)
    except (TypeError, ValueError):
        k = -1
    if not 0 <= k <= MAX_DRAFT_TOKENS:
        raise ValueError(
            f"draft tokens must be 'auto' or an integer in 0..{MAX_DRAFT_TOKENS}, got {value!r}"
        )
    return k


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    sampling: SamplingParams
    #: at most this many tokens; 0: none, the prompt only prefilled (and scored, with
    #: ``prompt_logprobs``)
    max_tokens: int
    #: Token ids that end generation (every id of generation_config's ``eos_token_id``).
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    #: Speculative draft length K; 0 = plain decoding; ``None``: the engine's default (automatic
    #: unless it was loaded with a fixed K); ``"auto"``: automatic whatever that default is.
    draft_tokens: int | Literal["auto"] | None = AUTO_DRAFT
    #: Number of top alternatives to report per emitted token (``None``: no logprobs at all).
    top_logprobs: int | None = None
    #: Score the prompt too: the log-probability of each prompt token after the first under
    #: the model (raw logits, as ``top_logprobs``), with this many top alternatives each, on the
    #: first event (``GenerationEvent.prompt_logprobs``; OpenAI's completions ``echo`` with
    #: ``logprobs``, which evaluation harnesses read to score a text). The prompt is then
    #: prefilled whole: a prefix restored from the conversation cache has no logits to score.
    #: ``None``: the prompt is not scored.
    prompt_logprobs: int | None = None
    #: Structured output: an llguidance grammar the generated tokens must follow
    #: (``sampling.constraint.json_schema_grammar``); None: unconstrained.
    grammar: str | None = None
    #: ``grammar`` already compiled (``Engine.constraint``, off the engine's thread) for this
    #: request alone: the engine advances it as the output grows; None: compiled at start.
    constraint: Any = None
    #: A prompt position the conversation cache also snapshots: where the prompt's last message
    #: begins, so that a next turn whose template re-renders the previous reply (Qwen's drops its
    #: think block) still reuses everything before it. None: only the block ends and the end.
    snapshot_at: int | None = None
    #: A thinking budget: the reply's first tokens are reasoning (the prompt leaves a think
    #: block open) and once ``reasoning_budget`` of them have come without
    #: ``reasoning_end`` (the id that closes the block, Qwen's ``</think>``), the next token
    #: is that id, whatever the model would draw: the answer then follows as the model writes
    #: it. None: the reasoning runs until the model closes it or ``max_tokens``.
    reasoning_budget: int | None = None
    reasoning_end: int | None = None


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    #: Prompt tokens restored from the conversation cache instead of prefilled (OpenAI's
    #: ``usage.prompt_tokens_details.cached_tokens``).
    cached_tokens: int = 0
    completion_tokens: int = 0
    #: The K requested (or the largest K auto used); per-cycle K is in ``k_histogram``.
    draft_tokens: int = 0
    proposed: int = 0
    #: Drafts the trunk accepted that are in the output (those after a stop token are not):
    #: the number of tokens marked ``drafted`` in the events.
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    proposed_per_position: list[int] = field(default_factory=list)
    cycles: int = 0
    #: cycles run with each K (index = K)
    k_histogram: list[int] = field(default_factory=list)
    prompt_seconds: float = 0.0
    generation_seconds: float = 0.0
    #: wall time split of the decode loop (meaningful with profiling syncs; see bench):
    #: draft / verify forward / acceptance + the cycle's sync / cache commit (rollback)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    accept_seconds: float = 0.0
    commit_seconds: float = 0.0

    def add(self, other: GenerationStats) -> None:
        """Sum another generation's figures into these (for totals over several choices)."""
        for name in (
            "prompt_tokens",
            "cached_tokens",
            "completion_tokens",
            "proposed",
            "accepted",
            "cycles",
            "prompt_seconds",
            "generation_seconds",
            "draft_seconds",
            "verify_seconds",
            "accept_seconds",
            "commit_seconds",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.draft_tokens = max(self.draft_tokens, other.draft_tokens)
        for name in ("accepted_per_position", "proposed_per_position", "k_histogram"):
            mine, theirs = getattr(self, name), getattr(other, name)
            mine = mine or [0] * len(theirs)
            setattr(self, name, [a + b for a, b in zip(mine, theirs, strict=True)])

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def generation_tps(self) -> float:
        return self.completion_tokens / self.generation_seconds if self.generation_seconds else 0.0

    @property
    def tokens_per_cycle(self) -> float:
        return self.completion_tokens / self.cycles if self.cycles else 0.0


@dataclass
class GenerationEvent:
    """New tokens from one decode cycle (one or more ids), or the final event.

    The last event of a generation has ``finish_reason`` set; it may carry tokens too.
    ``stats`` is a running snapshot, complete on the final event.
    """

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stats: GenerationStats | None = None
    #: Per token of ``token_ids``: True where the token is a draft the MTP head proposed and the
    #: trunk accepted, False where the trunk chose it (first token, correction or bonus).
    drafted: list[bool] | None = None
    #: The K of the cycle that produced these tokens (``None`` for the final empty event).
    cycle_draft_tokens: int | None = None
    #: On the first event of a request that asked for them (``prompt_logprobs``): prompt token
    #: i + 1's log-probability after tokens 0..i, for every i (one fewer than the prompt's).
    prompt_logprobs: list[TokenLogprob] | None = None


class RequestError(ValueError):
    """The request cannot be served as asked (maps to HTTP 400). ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class ContextLengthExceeded(RequestError):
    def __init__(self, message: str) -> None:
        super().__init__(message, param="max_tokens", code="context_length_exceeded")


class EngineUnavailable(RuntimeError):
    """The engine cannot serve any more (a rank of a distributed group was lost): HTTP 503."""


def release_worker_thread() -> None:
    """Free what mlx keeps for the thread that ran the model, from that thread, before it ends
    (``engine.model.memory.release_thread`` says why); imports mlx only when called."""
    from engine.model.memory import release_thread

    release_thread()
