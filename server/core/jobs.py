"""Generation jobs on the engine: queueing, the one read loop, usage, cancellation, errors.

A ``Job`` is one accepted request: its ``GenerationRequest``s (one per choice) were submitted
together to the scheduler and run one after another, so choices are read in order. Every API
reads a job through the same two loops here — ``collect`` (non-streaming) and ``stream`` (SSE,
through an adapter's ``StreamEncoder``) — so stop strings, parsing, usage, engine failures and
client disconnects are handled once. A disconnect cancels the job's generations: streaming via
the response's cleanup (server/core/sse.py), non-streaming via ``run_until_disconnect``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from fastapi import Request

from engine.api import EngineUnavailable, GenerationRequest
from sampling.params import SamplingParamError
from server.core.chat_format import Prompt
from server.core.output import ChoiceOutput, OutputDelta
from server.core.requests import GenerationParams
from server.core.scheduler import (
    GenerationFailedError,
    QueueFullError,
    RequestHandle,
    SchedulerClosedError,
)
from server.core.toolcalls import ChatOutputParser
from server.errors import APIError, bad_request
from server.state import ServerState

T = TypeVar("T")


def new_id(prefix: str, sep: str = "-") -> str:
    return f"{prefix}{sep}{uuid.uuid4().hex}"


def submit(state: ServerState, requests: list[GenerationRequest]) -> list[RequestHandle]:
    try:
        return state.scheduler.submit(requests)
    except QueueFullError as exc:
        raise APIError(
            429,
            "The server is busy: the request queue is full. Retry shortly.",
            code="queue_full",
            headers={"Retry-After": str(int(max(1, exc.retry_after)))},
        ) from exc
    except SchedulerClosedError as exc:
        raise APIError(503, str(exc), code="unavailable", headers={"Retry-After": "5"}) from exc


def engine_error(exc: BaseException) -> APIError:
    """What a failure inside the engine means for the client."""
    if isinstance(exc, GenerationFailedError):
        exc = exc.error
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineUnavailable):
        return APIError(503, str(exc), code="engine_unavailable")
    if isinstance(exc, SamplingParamError):
        return bad_request(str(exc), param=exc.param, code="invalid_value")
    if isinstance(exc, ValueError) and hasattr(exc, "param"):  # engine.api.RequestError
        return bad_request(
            str(exc) or "invalid request",
            param=getattr(exc, "param", None),
            code=getattr(exc, "code", None) or "invalid_value",
        )
    if isinstance(exc, ValueError):
        return bad_request(str(exc) or "invalid request", code="invalid_value")
    return APIError(500, f"generation failed: {type(exc).__name__}: {exc}", code="engine_error")


def _trim_zeros(counts: list[int]) -> list[int]:
    while counts and counts[-1] == 0:
        counts = counts[:-1]
    return counts


@dataclass
class Usage:
    """Token counts of what was emitted, plus the engine's speculative figures."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    draft_tokens: int = 0
    proposed: int = 0
    accepted: int = 0
    cycles: int = 0
    cycles_by_draft_tokens: list[int] = field(default_factory=list)
    generation_seconds: float = 0.0

    def add_choice(self, choice: ChoiceOutput, *, first_of_prompt: bool) -> None:
        self.completion_tokens += choice.completion_tokens
        self.reasoning_tokens += choice.reasoning_tokens
        stats = choice.stats
        if stats is None:
            return
        if first_of_prompt:
            self.cached_tokens += stats.cached_tokens
        self.draft_tokens = max(self.draft_tokens, stats.draft_tokens)
        self.proposed += stats.proposed
        self.accepted += stats.accepted
        self.cycles += stats.cycles
        self.generation_seconds += stats.generation_seconds
        mine = self.cycles_by_draft_tokens or [0] * len(stats.k_histogram)
        self.cycles_by_draft_tokens = [a + b for a, b in zip(mine, stats.k_histogram, strict=False)]

    def speculative(self) -> dict[str, Any]:
        """mtpserve's extension: what the MTP head drafted and the trunk accepted."""
        return {
            "draft_tokens": self.draft_tokens,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": (self.accepted / self.proposed) if self.proposed else 0.0,
            "cycles": self.cycles,
            # K actually used per cycle (index = K; auto K chooses per cycle)
            "cycles_by_draft_tokens": _trim_zeros(self.cycles_by_draft_tokens),
            "tokens_per_cycle": self.completion_tokens / self.cycles if self.cycles else 0.0,
            "generation_tokens_per_second": (
                self.completion_tokens / self.generation_seconds if self.generation_seconds else 0.0
            ),
        }


