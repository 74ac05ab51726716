"""``Engine``: the loaded model plus the generation loop behind the ``engine.api`` seam.

The loop turns cycles into ``GenerationEvent``s and applies stop conditions (EOS ids,
max_tokens, cancellation; what each cycle adds: ``engine.request_progress``). A stop inside a
draft block commits only the tokens up to the stop, so the caches always hold exactly prompt +
emitted (minus the last).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx

from engine.api import (
    MAX_DRAFT_TOKENS,
    ContextLengthExceeded,
    GenerationEvent,
    GenerationRequest,
    RequestError,
    TokenLogprob,
)
from engine.cache.prefix_cache import (
    DEFAULT_DISK_BUDGET_BYTES,
    PrefixCache,
    model_fingerprint,
    prefill_hook,
)
from engine.cycle.sequence import (
    PREFILL_CHUNK,
    Sequence,
    new_sequence,
    prefill_steps,
    start_sequence,
)
from engine.cycle.speculative import CycleResult, finish_unread
from engine.model import loader
from engine.model.memory import limit_host_arenas
from engine.model.mtp import MTPHead, project_to_vocab
from engine.request_progress import (
    Progress,
    apply_stops,
    cancelled_in_prefill,
    commit_for_request,
    token_logprobs,
)
from engine.scheduling.autok import EngineAutoK
from engine.scheduling.batching import BatchDecoder, BatchK, CycleNeed
from engine.scheduling.policy import DraftPolicy
from sampling.constraint import GrammarDeadEnd, GrammarError, TokenConstraint, build_tokenizer
from sampling.params import (
    SamplingOverrides,
    SamplingParamError,
    SamplingParams,
    generation_config_defaults,
    resolve,
)

log = logging.getLogger("mtpserve.engine")
#: guards building the llguidance tokenizer once (grammars compile off the worker thread)
_GRAMMAR_TOKENIZER_LOCK = threading.Lock()

#: Optional file in a model folder: token ids by corpus frequency, for the draft vocabulary.
DRAFT_VOCAB_FILE = "draft_vocab.json"
#: a checkpoint whose vocabulary is larger than this and that lists no draft vocabulary gets one
#: log line at start suggesting ``--draft-vocab SUGGESTED_DRAFT_VOCAB`` (docs/BENCHMARKS.md,
#: "Full-size shapes: the cost table": a head step 31% of a 0.8B plain step over the whole
#: 248,320-token vocabulary, 9% over 32,768)
LARGE_VOCABULARY = 65_536
SUGGESTED_DRAFT_VOCAB = 32_768


@dataclass
class Engine:
    loaded: loader.LoadedModel
    tokenizer: Any
    model_id: str
    default_draft_tokens: int | None = None
    eos_token_ids: frozenset[int] = frozenset()
    sampling_defaults: SamplingOverrides = field(default_factory=SamplingOverrides)
    autok: Any = None
    #: sync after each cycle stage so the stats split time per stage (benchmarks only)
    profile: bool = False
    #: draft-confidence cut (see engine.cycle.speculative); off unless the bench shows it pays
    draft_confidence: float | None = None
    #: tokens the head drafts over (see set_draft_vocab) and the bytes that subset costs
    draft_vocab_size: int = 0
    draft_vocab_bytes: int = 0
    #: the conversation cache (``PrefixCache``); None: every prompt is prefilled
    prefix_cache: Any = None
    #: prefill chunk (= the cache's block): chunks end at its multiples, cached or not
    prefill_chunk: int = PREFILL_CHUNK
    #: batched cycles' measured costs, for automatic K at each batch size
    batch_k: BatchK = field(default_factory=BatchK)

    @classmethod
    def load(
        cls,
        model: str,
        *,
        draft_tokens: int | None = None,
        mtp_weights: str | None = None,
        dtype: str = "auto",
        model_id: str | None = None,
        draft_vocab: int | None = None,
        memory_limit: int | None = None,
    ) -> Engine:
        from transformers import AutoTokenizer

        limit_host_arenas()  # before the threads that decode allocate (engine.model.memory)
        loaded = cls.load_model(
            model, mtp_weights=mtp_weights, dtype=dtype, memory_limit=memory_limit
        )
        tokenizer = AutoTokenizer.from_pretrained(str(loaded.model_dir))
        engine = cls(
            loaded=loaded,
            tokenizer=tokenizer,
            model_id=model_id or _model_name(model, loaded.model_dir),
            default_draft_tokens=draft_tokens,
            eos_token_ids=_eos_ids(loaded.model_dir, loaded.config, tokenizer),
            sampling_defaults=generation_config_defaults(loaded.model_dir),
        )
        if loaded.head is not None:
            engine.set_draft_vocab(draft_vocab)
        if draft_tokens is None and loaded.head is not None:
            engine.autok = EngineAutoK(engine)
            # Measure greedy costs now (start-up, not the first request); sampled on first use.
            engine.autok.for_request(resolve(SamplingOverrides(temperature=0.0)))
            # Decide the K of seeded sampled requests now too (its acceptance probe took ~4 s
            # of the first seeded request at the 0.8B shape), where the checkpoint's own
            # sampler is what they measure it with; a cached decision costs nothing.
            defaults = resolve(engine.sampling_defaults)
            if not defaults.greedy:
                engine.autok.seeded_plan(defaults)
        return engine

    @classmethod
    def load_model(
        cls, model: str, *, mtp_weights: str | None, dtype: str, memory_limit: int | None = None
    ) -> loader.LoadedModel:
        """The weights (a subclass loads a shard: engine.distributed.DistributedEngine)."""
        return loader.load(model, mtp_weights=mtp_weights, dtype=dtype, memory_limit=memory_limit)

    def set_draft_vocab(self, size: int | None) -> None:
        """Restrict drafting to ``size`` tokens (0: the full vocabulary; None: the checkpoint's
        ``draft_vocab.json`` default if it has one, else the full vocabulary).

        The subset is the most frequent tokens listed in ``draft_vocab.json`` (written by
        ``scripts/experiments/draft_vocab.py`` from a corpus) or, without that file, the first
        ``size`` ids (BPE merge order approximates frequency); every added/special token is always
        in it.
        """
        path = self.loaded.model_dir / DRAFT_VOCAB_FILE
        listed = json.loads(path.read_text()) if path.exists() else None
        chosen = size is not None  # the caller asked for a size (then no start-up hint)
        if size is None:
            size = listed["default_size"] if listed else 0
        head = self.loaded.head
        if not size or size >= self.vocab_size:
            head.set_draft_vocab(self.trunk, None)
            self.draft_vocab_size = self.vocab_size
            if not chosen and listed is None and self.vocab_size > LARGE_VOCABULARY:
                log.info(
                    "the MTP head drafts over the whole %d-token vocabulary: each draft step "
                    "reads the whole vocabulary projection (at the 0.8B-2B shapes ~30%% of a plain "
                    "step); --draft-vocab %d drafts over the first %d ids (BPE merge order, "
                    "which approximates frequency), ~9%%, exact either way, at some cost in "
                    "acceptance",
                    self.vocab_size,
                    SUGGESTED_DRAFT_VOCAB,
                    SUGGESTED_DRAFT_VOCAB,
                )
            return
        ranked = listed["ids_by_frequency"] if listed else list(range(self.vocab_size))
        ids = set(ranked[:size]) | set(self.eos_token_ids)
        added = getattr(self.tokenizer, "added_tokens_decoder", {})
        ids |= {i for i in added if i < self.vocab_size}
        self.draft_vocab_bytes = head.set_draft_vocab(self.trunk, sorted(ids))
        self.draft_vocab_size = len(ids)

    def enable_prefix_cache(
        self,
        budget_bytes: int,
        directory: str | Path | None = None,
        disk_budget_bytes: int | None = None,
        block_tokens: int = PREFILL_CHUNK,
    ) -> None:
        """Reuse cached prompt prefixes (``PrefixCache``); ``budget_bytes`` 0 turns it off."""
        self.prefill_chunk = block_tokens
        if budget_bytes <= 0:
            self.prefix_cache = None
            return
        dtype = str(self.trunk.model.embed_tokens.weight.dtype)
        extra = f"{dtype}|{self.loaded.head_source}|{self.draft_vocab_size}"
        self.prefix_cache = PrefixCache(
            self.trunk,
            budget_bytes=budget_bytes,
            block_tokens=block_tokens,
            directory=directory,
            disk_budget_bytes=disk_budget_bytes or DEFAULT_DISK_BUDGET_BYTES,
            fingerprint=self._cache_fingerprint(extra, directory),
        )

    def _cache_fingerprint(self, extra: str, directory: str | Path | None) -> str:
        """The conversation cache's model fingerprint: over the weights' content when a disk
        tier keeps snapshots across restarts (memory-only snapshots die with these weights)."""
        if directory is None:
            return extra
        head = self.loaded.head_source
        files = [Path(head)] if head and Path(head).is_file() else []
        Path(directory).mkdir(parents=True, exist_ok=True)
        return model_fingerprint(self.loaded.model_dir, extra, Path(directory), files)

    # -- facts the server and CLI need -------------------------------------------------------
    @property
    def trunk(self) -> Any:
        return self.loaded.trunk

    @property
    def model_dir(self) -> Path:
        """The local folder the weights came from (a hub id resolves to its cache folder)."""
        return self.loaded.model_dir

    @property
    def head(self) -> MTPHead | None:
        """The MTP head attached to the trunk (None: the checkpoint has none)."""
        return self.loaded.head

    @property
    def has_head(self) -> bool:
        return self.loaded.head is not None

    @property
    def vocab_size(self) -> int:
        return self.trunk.args.vocab_size

    @property
    def context_length(self) -> int:
        return int(self.loaded.text_config.get("max_position_embeddings", 32768))

    def policy(
        self, draft_tokens: int | Literal["auto"] | None, params: SamplingParams | None = None
    ) -> DraftPolicy:
        """How a request's cycles choose K: ``draft_tokens`` as ``GenerationRequest`` has it."""
        if not self.has_head:
            return DraftPolicy(fixed=0)
        if draft_tokens is None:
            draft_tokens = self.default_draft_tokens
        if draft_tokens is None or draft_tokens == "auto":
            if self.autok is None:
                self.autok = EngineAutoK(self)
            params = params or SamplingParams(temperature=0.0)
            if params.seed is not None and not params.greedy:
                # Rejection sampling's text depends on which positions were drafted: a seed
                # repeats only under a K that is a function of the request, never of timings
                # or neighbours (``EngineAutoK.seeded_plan``): not the batch's K either.
                chooser = self.autok.for_seeded_request(params)
                return DraftPolicy(fixed=None, chooser=chooser, batched=False)
            return DraftPolicy(fixed=None, chooser=self.autok.for_request(params))
        if not 0 <= draft_tokens <= MAX_DRAFT_TOKENS:
            raise RequestError(f"draft_tokens must be in 0..{MAX_DRAFT_TOKENS}", "draft_tokens")
        return DraftPolicy(fixed=draft_tokens)

    def check(self, request: GenerationRequest) -> None:
        """Raise ``RequestError`` for anything the loop cannot serve."""
        if not request.prompt_ids:
            raise RequestError("the prompt is empty", "prompt")
        bad = [t for t in request.prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary", "prompt")
        if request.max_tokens < 0:
            raise RequestError("max_tokens must be at least 0", "max_tokens")
        total = len(request.prompt_ids) + request.max_tokens
        if total > self.context_length:
            raise ContextLengthExceeded(
                f"this model's maximum context length is {self.context_length} tokens; the "
                f"request asks for {len(request.prompt_ids)} prompt + {request.max_tokens} "
                f"completion tokens"
            )
        k = request.draft_tokens
        if isinstance(k, int) and not 0 <= k <= MAX_DRAFT_TOKENS:
            raise RequestError(f"draft_tokens must be in 0..{MAX_DRAFT_TOKENS}", "draft_tokens")
        if request.top_logprobs is not None and not 0 <= request.top_logprobs <= 20:
            raise RequestError("top_logprobs must be in 0..20", "top_logprobs")
        if request.prompt_logprobs is not None and not 0 <= request.prompt_logprobs <= 20:
            raise RequestError("prompt_logprobs must be in 0..20", "prompt_logprobs")
        if request.reasoning_budget is not None:
            if request.reasoning_budget < 0:
                raise RequestError("the reasoning budget must be at least 0", "reasoning_budget")
            end = request.reasoning_end
            if end is None or not 0 <= end < self.vocab_size:
                raise RequestError(
                    "a reasoning budget needs the id of the token that ends the reasoning",
                    "reasoning_end",
                )
        try:  # its ranges hold by construction; its token ids need this model's vocabulary
            request.sampling.check_vocabulary(self.vocab_size)
        except SamplingParamError as exc:
            raise RequestError(str(exc), exc.param) from exc
        # (a grammar is compiled once, when the sequence starts: ``constraint`` raises the
        # RequestError there, before the first event)

    def constraint(self, grammar: str) -> TokenConstraint:
        """A fresh ``TokenConstraint`` for ``grammar``; ``RequestError`` if it does not compile
        or allows no first token (a schema that describes no finite JSON, ``{"$ref": "#"}``).
        Touches no mlx: callers run it on their own thread (the server compiles a request's
        grammar before queueing it, and hands it over as ``GenerationRequest.constraint``).
        The llguidance tokenizer is built on first use (~0.1-1 s)."""
        with _GRAMMAR_TOKENIZER_LOCK:
            if "_grammar_tokenizer" not in self.__dict__:
                self.__dict__["_grammar_tokenizer"] = build_tokenizer(
                    self.tokenizer, self.vocab_size, self.eos_token_ids
                )
        try:
            constraint = TokenConstraint(
                self.__dict__["_grammar_tokenizer"], grammar, self.vocab_size
            )
            constraint.allowed()
        except GrammarDeadEnd as exc:
            raise RequestError(
                "the output grammar allows no token at all: the schema describes no JSON that "
                "can be completed",
                "grammar",
                code="unsatisfiable_grammar",
            ) from exc
        except GrammarError as exc:
            raise RequestError(f"the output grammar does not compile: {exc}", "grammar") from exc
        return constraint

    def _sequence_constraint(self, request: GenerationRequest) -> TokenConstraint | None:
        """The request's grammar as it starts: compiled by the caller, or here."""
        if request.constraint is not None:
            return request.constraint
        if request.grammar is not None:
            return self.constraint(request.grammar)
        return None

    # -- the loop --------------------------------------------------------------------------------
    def generate(
        self,
        request: GenerationRequest,
        cancelled: Callable[[], bool] = lambda: False,
        trace: Callable[[dict[str, Any]], None] | None = None,
    ) -> Iterator[GenerationEvent]:
        """Generate for one request: a batch of one row (``row_steps`` in a ``BatchDecoder``),
        the loop every request runs. Synchronous; call from the thread that owns mlx."""
        return self._alone(request, cancelled, trace, None)

    def decode(
        self,
        seq: Sequence,
        request: GenerationRequest,
        trace: Callable[[dict[str, Any]], None] | None = None,
    ) -> Iterator[GenerationEvent]:
        """Continue ``seq`` (a ``new_sequence``) for up to ``request.max_tokens`` tokens by the
        same loop, alone: how the cost probe times cycles as requests run them."""
        return self._alone(request, lambda: False, trace, seq)

    def _alone(
        self,
        request: GenerationRequest,
        cancelled: Callable[[], bool],
        trace: Callable[[dict[str, Any]], None] | None,
        seq: Sequence | None,
    ) -> Iterator[GenerationEvent]:
        batch = self.batch(1)
        batch.add(0, request, cancelled, trace, seq)
        try:
            while len(batch):
                for _key, item in batch.step():
                    if isinstance(item, BaseException):
                        raise item
                    yield item
        finally:  # stopped early: the row's look-ahead is undone and its sequence kept
            batch.drop(0)

    def new_sequence(self, prompt_ids: list[int], params: SamplingParams, draft: bool) -> Sequence:
        """A sequence prefilled with all of ``prompt_ids`` but the last, outside the conversation
        cache, with the head's cache when ``draft``: what the cost probe and experiments time."""
        seq = start_sequence(self.trunk, self.head, prompt_ids, params, draft)
        seq.draft_confidence = self.draft_confidence
        return seq

    def start_steps(
        self,
        request: GenerationRequest,
        policy: DraftPolicy,
        cancelled: Callable[[], bool] = lambda: False,
        scored: list[TokenLogprob] | None = None,
    ) -> Generator[None, None, Sequence | None]:
        """Restore the longest cached prefix of the prompt, prefill the rest one chunk per step
        (``prefill_steps``; a snapshot at each block end and at the prompt's end); None if
        cancelled meanwhile. With ``scored`` (a request that scores its prompt,
        ``prompt_logprobs``) it restores nothing and appends each prompt token's score after the
        first to that list."""
        use_head = policy.fixed != 0 and self.has_head
        head = self.loaded.head
        seq = new_sequence(self.trunk, head, request.prompt_ids, request.sampling, use_head)
        seq.draft_confidence = self.draft_confidence
        seq.constraint = self._sequence_constraint(request)
        cache = self.prefix_cache
        score = None
        if scored is not None:
            score = self._prompt_scorer(request, scored)
        elif cache is not None:
            restored = cache.guarded("a lookup", cache.lookup, request.prompt_ids, use_head)
            if restored is not None:
                seq.trunk_cache.layers = restored.layers
                if use_head:
                    seq.head_cache = restored.head_cache
                    seq.head_pending = [restored.head_pending]
                seq.restored = restored.position
        # Also a snapshot where the request says the prompt's last message begins: a template
        # that re-renders the previous reply (Qwen's drops its <think> block) still matches the
        # next prompt up to there.
        body = request.prompt_ids[: len(request.prompt_ids) - 1]
        stops = [len(body)]
        at = request.snapshot_at
        if cache is not None and at is not None and seq.restored < at < len(body):
            stops.insert(0, at)
        hook = prefill_hook(cache, self.trunk, head, cancelled)
        for stop in stops:
            fed = yield from prefill_steps(
                self.trunk,
                head,
                seq,
                body[seq.trunk_cache.length : stop],
                chunk_tokens=self.prefill_chunk,
                after_chunk=hook,
                score=score,
            )
            if not fed:
                return None
            if cache is not None:
                cache.guarded("a snapshot", cache.store, seq, self.trunk, head)
        return seq

    def _prompt_scorer(
        self, request: GenerationRequest, scored: list[TokenLogprob]
    ) -> Callable[[int, mx.array], None]:
        """``prefill_steps``' ``score``: each chunk's logits, and from them the next prompt
        tokens' logprobs (evaluated chunk by chunk: a long prompt's logits are never whole)."""
        ids, top = request.prompt_ids, request.prompt_logprobs

        def score(position: int, hidden: mx.array) -> None:
            logits = project_to_vocab(self.trunk, hidden)[0]
            scored.extend(
                token_logprobs(logits, ids[position + 1 : position + 1 + len(logits)], top)
            )

        return score

    def _keep(self, seq: Sequence) -> None:
        """Snapshot a finished generation (after its final commit) for the next turn."""
        cache = self.prefix_cache
        if cache is not None:
            cache.guarded("a snapshot", cache.store, seq, self.trunk, self.loaded.head)
            cache.guarded("writing to disk", cache.flush)

    # -- one row of a batch (engine.scheduling.batching) ---------------------------------------
    def batch(self, capacity: int) -> BatchDecoder:
        """A ``BatchDecoder`` of up to ``capacity`` rows on this engine."""
        return BatchDecoder(self, capacity)

    def row_steps(
        self,
        request: GenerationRequest,
        cancelled: Callable[[], bool] = lambda: False,
        trace: Callable[[dict[str, Any]], None] | None = None,
        seq: Sequence | None = None,
    ) -> Generator[Any, CycleResult | None, None]:
        """``generate`` as one row of a batch: the same events, but the row yields to the batch
        (``BatchDecoder``) instead of running its own cycles — ``None`` after each prefill
        chunk but the last, a ``CycleNeed`` when it wants a cycle, whose result
        the batch sends back — so that many rows share each cycle and a newcomer's prefill
        runs between the running rows' cycles. A row commits each cycle's result itself,
        except a plain cycle the batch committed unread to launch the next one ahead
        (``CycleResult.committed``, ``BatchDecoder``'s look-ahead): the row then only reads
        its token. ``seq``: continue this sequence instead of starting one from the prompt
        (``decode``; it is not kept for the conversation cache)."""
        self.check(request)
        policy = self.policy(request.draft_tokens, request.sampling)
        t0 = time.perf_counter()
        kept: Sequence | None = None  # what the conversation cache may snapshot at the end
        scored: list[TokenLogprob] | None = None
        if seq is None:
            scored = [] if request.prompt_logprobs is not None else None
            seq = yield from self.start_steps(request, policy, cancelled, scored)
            if seq is None:
                yield cancelled_in_prefill(request, t0)
                return
            kept = seq
        progress = Progress.start(request, policy, seq, trace, time.perf_counter() - t0, scored)
        if progress.remaining == 0:  # the prompt alone: prefilled (and scored), nothing drawn
            yield progress.finished_empty()
            return
        chooser = policy.chooser
        timed = chooser if not self.profile else None
        last_end: float | None = None
        try:
            while True:
                if cancelled():
                    yield progress.cancelled()
                    return
                remaining = progress.remaining
                context_len = len(seq.tokens)

                # a cycle reaches the token a reasoning budget ends at, never past it: that
                # token is then chosen on the host (no plain cycle is committed unread there)
                reach = progress.reach(remaining)

                def own_k(remaining: int = reach) -> int:
                    return policy.choose(seq, remaining) if seq.can_draft else 0

                need = CycleNeed(seq, own_k, reach - 1, policy.batched_auto, chooser)
                try:
                    result = yield need
                except GeneratorExit:  # dropped while waiting: the sequence is consistent
                    raise
                except BaseException:  # its cycle failed mid-way: nothing of it is kept
                    kept = None
                    raise
                result = progress.bound_reasoning(result)
                n_keep, finish = apply_stops(result.emitted, progress.stop_ids, remaining)
                t_commit = time.perf_counter()
                if result.committed:  # the batch committed it and told auto K (look-ahead)
                    emitted = finish_unread(seq, result)
                else:
                    emitted = commit_for_request(seq, result, n_keep)
                    if chooser is not None:
                        chooser.observe(len(result.draft_ids), result.n_accepted)
                end = time.perf_counter()
                if timed is not None:
                    # Auto K's single-sequence table calibrates on cycles a row ran alone;
                    # batched cycles are priced by the batch (BatchK). The last plain cycle
                    # before drafting, committed unread with nothing launched behind it, reads
                    # back ~0.4 of a step after the one before: not timed, or every plain
                    # stretch would pull the calibration of plain cycles down.
                    alone = result.rows == 1 and last_end is not None
                    alone = alone and (result.followed or not result.committed)
                    since = end - last_end if alone else None
                    timed.observe_seconds(len(result.draft_ids), len(emitted), since)
                    last_end = end if result.rows == 1 else None
                yield progress.event(result, emitted, finish, context_len, end - t_commit)
                if finish is not None:
                    return
        finally:
            if kept is not None:
                self._keep(kept)


def chat_prompt_ids(
    tokenizer: Any, messages: list[dict[str, Any]], **template_kwargs: Any
) -> list[int]:
    """Render the checkpoint's chat template (generation prompt included) and encode it.

    Renders to text first: transformers 5 returns a BatchEncoding from ``tokenize=True``, and
    text is what the server encodes too, so the CLI, the bench and the server agree.
    """
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **template_kwargs
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def _model_name(model: str, model_dir: Path) -> str:
    return model if not Path(model).expanduser().exists() else model_dir.name


def _eos_ids(model_dir: Path, config: dict[str, Any], tokenizer: Any) -> frozenset[int]:
    """Every EOS id: generation_config's list (both Qwen ids), config's, the tokenizer's."""
    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))

    gen = model_dir / "generation_config.json"
    if gen.exists():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    add(config.get("eos_token_id"))
    add(config.get("text_config", {}).get("eos_token_id"))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        add(tokenizer.eos_token_id)
    return frozenset(ids)
