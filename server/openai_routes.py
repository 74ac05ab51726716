"""The /v1 endpoints: chat completions, text completions, models.

Each POST handler: read the body (size-limited) -> validate the schema -> check the model name ->
build ``GenerationRequest``s (every model-dependent check, so bad requests are 400s before the
queue) -> submit to the scheduler -> either stream chunks or collect a response. While waiting,
a client disconnect cancels the request's generations (streaming: via the response's cleanup;
non-streaming: a task watching ``http.disconnect``).

Choices of one request are queued together and run one after another, so they are read in
order; ``usage`` sums the tokens actually emitted, and ``usage.speculative`` the engine's draft
figures.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from engine.api import GenerationStats, TokenLogprob
from engine.scheduler import (
    GenerationFailedError,
    QueueFullError,
    RequestHandle,
    SchedulerClosedError,
)
from sampling.params import SamplingParamError
from server.auth import require_api_key
from server.errors import APIError, bad_request, from_validation_error
from server.generation import (
    ChoiceStream,
    Step,
    check_common,
    decide_max_tokens,
    encode_prompts,
    make_requests,
    render_chat,
    resolve_sampling,
    select_tools,
)
from server.schemas import ChatCompletionRequest, CompletionRequest
from server.sse import DONE, CancellingStreamingResponse, sse_data
from server.state import ServerState
from server.toolcalls import ChatOutputParser, ParsedDelta, prompt_opens_reasoning

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])

T = TypeVar("T")


# ------------------------------------------------------------------------------------------
# plumbing
# ------------------------------------------------------------------------------------------
async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON; 413 beyond ``limit`` bytes (checked while reading), 400 if not JSON."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            too_big = int(declared) > limit
        except ValueError:
            raise bad_request("invalid Content-Length header") from None
        if too_big:
            raise APIError(413, f"request body larger than {limit} bytes", code="body_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body larger than {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise bad_request("request body is empty; expected a JSON object", code="invalid_json")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"invalid JSON body: {exc}", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    return data


def _validate(model_cls: type[T], data: Any) -> T:
    try:
        return model_cls.model_validate(data)  # type: ignore[attr-defined]
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


def submit(state: ServerState, requests: list) -> list[RequestHandle]:
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


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_watching_disconnect(
    request: Request, work: Awaitable[T], handles: list[RequestHandle]
) -> T | None:
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
        for handle in handles:
            handle.cancel()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _trim_zeros(counts: list[int]) -> list[int]:
    while counts and counts[-1] == 0:
        counts = counts[:-1]
    return counts


@dataclass
class Usage:
    """Token counts of what was emitted, plus the engine's speculative figures."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    draft_tokens: int = 0
    proposed: int = 0
    accepted: int = 0
    cycles: int = 0
    cycles_by_draft_tokens: list[int] = field(default_factory=list)
    generation_seconds: float = 0.0
    #: prompt tokens restored from the conversation cache, per distinct prompt (the n choices
    #: of one prompt share it: the least any of them reused)
    cached_by_prompt: dict[int, int] = field(default_factory=dict)

    def add_choice(self, stream: ChoiceStream) -> None:
        self.completion_tokens += stream.completion_tokens
        stats: GenerationStats | None = stream.stats
        if stats is not None:
            key = stream.prompt_key
            self.cached_by_prompt[key] = min(
                self.cached_by_prompt.get(key, stats.cached_tokens), stats.cached_tokens
            )
            self.draft_tokens = max(self.draft_tokens, stats.draft_tokens)
            self.proposed += stats.proposed
            self.accepted += stats.accepted
            self.cycles += stats.cycles
            self.generation_seconds += stats.generation_seconds
            mine = self.cycles_by_draft_tokens or [0] * len(stats.k_histogram)
            self.cycles_by_draft_tokens = [
                a + b for a, b in zip(mine, stats.k_histogram, strict=False)
            ]

    def body(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_by_prompt.values())},
            "speculative": {
                "draft_tokens": self.draft_tokens,
                "proposed": self.proposed,
                "accepted": self.accepted,
                "acceptance_rate": (self.accepted / self.proposed) if self.proposed else 0.0,
                "cycles": self.cycles,
                # K actually used per cycle (index = K; auto K chooses per cycle)
                "cycles_by_draft_tokens": _trim_zeros(self.cycles_by_draft_tokens),
                "tokens_per_cycle": self.completion_tokens / self.cycles if self.cycles else 0.0,
                "generation_tokens_per_second": (
                    self.completion_tokens / self.generation_seconds
                    if self.generation_seconds
                    else 0.0
                ),
            },
        }