@dataclass
class Job:
    """One accepted request on its way through the engine."""

    state: ServerState
    handles: list[RequestHandle]
    choices: list[ChoiceOutput]
    prompts: list[Prompt]
    n: int
    model: str
    id: str
    created: int = field(default_factory=lambda: int(time.time()))
    arrived: float = field(default_factory=time.monotonic)
    first_token_seen: bool = False

    def cancel_all(self) -> None:
        for handle in self.handles:
            handle.cancel()

    def usage(self) -> Usage:
        """Usage of the choices read so far (all of them once the job is done)."""
        usage = Usage(prompt_tokens=sum(len(p.ids) for p in self.prompts))
        for index, choice in enumerate(self.choices):
            usage.add_choice(choice, first_of_prompt=index % self.n == 0)
        return usage

    async def deltas(self, index: int) -> AsyncIterator[OutputDelta]:
        """Deltas of choice ``index`` until it finishes; raises APIError on engine failure."""
        handle, choice = self.handles[index], self.choices[index]
        try:
            async for event in handle:
                delta = choice.step(event)
                if delta.token_ids and not self.first_token_seen:
                    self.first_token_seen = True
                    self.state.metrics.first_token_seconds.observe(time.monotonic() - self.arrived)
                if delta.finish_reason == "cancelled":
                    raise APIError(
                        503, "generation was cancelled (server shutting down)", code="cancelled"
                    )
                yield delta
                if delta.finish_reason is not None:
                    return
        except GenerationFailedError as exc:
            raise engine_error(exc) from exc
        if choice.finish_reason is None:
            raise APIError(503, "generation ended without a result", code="cancelled")


def _admit(engine: Any, requests: list[GenerationRequest]) -> None:
    """The engine's own checks of every request, and each grammar compiled (one compilation
    per distinct grammar, a copy per choice) — before anything is queued, so that a request
    the engine would refuse is a 400 (also before a stream starts) and compiling a grammar
    never stalls the rows decoding on the engine's thread. Runs off the event loop."""
    check = getattr(engine, "check", None)
    compile_grammar = getattr(engine, "constraint", None)
    compiled: dict[str, Any] = {}
    for request in requests:
        if check is not None:
            check(request)
        grammar = request.grammar
        if grammar is None or compile_grammar is None or request.constraint is not None:
            continue
        if grammar in compiled:
            request.constraint = compiled[grammar].copy()
        else:
            request.constraint = compiled[grammar] = compile_grammar(grammar)


async def admit(state: ServerState, requests: list[GenerationRequest]) -> None:
    """``_admit`` on a worker thread of the event loop; the engine's refusal is a 400."""
    try:
        await asyncio.to_thread(_admit, state.engine, requests)
    except (ValueError, SamplingParamError) as exc:
        state.metrics.generations.labels("rejected").inc()  # as the worker counts a refusal
        raise engine_error(exc) from exc


async def start_job(
    state: ServerState,
    prompts: list[Prompt],
    params: GenerationParams,
    requests: list[GenerationRequest],
    *,
    model: str,
    id: str,
    parse: bool,
    include_reasoning: bool = True,
) -> Job:
    """Check and queue the requests; ``parse``: split reasoning / content / tool calls (chat
    APIs)."""
    await admit(state, requests)
    handles = submit(state, requests)
    engine = state.engine
    choices = []
    for index, handle in enumerate(handles):
        prompt = prompts[index // params.n]
        parser = None
        if parse:
            parser = ChatOutputParser(
                start_in_reasoning=include_reasoning and prompt.opens_reasoning,
                parse_reasoning=include_reasoning,
                tools=prompt.tools,
            )
        choices.append(
            ChoiceOutput(
                engine.tokenizer,
                eos_ids=frozenset(engine.eos_token_ids),
                stop=params.stop,
                ignore_eos=params.ignore_eos,
                cancel=handle.cancel,
                parser=parser,
            )
        )
    return Job(state, handles, choices, prompts, params.n, model, id)


async def collect(job: Job) -> list[list[OutputDelta]]:
    """Read every choice to its end (non-streaming); the deltas of each choice, in order."""
    return [[delta async for delta in job.deltas(i)] for i in range(len(job.handles))]


class StreamEncoder(Protocol):
    """An API's mapping of a job's progress onto its stream events (server-sent events as
    dicts for sse-starlette: ``{"event": name, "data": json text}`` or ``{"data": ...}``)."""

    def start(self) -> Iterable[dict[str, Any]]: ...
    def choice_start(self, index: int) -> Iterable[dict[str, Any]]: ...
    def delta(self, index: int, delta: OutputDelta) -> Iterable[dict[str, Any]]: ...
    def choice_end(self, index: int) -> Iterable[dict[str, Any]]: ...
    def end(self) -> Iterable[dict[str, Any]]: ...
    def error(self, error: APIError) -> Iterable[dict[str, Any]]: ...


async def stream(job: Job, encoder: StreamEncoder) -> AsyncIterator[dict[str, Any]]:
    """The one streaming loop: every choice's deltas through the API's encoder; an engine
    failure after the stream started becomes the API's error event, never a cut stream."""
    try:
        for event in encoder.start():
            yield event
        for index in range(len(job.handles)):
            for event in encoder.choice_start(index):
                yield event
            async for delta in job.deltas(index):
                for event in encoder.delta(index, delta):
                    yield event
            for event in encoder.choice_end(index):
                yield event
        for event in encoder.end():
            yield event
    except APIError as exc:
        job.cancel_all()
        for event in encoder.error(exc):
            yield event


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: Request, work: Awaitable[T], job: Job) -> T | None:
    """Await ``work``; if the client goes away first, cancel the generations and return None."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        return None
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        job.cancel_all()
