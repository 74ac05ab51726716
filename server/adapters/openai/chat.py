"""``POST /v1/chat/completions``: OpenAI's Chat Completions mapped onto the core.

Reasoning comes back as ``reasoning_content`` (what Open WebUI reads), tool calls as OpenAI
``tool_calls`` (streamed as deltas), ``refusal`` is always null (nothing here refuses).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from server.adapters.openai.common import (
    OpenAIStream,
    completion_body,
    logprob_items,
    openai_params,
)
from server.adapters.openai.schemas import ChatCompletionRequest, ChatMessage, NamedToolChoice
from server.core import chat_format
from server.core.http import json_body, read_body, respond, v1_router
from server.core.jobs import Job, new_id, start_job
from server.core.output import OutputDelta
from server.core.requests import (
    build_requests,
    effort_kwargs,
    join_text,
    output_grammar,
    output_schema,
    parse_arguments,
    prefill_kwargs,
    refuse_structured_prefill,
    select_tools,
)
from server.core.toolcalls import ParsedDelta
from server.errors import bad_request

router = v1_router()


def template_message(message: ChatMessage, index: int) -> dict[str, Any]:
    """An OpenAI message -> the dict the chat template expects."""
    role = "system" if message.role == "developer" else message.role
    content = join_text(message.content, f"messages.{index}.content")
    out: dict[str, Any] = {"role": role, "content": content}
    if message.name:
        out["name"] = message.name
    if message.reasoning_content is not None:
        out["reasoning_content"] = message.reasoning_content
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        calls = []
        for j, call in enumerate(message.tool_calls):
            where = f"messages.{index}.tool_calls.{j}.function.arguments"
            args = parse_arguments(call.function.arguments, where)
            function = {"name": call.function.name, "arguments": args}
            calls.append({"id": call.id, "type": "function", "function": function})
        out["tool_calls"] = calls
    return out


@router.post(
    "/chat/completions", response_model=None, openapi_extra=json_body(ChatCompletionRequest)
)
async def chat_completions(request: Request) -> Response:
    state, req = await read_body(request, ChatCompletionRequest)
    model = state.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    for legacy, current in (("functions", "tools"), ("function_call", "tool_choice")):
        if getattr(req, legacy):
            raise bad_request(
                f"{legacy} (OpenAI's deprecated function calling) is not served: send {current}",
                param=legacy,
            )
    choice = req.tool_choice
    tools = select_tools(
        [t.model_dump(exclude_none=True) for t in req.tools or []],
        choice if isinstance(choice, str) else None,
        named=None if choice is None or isinstance(choice, str) else choice.function.name,
    )
    messages = [template_message(m, i) for i, m in enumerate(req.messages)]
    kwargs = effort_kwargs(req.chat_template_kwargs, req.reasoning_effort)
    messages, prefill, kwargs = continued_message(req, messages, kwargs)
    schema = response_schema(req)
    if schema is not None:
        refuse_structured_prefill("response_format", "continue_final_message" if prefill else None)
    # templating and tokenizing a long prompt must not hold up every other stream
    prompt = await asyncio.to_thread(
        chat_format.render, state, messages, tools, kwargs, prefill=prefill
    )
    params = openai_params(
        req,
        top_logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        prompt_param="messages",
        reasoning_budget=req.thinking_token_budget,
    )
    named = isinstance(choice, NamedToolChoice)
    params.grammar = await asyncio.to_thread(
        output_grammar,
        state,
        prompt,
        schema,
        "response_format.json_schema.schema",
        force_tool_call=choice == "required" or named,
        # a named function is asked for once (instructor, `parse` read the first call only)
        parallel_tool_calls=req.parallel_tool_calls is not False and not named,
    )
    if req.max_completion_tokens is not None:
        params.max_tokens = req.max_completion_tokens
        params.max_tokens_param = "max_completion_tokens"
    requests = build_requests(state, [prompt], params)
    job = await start_job(
        state,
        [prompt],
        params,
        requests,
        model=model,
        id=new_id("chatcmpl"),
        parse=True,
        include_reasoning=req.include_reasoning,
    )
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    encoder = ChatStream(job, req.logprobs, include_usage, req.mtp_trace) if req.stream else None
    return await respond(
        request, job, stream_with=encoder, body=lambda deltas: chat_body(job, deltas, req.logprobs)
    )


def response_schema(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON schema ``response_format`` asks for (None: free text); 400s as it says."""
    fmt = req.response_format
    if fmt is None:
        return None
    if fmt.type == "json_schema" and fmt.json_schema is None:
        raise bad_request(
            "response_format json_schema needs a 'json_schema' object",
            param="response_format.json_schema",
        )
    body = fmt.json_schema.schema_ if fmt.json_schema is not None else None
    return output_schema(fmt.type, body, "response_format.json_schema.schema")


