"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API on the core.

Requests map onto the chat template (``system``, text / ``tool_use`` / ``tool_result`` /
``thinking`` blocks, tools, ``thinking`` -> the template's ``enable_thinking`` (absent: off, as
on Anthropic's API), a final assistant turn of text -> a prefill the reply continues); the
output's blocks map one to one onto Anthropic's content blocks and stream events
(``message_start`` once the engine's first event gives the prompt's cache split,
``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta`` with the stop reason and
usage, ``message_stop``; ``ping`` while nothing else is sent). Errors use
Anthropic's shape (server/errors.py picks it by path). ``usage.input_tokens`` counts the prompt
tokens that were not read from the prompt cache; those are ``cache_read_input_tokens``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import ServerSentEvent

from server.adapters.anthropic.errors import error_body
from server.adapters.anthropic.schemas import CountTokensRequest, MessagesRequest
from server.core import chat_format
from server.core.chat_format import Prompt
from server.core.http import json_body, read_body, respond, v1_router
from server.core.jobs import Job, Usage, new_id, start_job
from server.core.output import Block, BlockEvent, OutputDelta
from server.core.requests import (
    GenerationParams,
    build_requests,
    join_text,
    output_grammar,
    output_schema,
    prefill_kwargs,
    refuse_structured_prefill,
    select_tools,
)
from server.core.sampler_schema import sent_sampling
from server.core.sse import sse_json
from server.errors import APIError, bad_request
from server.state import ServerState

router = v1_router()

_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn"}


def template_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    """Anthropic's system + messages -> the chat template's messages."""
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": join_text(req.system, "system")})
    for i, message in enumerate(req.messages):
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        texts: list[str] = []
        reasoning: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(message.content):
            where = f"messages.{i}.content.{j}"
            if block.type == "text":
                texts.append(block.text)
            elif block.type == "thinking" and message.role == "assistant":
                reasoning.append(block.thinking)
            elif block.type == "redacted_thinking":
                continue
            elif block.type == "tool_use" and message.role == "assistant":
                function = {"name": block.name, "arguments": block.input}
                calls.append({"id": block.id, "type": "function", "function": function})
            elif block.type == "tool_result" and message.role == "user":
                content = join_text(block.content, f"{where}.content")
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
            else:
                raise bad_request(
                    f"content block type {block.type!r} is not supported in a {message.role} "
                    "message",
                    param=where,
                )
        turn: dict[str, Any] = {"role": message.role, "content": "\n".join(texts)}
        if reasoning:
            turn["reasoning_content"] = "\n".join(reasoning)
        if calls:
            turn["tool_calls"] = calls
        if texts or reasoning or calls or message.role == "assistant":
            out.append(turn)
    return out


def render(state: ServerState, req: CountTokensRequest) -> tuple[Prompt, str | None]:
    """The prompt, and the grammar of ``output_config.format`` (None: free text)."""
    tools = None
    if req.tools:
        for j, tool in enumerate(req.tools):
            if tool.type not in (None, "custom"):
                raise bad_request(f"tool type {tool.type!r} is not supported", param=f"tools.{j}")
        tools = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description or "",
                    "parameters": t.input_schema,
                },
            }
            for t in req.tools
        ]
    choice = req.tool_choice
    tools = select_tools(
        tools,
        {"none": "none", "any": "required"}.get(choice.type, "auto") if choice else None,
        named=choice.name if choice is not None and choice.type == "tool" else None,
    )
    # Anthropic's API does not think unless asked to (the chat template's default is to think)
    thinking = req.thinking is not None and req.thinking.type != "disabled"
    kwargs: dict[str, Any] | None = {"enable_thinking": thinking}
    messages, prefill = template_messages(req), assistant_prefill(req)
    last = f"messages.{len(req.messages) - 1}"
    if prefill:
        messages, kwargs = messages[:-1], prefill_kwargs(kwargs, last)
    fmt, where = None, "output_config.format"
    if req.output_config is not None and req.output_config.format is not None:
        fmt = req.output_config.format
    elif req.output_format is not None:
        fmt, where = req.output_format, "output_format"
    schema = output_schema(fmt.type, fmt.schema_, f"{where}.schema") if fmt else None
    if schema is not None:
        refuse_structured_prefill(where, last if prefill else None)
    prompt = chat_format.render(state, messages, tools, kwargs, prefill=prefill)
    forced = choice is not None and choice.type in ("any", "tool")
    # a named tool is asked for once
    parallel = not (
        choice is not None and (choice.disable_parallel_tool_use or choice.type == "tool")
    )
    grammar = output_grammar(
        state,
        prompt,
        schema,
        f"{where}.schema",
        force_tool_call=forced,
        parallel_tool_calls=parallel,
    )
    return prompt, grammar


def assistant_prefill(req: CountTokensRequest) -> str:
    """The text of a final assistant turn made of text alone: Anthropic's prefill, which the
    reply continues ("" when the conversation does not end that way)."""
    last = req.messages[-1] if req.messages else None
    if last is None or last.role != "assistant":
        return ""
    if isinstance(last.content, str):
        return last.content
    if not last.content or any(block.type != "text" for block in last.content):
        return ""  # tool use or thinking: a finished turn, rendered as one
    return "\n".join(block.text for block in last.content)