@dataclass
class Job:
    """One accepted request on its way through the engine."""

    state: ServerState
    request: Request
    handles: list[RequestHandle]
    streams: list[ChoiceStream]
    usage: Usage
    model: str
    id: str
    created: int = field(default_factory=lambda: int(time.time()))
    arrived: float = field(default_factory=time.monotonic)
    first_token_seen: bool = False

    def cancel_all(self) -> None:
        for handle in self.handles:
            handle.cancel()

    async def steps(self, index: int) -> AsyncIterator[Step]:
        """Steps of choice ``index`` until it finishes; raises APIError on engine failure."""
        handle, stream = self.handles[index], self.streams[index]
        try:
            async for event in handle:
                step = stream.step(event)
                if step.token_ids and not self.first_token_seen:
                    self.first_token_seen = True
                    self.state.metrics.first_token_seconds.observe(time.monotonic() - self.arrived)
                if step.finish_reason == "cancelled":
                    raise APIError(
                        503, "generation was cancelled (server shutting down)", code="cancelled"
                    )
                yield step
                if step.finish_reason is not None:
                    return
        except GenerationFailedError as exc:
            raise engine_error(exc) from exc
        if stream.finish_reason is None:
            raise APIError(503, "generation ended without a result", code="cancelled")


def _start_job(
    state: ServerState,
    request: Request,
    gen_requests: list,
    *,
    stops: list[str],
    ignore_eos: bool,
    prompt_tokens: int,
    model: str,
    prefix: str,
) -> Job:
    handles = submit(state, gen_requests)
    engine = state.engine
    streams = [
        ChoiceStream(
            engine.tokenizer,
            eos_ids=frozenset(engine.eos_token_ids),
            stop=stops,
            ignore_eos=ignore_eos,
            cancel=h.cancel,
            prompt_key=hash(tuple(h.request.prompt_ids)),
        )
        for h in handles
    ]
    return Job(
        state=state,
        request=request,
        handles=handles,
        streams=streams,
        usage=Usage(prompt_tokens=prompt_tokens),
        model=model,
        id=new_id(prefix),
    )


# ------------------------------------------------------------------------------------------
# logprobs shapes
# ------------------------------------------------------------------------------------------
def chat_logprobs(state: ServerState, items: list[TokenLogprob]) -> list[dict[str, Any]]:
    tt = state.token_text
    return [
        {
            "token": tt.text(lp.token_id),
            "logprob": lp.logprob,
            "bytes": tt.bytes(lp.token_id),
            "top_logprobs": [
                {"token": tt.text(t), "logprob": v, "bytes": tt.bytes(t)} for t, v in lp.top
            ],
        }
        for lp in items
    ]


