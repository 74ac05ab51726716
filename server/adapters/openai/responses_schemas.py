"""Request body of OpenAI's Responses API (``POST /v1/responses``), and its input as the chat
template's messages.

``input`` is a string or a list of items: messages (with or without ``"type": "message"``),
``function_call``, ``function_call_output`` and ``reasoning``. Item types this server cannot use
(``item_reference``, images, built-in tools' calls) keep their ``type`` so the adapter can answer
with a 400 that names them. Unknown fields are ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from server.core.extensions import DraftTokens
from server.core.requests import ReasoningEffort, join_text, parse_arguments
from server.core.sampler_schema import sampler_fields_model
from server.core.tagged import by_type
from server.errors import bad_request

_TEXT_PARTS = ("input_text", "output_text", "text")


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Base):
    #: input_text / output_text / text are read; anything else is a 400
    type: str
    text: str | None = None


class MessageItem(_Base):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]


class FunctionCallItem(_Base):
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str = "{}"
    id: str | None = None


class FunctionCallOutputItem(_Base):
    type: Literal["function_call_output"] = "function_call_output"
    call_id: str
    output: str | list[ContentPart]


class ReasoningPart(_Base):
    type: str
    text: str = ""


class ReasoningItem(_Base):
    type: Literal["reasoning"] = "reasoning"
    id: str | None = None
    summary: list[ReasoningPart] = Field(default_factory=list)
    content: list[ReasoningPart] | None = None


class OtherItem(_Base):
    type: str


InputItem = by_type(
    {
        "message": MessageItem,
        "function_call": FunctionCallItem,
        "function_call_output": FunctionCallOutputItem,
        "reasoning": ReasoningItem,
    },
    OtherItem,
    missing="message",
)


class FunctionTool(_Base):
    #: "function" tools are shown to the model; built-in tool types are ignored
    type: str
    name: str | None = Field(None, min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Base):
    type: str
    name: str | None = None


class ReasoningConfig(_Base):
    effort: ReasoningEffort | None = None
    summary: str | None = None


class TextFormat(_Base):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = Field(None, max_length=64)
    description: str | None = None
    #: ``schema`` shadows a BaseModel attribute, hence the alias
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    #: Accepted: every reply follows its schema whatever ``strict`` says.
    strict: bool | None = None


class TextConfig(_Base):
    format: TextFormat = Field(default_factory=TextFormat)


#: OpenAI's temperature and top_p, and top_k / min_p as extensions; temperature keeps OpenAI's
#: bound of 2 (the sampler's own bounds are checked when the request is resolved)
ResponsesSampler = sampler_fields_model(
    "ResponsesSampler",
    _Base,
    ("temperature", "top_p", "top_k", "min_p"),
    wire_max={"temperature": 2},
)


class ResponsesRequest(ResponsesSampler):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    #: Structured output: ``{"format": {"type": "json_schema", "schema": ...}}``.
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    #: Accepted, but nothing is stored: the response always says ``"store": false``.
    store: bool | None = None
    #: Rejected with a 400: this server keeps no responses (send the whole conversation).
    previous_response_id: str | None = None
    #: Rejected with a 400 too: a stored conversation (an id, or ``{"id": ...}``) is not kept.
    conversation: str | dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    #: Extensions (not in OpenAI's schema).
    draft_tokens: DraftTokens = None
    chat_template_kwargs: dict[str, Any] | None = None


def template_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """``instructions`` + ``input`` -> the chat template's messages."""
    out: list[dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return [*out, {"role": "user", "content": req.input}]
    reasoning: str | None = None

    def assistant() -> dict[str, Any]:
        nonlocal reasoning
        if not (out and out[-1]["role"] == "assistant" and reasoning is None):
            out.append({"role": "assistant", "content": ""})
        if reasoning is not None:
            out[-1]["reasoning_content"] = reasoning
            reasoning = None
        return out[-1]

    for i, item in enumerate(req.input):
        where = f"input.{i}"
        if item.type == "message":
            if item.role == "assistant":
                turn = assistant()
                turn["content"] += join_text(item.content, f"{where}.content", _TEXT_PARTS)
                continue
            role = "system" if item.role == "developer" else item.role
            out.append(
                {"role": role, "content": join_text(item.content, f"{where}.content", _TEXT_PARTS)}
            )
        elif item.type == "function_call":
            args = parse_arguments(item.arguments, f"{where}.arguments")
            call = {"name": item.name, "arguments": args}
            assistant().setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": call}
            )
        elif item.type == "function_call_output":
            content = join_text(item.output, f"{where}.output", _TEXT_PARTS)
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": content})
        elif item.type == "reasoning":
            parts = item.content if item.content is not None else item.summary
            reasoning = "\n".join(p.text for p in parts)
        else:
            raise bad_request(f"input item type {item.type!r} is not supported", param=where)
    return out