@router.post("/messages/count_tokens", openapi_extra=json_body(CountTokensRequest))
async def count_tokens(request: Request) -> JSONResponse:
    state, req = await read_body(request, CountTokensRequest)
    state.check_model(req.model)
    prompt, _ = await asyncio.to_thread(render, state, req)  # templating, tokenizing
    return JSONResponse({"input_tokens": len(prompt.ids)})


@router.post("/messages", response_model=None, openapi_extra=json_body(MessagesRequest))
async def messages(request: Request) -> Response:
    state, req = await read_body(request, MessagesRequest)
    model = state.check_model(req.model)
    prompt, grammar = await asyncio.to_thread(render, state, req)  # templating, tokenizing
    params = GenerationParams(
        max_tokens=req.max_tokens,
        prompt_param="messages",
        sampling=sent_sampling(req),
        stop=list(req.stop_sequences or []),
        stop_param="stop_sequences",
        draft_tokens=req.draft_tokens,
        grammar=grammar,
        reasoning_budget=req.thinking.budget_tokens
        if req.thinking is not None and req.thinking.type == "enabled"
        else None,
    )
    requests = build_requests(state, [prompt], params)
    job = await start_job(
        state, [prompt], params, requests, model=model, id=new_id("msg", "_"), parse=True
    )
    return await respond(
        request,
        job,
        stream_with=MessageStream(job) if req.stream else None,
        body=lambda _: message_body(
            # a tool call cut at max_tokens is left out: its input is not known (the streamed
            # form shows the part that was written, as Anthropic's stream does)
            job,
            [content_block(b) for b in job.choices[0].blocks if b.complete],
        ),
        ping=lambda: ServerSentEvent(data='{"type":"ping"}', event="ping", sep="\n"),
    )


def content_block(block: Block) -> dict[str, Any]:
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": block.text, "signature": ""}
    if block.kind == "text":
        return {"type": "text", "text": block.text}
    return {
        "type": "tool_use",
        "id": block.call_id,
        "name": block.name,
        "input": json.loads(block.text or "{}"),
    }


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def stop_fields(job: Job) -> dict[str, Any]:
    choice = job.choices[0]
    reason = _STOP_REASONS.get(choice.finish_reason or "stop", "end_turn")
    if choice.stop_sequence is not None:
        reason = "stop_sequence"
    return {"stop_reason": reason, "stop_sequence": choice.stop_sequence}


def message_body(job: Job, content: list[dict[str, Any]], *, final: bool = True) -> dict[str, Any]:
    stop = stop_fields(job) if final else {"stop_reason": None, "stop_sequence": None}
    return {
        "id": job.id,
        "type": "message",
        "role": "assistant",
        "model": job.model,
        "content": content,
        **stop,
        "usage": usage_body(job.usage()),
    }


class MessageStream:
    """Anthropic's named stream events for the one choice of a job.

    ``message_start`` waits for the engine's first event: only then is the prompt's split into
    cached and new tokens known, and cost trackers read the input usage from ``message_start``
    (pings keep the connection alive meanwhile)."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.started = False

    def _message_start(self) -> list[dict[str, Any]]:
        if self.started:
            return []
        self.started = True
        start = {"type": "message_start", "message": message_body(self.job, [], final=False)}
        return [sse_json(start, "message_start"), sse_json({"type": "ping"}, "ping")]

    def start(self) -> Iterable[dict[str, Any]]:
        return ()

    def choice_start(self, index: int) -> Iterable[dict[str, Any]]:
        return ()

    def delta(self, index: int, step: OutputDelta) -> Iterable[dict[str, Any]]:
        return self._message_start() + [self._block_event(event) for event in step.blocks]

    def _block_event(self, event: BlockEvent) -> dict[str, Any]:
        block = event.block
        if event.type == "start":
            empty = Block(block.kind, "", block.call_id, block.name)
            body = content_block(empty)
            data = {"type": "content_block_start", "index": event.index, "content_block": body}
        elif event.type == "delta":
            if block.kind == "reasoning":
                delta = {"type": "thinking_delta", "thinking": event.delta}
            elif block.kind == "text":
                delta = {"type": "text_delta", "text": event.delta}
            else:
                delta = {"type": "input_json_delta", "partial_json": event.delta}
            data = {"type": "content_block_delta", "index": event.index, "delta": delta}
        else:
            data = {"type": "content_block_stop", "index": event.index}
        return sse_json(data, data["type"])

    def choice_end(self, index: int) -> Iterable[dict[str, Any]]:
        return ()

    def end(self) -> Iterable[dict[str, Any]]:
        delta = {
            "type": "message_delta",
            "delta": stop_fields(self.job),
            "usage": usage_body(self.job.usage()),
        }
        return self._message_start() + [
            sse_json(delta, "message_delta"),
            sse_json({"type": "message_stop"}, "message_stop"),
        ]

    def error(self, error: APIError) -> Iterable[dict[str, Any]]:
        return [sse_json(error_body(error), "error")]