@dataclass
class TextLogprobs:
    """The legacy completions logprobs object, built incrementally."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, state: ServerState, items: list[TokenLogprob], offset: int) -> None:
        tt = state.token_text
        for lp in items:
            text = tt.text(lp.token_id)
            self.tokens.append(text)
            self.token_logprobs.append(lp.logprob)
            self.top_logprobs.append({tt.text(t): v for t, v in lp.top})
            self.text_offset.append(offset)
            offset += len(text)

    def body(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


# ------------------------------------------------------------------------------------------
# /v1/models
# ------------------------------------------------------------------------------------------
def _model_card(state: ServerState, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "mtpserve",
        "root": state.names[0],
        "max_model_len": state.engine.context_length,
    }


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.mtp
    state.require_engine()
    return {"object": "list", "data": [_model_card(state, n) for n in state.names]}


@router.get("/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.mtp
    state.require_engine()
    state.check_model(model_id)
    return _model_card(state, model_id)


# ------------------------------------------------------------------------------------------
# /v1/chat/completions
# ------------------------------------------------------------------------------------------
@dataclass
class ChatChoice:
    parser: ChatOutputParser
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None


def _chat_finish(reason: str, parser: ChatOutputParser) -> str:
    return "tool_calls" if parser.tool_calls and reason == "stop" else reason


def _delta_body(parsed: ParsedDelta) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if parsed.reasoning:
        delta["reasoning_content"] = parsed.reasoning
    if parsed.content:
        delta["content"] = parsed.content
    if parsed.tool_calls:
        # One entry per tool-call index: a name and its arguments that became known in the
        # same step travel together.
        calls: list[dict[str, Any]] = []
        for call in parsed.tool_calls:
            if calls and calls[-1]["index"] == call.index:
                body = calls[-1]
            else:
                body = {"index": call.index, "function": {}}
                calls.append(body)
            if call.id is not None:
                body["id"] = call.id
                body["type"] = "function"
            function = body["function"]
            if call.name is not None:
                function["name"] = call.name
            if call.name is not None or call.arguments is not None:
                function["arguments"] = function.get("arguments", "") + (call.arguments or "")
        delta["tool_calls"] = calls
    return delta


@router.post("/chat/completions", response_model=None)
async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.mtp
    req = _validate(ChatCompletionRequest, await read_json(request, state.settings.max_body_bytes))
    engine = state.require_engine()
    model = state.check_model(req.model)
    stops = check_common(req, state.settings)
    tools = select_tools(req)
    prompt_text = render_chat(engine.tokenizer, req, tools)
    prompt_ids = engine.tokenizer.encode(prompt_text, add_special_tokens=False)
    if not prompt_ids:
        raise bad_request("the rendered prompt is empty", param="messages")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    if (req.top_logprobs or 0) > state.settings.max_top_logprobs:
        raise bad_request(
            f"top_logprobs must be at most {state.settings.max_top_logprobs}",
            param="top_logprobs",
        )
    requested = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = decide_max_tokens(
        requested, len(prompt_ids), engine.context_length, state.settings, param=param
    )
    sampling = resolve_sampling(engine, state.sampling_layer, req)
    gen_requests = make_requests(
        prompt_ids,
        sampling,
        n=req.n,
        max_tokens=max_tokens,
        engine=engine,
        req=req,
        top_logprobs=(req.top_logprobs or 0) if req.logprobs else None,
    )
    job = _start_job(
        state,
        request,
        gen_requests,
        stops=stops,
        ignore_eos=req.ignore_eos,
        prompt_tokens=len(prompt_ids),
        model=model,
        prefix="chatcmpl",
    )
    start_reasoning = req.include_reasoning and prompt_opens_reasoning(prompt_text)

    def new_parser() -> ChatOutputParser:
        return ChatOutputParser(
            start_in_reasoning=start_reasoning, parse_reasoning=req.include_reasoning, tools=tools
        )

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return CancellingStreamingResponse(
            _stream_chat(job, new_parser, include_usage, req.logprobs), on_close=job.cancel_all
        )
    result = await run_watching_disconnect(
        request, _collect_chat(job, new_parser, req.logprobs), job.handles
    )
    if result is None:
        return Response(status_code=499)  # client is gone; nobody reads this
    return JSONResponse(result)


async def _collect_chat(
    job: Job, new_parser: Callable[[], ChatOutputParser], logprobs: bool
) -> dict[str, Any]:
    choices: list[dict[str, Any]] = []
    for index in range(len(job.handles)):
        choice = ChatChoice(parser=new_parser())
        async for step in job.steps(index):
            parsed = choice.parser.feed(step.text)
            if step.finish_reason is not None:
                parsed.extend(choice.parser.finish())
                choice.finish_reason = _chat_finish(step.finish_reason, choice.parser)
            choice.reasoning.append(parsed.reasoning)
            choice.content.append(parsed.content)
            if logprobs:
                choice.logprobs.extend(chat_logprobs(job.state, step.logprobs))
        job.usage.add_choice(job.streams[index])
        message: dict[str, Any] = {"role": "assistant", "content": "".join(choice.content)}
        reasoning = "".join(choice.reasoning)
        if reasoning:
            message["reasoning_content"] = reasoning
        if choice.parser.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in choice.parser.tool_calls
            ]
            if not message["content"]:
                message["content"] = None
        choices.append(
            {
                "index": index,
                "message": message,
                "logprobs": {"content": choice.logprobs} if logprobs else None,
                "finish_reason": choice.finish_reason,
            }
        )
    return {
        "id": job.id,
        "object": "chat.completion",
        "created": job.created,
        "model": job.model,
        "choices": choices,
        "usage": job.usage.body(),
    }


def _sse_chunk(
    job: Job, object_type: str, choices: list[dict[str, Any]], usage: dict[str, Any] | None
) -> bytes:
    """One streamed chunk in OpenAI's shape (chat or text completion)."""
    body: dict[str, Any] = {
        "id": job.id,
        "object": object_type,
        "created": job.created,
        "model": job.model,
        "choices": choices,
    }
    if usage is not None:
        body["usage"] = usage
    return sse_data(body)


