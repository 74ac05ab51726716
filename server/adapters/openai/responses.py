"""``POST /v1/responses``: OpenAI's Responses API (what Codex CLI speaks) on the core.

Input items map onto the chat template (messages, ``function_call`` -> the assistant's tool
calls, ``function_call_output`` -> tool results, ``reasoning`` -> the next assistant turn's
reasoning); the output's blocks become output items — ``reasoning``, ``message`` with
``output_text``, ``function_call`` — and stream as the Responses events (``response.created``,
``response.in_progress``, per item ``output_item.added`` / deltas / ``output_item.done``, then
``response.completed``, or ``response.incomplete`` when ``max_output_tokens`` ran out).

Stateless by design: nothing is stored (``store`` is accepted and answered ``false``), and
``previous_response_id`` and ``conversation`` are a 400 — clients resend the conversation, as
Codex CLI does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from server.adapters.openai.responses_schemas import ResponsesRequest, template_messages
from server.core import chat_format
from server.core.chat_format import Prompt
from server.core.http import json_body, read_body, respond, v1_router
from server.core.jobs import Job, Usage, new_id, start_job
from server.core.output import Block, BlockEvent, OutputDelta
from server.core.requests import (
    GenerationParams,
    build_requests,
    effort_kwargs,
    output_grammar,
    output_schema,
    select_tools,
)
from server.core.sampler_schema import sent_sampling
from server.core.sse import sse_json
from server.errors import APIError, bad_request
from server.state import ServerState

router = v1_router()

#: block kind -> the stream events' name stem for its deltas and its end
_EVENT_STEMS = {
    "reasoning": "response.reasoning_text",
    "text": "response.output_text",
    "tool_call": "response.function_call_arguments",
}


def _echo(model: Any) -> Any:
    """A request field as the response object repeats it."""
    return model.model_dump(exclude_none=True) if hasattr(model, "model_dump") else model


def _part(block: Block) -> dict[str, Any]:
    """A message's or reasoning item's content part."""
    if block.kind == "text":
        return {"type": "output_text", "text": block.text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": block.text}


def _render(state: ServerState, req: ResponsesRequest) -> tuple[Prompt, str | None]:
    """The prompt, and the grammar of ``text.format`` (None: free text)."""
    tools = [
        {
            "type": "function",
            "function": t.model_dump(exclude={"type", "strict"}, exclude_none=True),
        }
        for t in req.tools or []
        if t.type == "function" and t.name
    ]
    choice = req.tool_choice
    named = choice.name if choice is not None and not isinstance(choice, str) else None
    shown = select_tools(tools, choice if isinstance(choice, str) else None, named=named)
    effort = req.reasoning.effort if req.reasoning is not None else None
    kwargs = effort_kwargs(req.chat_template_kwargs, effort)
    fmt = req.text.format if req.text is not None else None
    schema = output_schema(fmt.type, fmt.schema_, "text.format.schema") if fmt else None
    prompt = chat_format.render(state, template_messages(req), shown, kwargs, param="input")
    forced = choice == "required" or named is not None
    # a named function is asked for once
    parallel = req.parallel_tool_calls is not False and named is None
    grammar = output_grammar(
        state,
        prompt,
        schema,
        "text.format.schema",
        force_tool_call=forced,
        parallel_tool_calls=parallel,
    )
    return prompt, grammar


@router.post("/responses", response_model=None, openapi_extra=json_body(ResponsesRequest))
async def responses(request: Request) -> Response:
    state, req = await read_body(request, ResponsesRequest)
    model = state.check_model(req.model)
    for stored in ("previous_response_id", "conversation"):
        if getattr(req, stored) is not None:
            raise bad_request(
                f"{stored} is not supported: this server stores no responses or "
                "conversations; send the whole conversation in 'input'",
                param=stored,
                code="unsupported_parameter",
            )
    prompt, grammar = await asyncio.to_thread(_render, state, req)  # templating, tokenizing
    params = GenerationParams(
        max_tokens=req.max_output_tokens,
        max_tokens_param="max_output_tokens",
        prompt_param="input",
        sampling=sent_sampling(req),
        draft_tokens=req.draft_tokens,
        grammar=grammar,
    )
    requests = build_requests(state, [prompt], params)
    job = await start_job(
        state, [prompt], params, requests, model=model, id=new_id("resp", "_"), parse=True
    )
    view = ResponseView(job, req)
    return await respond(
        request,
        job,
        stream_with=ResponseStream(view) if req.stream else None,
        body=lambda _: view.body(done=True),
    )


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        # nothing is charged for writing the prompt cache, which fills itself
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "speculative": usage.speculative(),
    }


class ResponseView:
    """The response object, as it stands (``done``) or in progress."""

    def __init__(self, job: Job, req: ResponsesRequest) -> None:
        self.job, self.req = job, req
        self.item_ids: dict[int, str] = {}

    def item_id(self, index: int, block: Block) -> str:
        if index not in self.item_ids:
            prefix = {"reasoning": "rs", "text": "msg", "tool_call": "fc"}[block.kind]
            self.item_ids[index] = new_id(prefix, "_")
        return self.item_ids[index]

    def item(self, index: int, block: Block, status: str | None = None) -> dict[str, Any]:
        """Output item ``index``; its status, unless given, is where the generation left it:
        ``incomplete`` for the item that ``max_output_tokens`` cut (the last one), as OpenAI
        marks it."""
        if status is None:
            choice = self.job.choices[0]
            last = index == len(choice.blocks) - 1
            # a tool call knows whether it was closed; text and reasoning end where the cut is
            cut = choice.finish_reason == "length" and last and block.kind != "tool_call"
            status = "incomplete" if cut or not block.complete else "completed"
        item: dict[str, Any] = {"id": self.item_id(index, block), "status": status}
        if block.kind == "tool_call":
            call = {"call_id": block.call_id, "name": block.name, "arguments": block.text}
            return item | {"type": "function_call"} | call
        if block.kind == "reasoning":
            return item | {"type": "reasoning", "summary": [], "content": [_part(block)]}
        content = [] if status == "in_progress" else [_part(block)]
        return item | {"type": "message", "role": "assistant", "content": content}

    def body(self, *, done: bool) -> dict[str, Any]:
        choice, req = self.job.choices[0], self.req
        incomplete = done and choice.finish_reason == "length"
        body: dict[str, Any] = {
            "id": self.job.id,
            "object": "response",
            "created_at": self.job.created,
            "status": ("incomplete" if incomplete else "completed") if done else "in_progress",
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.job.model,
            "output": [self.item(i, b) for i, b in enumerate(choice.blocks)] if done else [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": req.reasoning.effort, "summary": None}
            if req.reasoning
            else None,
            "store": False,
            "temperature": req.temperature,
            "text": {
                "format": req.text.format.model_dump(exclude_none=True, by_alias=True)
                if req.text
                else {"type": "text"}
            },
            "tool_choice": _echo(req.tool_choice) or "auto",
            "tools": [
                _echo(t) | {"strict": t.strict, "parameters": t.parameters}
                for t in req.tools or []
                if t.type == "function" and t.name
            ],
            "top_p": req.top_p,
            "truncation": "disabled",
            "metadata": req.metadata or {},
        }
        if done:
            body["usage"] = usage_body(self.job.usage())
        return body


class ResponseStream:
    """The Responses API's named events, numbered by ``sequence_number``."""

    def __init__(self, view: ResponseView) -> None:
        self.view = view
        self.sequence = 0

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse_json(data, kind)

    def start(self) -> Iterable[dict[str, Any]]:
        response = self.view.body(done=False)
        yield self._event("response.created", response=response)
        yield self._event("response.in_progress", response=response)

    def choice_start(self, index: int) -> Iterable[dict[str, Any]]:
        return ()

    def delta(self, index: int, step: OutputDelta) -> Iterable[dict[str, Any]]:
        for event in step.blocks:
            yield from self._block_events(event)

    def _block_events(self, event: BlockEvent) -> Iterable[dict[str, Any]]:
        block, index = event.block, event.index
        stem = _EVENT_STEMS[block.kind]
        where = {"item_id": self.view.item_id(index, block), "output_index": index}
        part = {} if block.kind == "tool_call" else {"content_index": 0}
        logprobs = {"logprobs": []} if block.kind == "text" else {}
        if event.type == "start":
            item = self.view.item(index, block, status="in_progress")
            yield self._event("response.output_item.added", output_index=index, item=item)
            if part:
                empty = _part(Block(block.kind))
                yield self._event("response.content_part.added", **where, **part, part=empty)
        elif event.type == "delta":
            yield self._event(f"{stem}.delta", **where, **part, delta=event.delta, **logprobs)
        else:
            if part:
                yield self._event(f"{stem}.done", **where, **part, text=block.text, **logprobs)
                yield self._event("response.content_part.done", **where, **part, part=_part(block))
            else:
                yield self._event(f"{stem}.done", **where, name=block.name, arguments=block.text)
            item = self.view.item(index, block)
            yield self._event("response.output_item.done", output_index=index, item=item)

    def choice_end(self, index: int) -> Iterable[dict[str, Any]]:
        return ()

    def end(self) -> Iterable[dict[str, Any]]:
        response = self.view.body(done=True)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield self._event(kind, response=response)

    def error(self, error: APIError) -> Iterable[dict[str, Any]]:
        yield self._event("error", code=error.code, message=error.message, param=error.param)
