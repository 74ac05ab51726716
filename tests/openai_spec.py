"""Compact JSON Schemas of the OpenAI response bodies mtpserve sends, written for these tests.

Each schema below mirrors the component of OpenAI's published OpenAPI document
(github.com/openai/openai-openapi, ``openapi.yaml``, ``components.schemas``) named in its comment:
the fields that component marks ``required``, their types and nullability, and the enums of the
fields that carry one. They were written by reading the spec; nothing of the spec is copied into
the repository and nothing is downloaded at test time, so they are a faithful subset — not the
document itself. Fields the spec leaves optional are checked only where mtpserve sends them.

One deliberate deviation, marked below: the spec describes legacy completion stream chunks with
``CreateCompletionResponse``, whose ``finish_reason`` is not nullable, while OpenAI (and every
client) sends ``null`` until the last chunk; the chunk schema here allows that ``null``.
"""

from __future__ import annotations

from typing import Any

NULL = {"type": "null"}
STRING = {"type": "string"}
INTEGER = {"type": "integer"}
NUMBER = {"type": "number"}


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, NULL]}


def const(value: str) -> dict[str, Any]:
    return {"type": "string", "enum": [value]}


def obj(required: dict[str, Any], optional: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "required": list(required),
        "properties": required | (optional or {}),
    }