async def _stream_chat(
    job: Job, new_parser: Callable[[], ChatOutputParser], include_usage: bool, logprobs: bool
) -> AsyncIterator[bytes]:
    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        return _sse_chunk(job, "chat.completion.chunk", choices, usage)

    try:
        for index in range(len(job.handles)):
            parser = new_parser()
            yield chunk(
                [
                    {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
            async for step in job.steps(index):
                parsed = parser.feed(step.text)
                finish = None
                if step.finish_reason is not None:
                    parsed.extend(parser.finish())
                    finish = _chat_finish(step.finish_reason, parser)
                delta = _delta_body(parsed)
                lp = chat_logprobs(job.state, step.logprobs) if logprobs else []
                if not delta and not lp and finish is None:
                    continue
                yield chunk(
                    [
                        {
                            "index": index,
                            "delta": delta,
                            "logprobs": {"content": lp} if logprobs else None,
                            "finish_reason": finish,
                        }
                    ]
                )
            job.usage.add_choice(job.streams[index])
        if include_usage:
            yield chunk([], usage=job.usage.body())
        yield DONE
    except APIError as exc:
        job.cancel_all()
        yield sse_data(exc.body())
        yield DONE


# ------------------------------------------------------------------------------------------
# /v1/completions
# ------------------------------------------------------------------------------------------
@router.post("/completions", response_model=None)
async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.mtp
    req = _validate(CompletionRequest, await read_json(request, state.settings.max_body_bytes))
    engine = state.require_engine()
    model = state.check_model(req.model)
    prompts = encode_prompts(engine.tokenizer, req, engine.vocab_size)
    stops = check_common(req, state.settings, n_prompts=len(prompts))
    if (req.logprobs or 0) > state.settings.max_top_logprobs:
        raise bad_request(
            f"logprobs must be at most {state.settings.max_top_logprobs}", param="logprobs"
        )
    sampling = resolve_sampling(engine, state.sampling_layer, req)
    gen_requests = []
    for ids in prompts:
        max_tokens = decide_max_tokens(
            req.max_tokens, len(ids), engine.context_length, state.settings
        )
        gen_requests += make_requests(
            ids,
            sampling,
            n=req.n,
            max_tokens=max_tokens,
            engine=engine,
            req=req,
            top_logprobs=req.logprobs,
        )
    job = _start_job(
        state,
        request,
        gen_requests,
        stops=stops,
        ignore_eos=req.ignore_eos,
        prompt_tokens=sum(len(p) for p in prompts),
        model=model,
        prefix="cmpl",
    )
    echoes = [
        engine.tokenizer.decode(ids, skip_special_tokens=False) if req.echo else ""
        for ids in prompts
        for _ in range(req.n)
    ]
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return CancellingStreamingResponse(
            _stream_text(job, echoes, include_usage, req.logprobs is not None),
            on_close=job.cancel_all,
        )
    result = await run_watching_disconnect(
        request, _collect_text(job, echoes, req.logprobs is not None), job.handles
    )
    if result is None:
        return Response(status_code=499)
    return JSONResponse(result)


async def _collect_text(job: Job, echoes: list[str], logprobs: bool) -> dict[str, Any]:
    choices: list[dict[str, Any]] = []
    for index in range(len(job.handles)):
        text = echoes[index]
        lps = TextLogprobs()
        finish = None
        async for step in job.steps(index):
            if logprobs:
                lps.add(job.state, step.logprobs, len(text))
            text += step.text
            finish = step.finish_reason or finish
        job.usage.add_choice(job.streams[index])
        choices.append(
            {
                "index": index,
                "text": text,
                "logprobs": lps.body() if logprobs else None,
                "finish_reason": finish,
            }
        )
    return {
        "id": job.id,
        "object": "text_completion",
        "created": job.created,
        "model": job.model,
        "choices": choices,
        "usage": job.usage.body(),
    }


async def _stream_text(
    job: Job, echoes: list[str], include_usage: bool, logprobs: bool
) -> AsyncIterator[bytes]:
    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        return _sse_chunk(job, "text_completion", choices, usage)

    try:
        for index in range(len(job.handles)):
            offset = 0
            if echoes[index]:
                offset = len(echoes[index])
                yield chunk(
                    [
                        {
                            "index": index,
                            "text": echoes[index],
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
            async for step in job.steps(index):
                lps = TextLogprobs()
                if logprobs:
                    lps.add(job.state, step.logprobs, offset)
                offset += len(step.text)
                if not step.text and not step.logprobs and step.finish_reason is None:
                    continue
                yield chunk(
                    [
                        {
                            "index": index,
                            "text": step.text,
                            "logprobs": lps.body() if logprobs else None,
                            "finish_reason": step.finish_reason,
                        }
                    ]
                )
            job.usage.add_choice(job.streams[index])
        if include_usage:
            yield chunk([], usage=job.usage.body())
        yield DONE
    except APIError as exc:
        job.cancel_all()
        yield sse_data(exc.body())
        yield DONE