def continued_message(
    req: ChatCompletionRequest, messages: list[dict[str, Any]], kwargs: dict[str, Any] | None
) -> tuple[list[dict[str, Any]], str, dict[str, Any] | None]:
    """``continue_final_message``: the final assistant message's text becomes a prefill the
    reply continues (the response holds only the continuation), with thinking off, since the
    reply would otherwise begin inside the reasoning. Returns the messages to render, the
    prefill ("" when not continuing) and the template arguments."""
    if not req.continue_final_message:
        if req.add_generation_prompt is False:
            raise bad_request(
                "add_generation_prompt false is supported only with continue_final_message",
                param="add_generation_prompt",
            )
        return messages, "", kwargs
    last = req.messages[-1]
    where = f"messages.{len(req.messages) - 1}"
    if req.add_generation_prompt:
        raise bad_request(
            "continue_final_message continues the final message: add_generation_prompt must "
            "be false",
            param="add_generation_prompt",
        )
    if last.role != "assistant" or last.tool_calls or not messages[-1]["content"]:
        raise bad_request(
            "continue_final_message needs a final assistant message with text content",
            param=where,
        )
    kwargs = prefill_kwargs(kwargs, "chat_template_kwargs.enable_thinking")
    return messages[:-1], messages[-1]["content"], kwargs


def chat_body(job: Job, deltas: list[list[OutputDelta]], logprobs: bool) -> dict[str, Any]:
    choices: list[dict[str, Any]] = []
    for index, steps in enumerate(deltas):
        parsed = ParsedDelta()
        for step in steps:
            parsed.extend(step.parsed)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content, "refusal": None}
        if parsed.reasoning:
            message["reasoning_content"] = parsed.reasoning
        calls = job.choices[index].tool_calls
        if calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in calls
            ]
            message["content"] = message["content"] or None
        items = [lp for step in steps for lp in step.content_logprobs]
        choices.append(
            {
                "index": index,
                "message": message,
                "logprobs": {"content": logprob_items(job.state, items), "refusal": None}
                if logprobs
                else None,
                "finish_reason": job.choices[index].finish_reason,
            }
        )
    return completion_body(job, "chat.completion", choices)


def delta_body(parsed: ParsedDelta) -> dict[str, Any]:
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


class ChatStream(OpenAIStream):
    """chat.completion.chunk events: a role chunk per choice, then the deltas."""

    object_type = "chat.completion.chunk"

    def __init__(self, job: Job, logprobs: bool, include_usage: bool, mtp_trace: bool) -> None:
        super().__init__(job, include_usage)
        self.logprobs = logprobs
        self.mtp_trace = mtp_trace

    def choice_start(self, index: int) -> Iterable[dict[str, Any]]:
        delta = {"role": "assistant", "content": "", "refusal": None}
        yield self.chunk(
            [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]
        )

    def delta(self, index: int, step: OutputDelta) -> Iterable[dict[str, Any]]:
        delta = delta_body(step.parsed)
        lp = logprob_items(self.job.state, step.content_logprobs) if self.logprobs else []
        traced = self.mtp_trace and bool(step.token_ids)
        if not delta and not lp and step.finish_reason is None and not traced:
            return
        body: dict[str, Any] = {
            "index": index,
            "delta": delta,
            "logprobs": {"content": lp, "refusal": None} if self.logprobs else None,
            "finish_reason": step.finish_reason,
        }
        if traced:
            body["mtp_trace"] = step.trace()
        yield self.chunk([body])