def array(items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": items}


def ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/$defs/{name}"}


CHAT_FINISH = {"type": "string", "enum": ["stop", "length", "tool_calls", "content_filter"]}
TEXT_FINISH = {"type": "string", "enum": ["stop", "length", "content_filter"]}


def completion(kind: str, choice: dict[str, Any], chunk: bool = False) -> dict[str, Any]:
    """A chat or text completion (or stream chunk) with ``choice`` items; a chunk's usage is
    null until the last one."""
    usage = nullable(ref("CompletionUsage")) if chunk else ref("CompletionUsage")
    head = {"id": STRING, "object": const(kind), "created": INTEGER, "model": STRING}
    return obj(head | {"choices": array(choice)}, {"usage": usage})


DEFS: dict[str, Any] = {
    # Error / ErrorResponse
    "ErrorResponse": obj(
        {
            "error": obj(
                {
                    "message": STRING,
                    "type": STRING,
                    "param": nullable(STRING),
                    "code": nullable(STRING),
                }
            )
        }
    ),
    # Model
    "Model": obj({"id": STRING, "object": const("model"), "created": INTEGER, "owned_by": STRING}),
    # ListModelsResponse
    "ListModelsResponse": obj({"object": const("list"), "data": array(ref("Model"))}),
    # CompletionUsage
    "CompletionUsage": obj(
        {"prompt_tokens": INTEGER, "completion_tokens": INTEGER, "total_tokens": INTEGER},
        {
            "prompt_tokens_details": obj({}, {"cached_tokens": INTEGER}),
            "completion_tokens_details": obj({}, {"reasoning_tokens": INTEGER}),
        },
    ),
    # ChatCompletionTokenLogprob (top_logprobs items: token, logprob, bytes)
    "ChatCompletionTokenLogprob": obj(
        {
            "token": STRING,
            "logprob": NUMBER,
            "bytes": nullable(array(INTEGER)),
            "top_logprobs": array(
                obj({"token": STRING, "logprob": NUMBER, "bytes": nullable(array(INTEGER))})
            ),
        }
    ),
    # the choices' ``logprobs`` object of CreateChatCompletionResponse and of the stream chunk
    "ChoiceLogprobs": nullable(
        obj(
            {
                "content": nullable(array(ref("ChatCompletionTokenLogprob"))),
                "refusal": nullable(array(ref("ChatCompletionTokenLogprob"))),
            }
        )
    ),
    # ChatCompletionMessageToolCall
    "ChatCompletionMessageToolCall": obj(
        {
            "id": STRING,
            "type": const("function"),
            "function": obj({"name": STRING, "arguments": STRING}),
        }
    ),
    # ChatCompletionResponseMessage
    "ChatCompletionResponseMessage": obj(
        {"role": const("assistant"), "content": nullable(STRING), "refusal": nullable(STRING)},
        {"tool_calls": array(ref("ChatCompletionMessageToolCall"))},
    ),
    # CreateChatCompletionResponse
    "CreateChatCompletionResponse": completion(
        "chat.completion",
        obj(
            {
                "finish_reason": CHAT_FINISH,
                "index": INTEGER,
                "message": ref("ChatCompletionResponseMessage"),
                "logprobs": ref("ChoiceLogprobs"),
            }
        ),
    ),
    # ChatCompletionMessageToolCallChunk
    "ChatCompletionMessageToolCallChunk": obj(
        {"index": INTEGER},
        {
            "id": STRING,
            "type": const("function"),
            "function": obj({}, {"name": STRING, "arguments": STRING}),
        },
    ),
    # CreateChatCompletionStreamResponse (with ChatCompletionStreamResponseDelta)
    "CreateChatCompletionStreamResponse": completion(
        "chat.completion.chunk",
        obj(
            {
                "delta": obj(
                    {},
                    {
                        "content": nullable(STRING),
                        "refusal": nullable(STRING),
                        "role": {"type": "string", "enum": ["assistant"]},
                        "tool_calls": array(ref("ChatCompletionMessageToolCallChunk")),
                    },
                ),
                "finish_reason": nullable(CHAT_FINISH),
                "index": INTEGER,
            },
            {"logprobs": ref("ChoiceLogprobs")},
        ),
        chunk=True,
    ),
    # CreateCompletionResponse (choices' logprobs: tokens, token_logprobs, top_logprobs, ...)
    "CompletionLogprobs": nullable(
        obj(
            {},
            {
                "text_offset": array(INTEGER),
                "token_logprobs": array(NUMBER),
                "tokens": array(STRING),
                "top_logprobs": array({"type": "object", "additionalProperties": NUMBER}),
            },
        )
    ),
    "CreateCompletionResponse": completion(
        "text_completion",
        obj(
            {
                "finish_reason": TEXT_FINISH,
                "index": INTEGER,
                "logprobs": ref("CompletionLogprobs"),
                "text": STRING,
            }
        ),
    ),
    # CreateCompletionResponse as a stream chunk — the deviation: finish_reason may be null
    "CompletionChunk": completion(
        "text_completion",
        obj(
            {
                "finish_reason": nullable(TEXT_FINISH),
                "index": INTEGER,
                "logprobs": ref("CompletionLogprobs"),
                "text": STRING,
            }
        ),
        chunk=True,
    ),
    # OutputTextContent
    "OutputTextContent": obj(
        {
            "type": const("output_text"),
            "text": STRING,
            "annotations": {"type": "array"},
            "logprobs": {"type": "array"},
        }
    ),
    # ReasoningTextContent
    "ReasoningTextContent": obj({"type": const("reasoning_text"), "text": STRING}),
    # OutputContent (the union content_part events carry)
    "OutputContent": {"oneOf": [ref("OutputTextContent"), ref("ReasoningTextContent")]},
    # OutputMessage
    "OutputMessage": obj(
        {
            "id": STRING,
            "type": const("message"),
            "role": const("assistant"),
            "status": {"type": "string", "enum": ["in_progress", "completed", "incomplete"]},
            "content": array(ref("OutputTextContent")),
        }
    ),
    # FunctionToolCall
    "FunctionToolCall": obj(
        {"type": const("function_call"), "call_id": STRING, "name": STRING, "arguments": STRING},
        {
            "id": STRING,
            "status": {"type": "string", "enum": ["in_progress", "completed", "incomplete"]},
        },
    ),
    # ReasoningItem
    "ReasoningItem": obj(
        {"type": const("reasoning"), "id": STRING, "summary": {"type": "array"}},
        {"content": array(ref("ReasoningTextContent"))},
    ),
    # OutputItem (the members mtpserve produces)
    "OutputItem": {"oneOf": [ref("OutputMessage"), ref("FunctionToolCall"), ref("ReasoningItem")]},
    # ResponseUsage
    "ResponseUsage": obj(
        {
            "input_tokens": INTEGER,
            "input_tokens_details": obj({"cached_tokens": INTEGER, "cache_write_tokens": INTEGER}),
            "output_tokens": INTEGER,
            "output_tokens_details": obj({"reasoning_tokens": INTEGER}),
            "total_tokens": INTEGER,
        }
    ),
    # FunctionTool
    "FunctionTool": obj(
        {
            "type": const("function"),
            "name": STRING,
            "strict": nullable({"type": "boolean"}),
            "parameters": nullable({"type": "object"}),
        },
        {"description": nullable(STRING)},
    ),
    # Response (ResponseProperties + ModelResponseProperties + its own required fields)
    "Response": obj(
        {
            "id": STRING,
            "object": const("response"),
            "created_at": NUMBER,
            "error": nullable(obj({"code": STRING, "message": STRING})),
            "incomplete_details": nullable(
                obj({}, {"reason": {"type": "string", "enum": ["max_output_tokens"]}})
            ),
            "instructions": nullable(STRING),
            "metadata": nullable({"type": "object", "additionalProperties": STRING}),
            "model": STRING,
            "output": array(ref("OutputItem")),
            "parallel_tool_calls": {"type": "boolean"},
            "temperature": nullable(NUMBER),
            "top_p": nullable(NUMBER),
            "tool_choice": {
                "anyOf": [
                    {"type": "string", "enum": ["none", "auto", "required"]},
                    obj({"type": const("function"), "name": STRING}),
                ]
            },
            "tools": array(ref("FunctionTool")),
        },
        {
            "status": {
                "type": "string",
                "enum": ["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"],
            },
            "usage": ref("ResponseUsage"),
            "max_output_tokens": nullable(INTEGER),
            "previous_response_id": nullable(STRING),
        },
    ),
}


def _event(kind: str, fields: dict[str, Any]) -> dict[str, Any]:
    return obj({"type": const(kind), "sequence_number": INTEGER} | fields)


WHERE = {"item_id": STRING, "output_index": INTEGER}
# One schema per Responses stream event: Response*Event in the spec.
RESPONSE_EVENTS: dict[str, dict[str, Any]] = {
    "response.created": _event("response.created", {"response": ref("Response")}),
    "response.in_progress": _event("response.in_progress", {"response": ref("Response")}),
    "response.completed": _event("response.completed", {"response": ref("Response")}),
    "response.incomplete": _event("response.incomplete", {"response": ref("Response")}),
    "response.output_item.added": _event(
        "response.output_item.added", {"output_index": INTEGER, "item": ref("OutputItem")}
    ),
    "response.output_item.done": _event(
        "response.output_item.done", {"output_index": INTEGER, "item": ref("OutputItem")}
    ),
    "response.content_part.added": _event(
        "response.content_part.added",
        WHERE | {"content_index": INTEGER, "part": ref("OutputContent")},
    ),
    "response.content_part.done": _event(
        "response.content_part.done",
        WHERE | {"content_index": INTEGER, "part": ref("OutputContent")},
    ),
    "response.output_text.delta": _event(
        "response.output_text.delta",
        WHERE | {"content_index": INTEGER, "delta": STRING, "logprobs": {"type": "array"}},
    ),
    "response.output_text.done": _event(
        "response.output_text.done",
        WHERE | {"content_index": INTEGER, "text": STRING, "logprobs": {"type": "array"}},
    ),
    "response.reasoning_text.delta": _event(
        "response.reasoning_text.delta", WHERE | {"content_index": INTEGER, "delta": STRING}
    ),
    "response.reasoning_text.done": _event(
        "response.reasoning_text.done", WHERE | {"content_index": INTEGER, "text": STRING}
    ),
    "response.function_call_arguments.delta": _event(
        "response.function_call_arguments.delta", WHERE | {"delta": STRING}
    ),
    "response.function_call_arguments.done": _event(
        "response.function_call_arguments.done", WHERE | {"name": STRING, "arguments": STRING}
    ),
    "error": _event(
        "error", {"code": nullable(STRING), "message": STRING, "param": nullable(STRING)}
    ),
}


def schema(name: str) -> dict[str, Any]:
    """A self-contained schema for the component ``name`` (or a Responses event type)."""
    root = RESPONSE_EVENTS[name] if name in RESPONSE_EVENTS else ref(name)
    return {"$defs": DEFS, **root}
