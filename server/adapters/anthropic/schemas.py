"""Request bodies of Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``).

Unknown fields are ignored, as for the OpenAI bodies. Content blocks this text model cannot read
(images, documents, server tools' results) are accepted by the schema with their ``type`` so the
adapter answers with a clear 400 naming the block, not a pydantic union error.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from server.core.extensions import DraftTokens
from server.core.sampler_schema import sampler_fields_model
from server.core.tagged import by_type


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Base):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(_Base):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Base):
    type: Literal["redacted_thinking"] = "redacted_thinking"
    data: str = ""


class ToolUseBlock(_Base):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class OtherBlock(_Base):
    type: str


class ToolResultBlock(_Base):
    type: Literal["tool_result"] = "tool_result"
    tool_use_id: str
    content: str | list[by_type({"text": TextBlock}, OtherBlock)] | None = None
    is_error: bool | None = None


ContentBlock = by_type(
    {
        "text": TextBlock,
        "thinking": ThinkingBlock,
        "redacted_thinking": RedactedThinkingBlock,
        "tool_use": ToolUseBlock,
        "tool_result": ToolResultBlock,
    },
    OtherBlock,
)


class Message(_Base):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(_Base):
    #: absent or "custom" for client tools; server tools (web search, ...) are not supported
    type: str | None = None
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class ToolChoice(_Base):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Base):
    type: Literal["enabled", "disabled", "adaptive"]
    #: the most tokens the reasoning takes before the server closes it (``enabled`` only)
    budget_tokens: int | None = Field(default=None, ge=1)


class JSONOutputFormat(_Base):
    type: Literal["json_schema"]
    #: ``schema`` shadows a BaseModel attribute, hence the alias
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Base):
    #: Structured output: the reply's text is JSON valid under this schema.
    format: JSONOutputFormat | None = None
    #: Accepted and ignored (the model has no effort setting).
    effort: str | None = None


class CountTokensRequest(_Base):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    #: The structured-outputs beta's name for ``output_config.format`` (older SDKs send it).
    output_format: JSONOutputFormat | None = None


#: Not arguments of the current anthropic SDK; clients may send them as extra body fields.
MessagesSampler = sampler_fields_model(
    "MessagesSampler", CountTokensRequest, ("temperature", "top_p", "top_k")
)


class MessagesRequest(MessagesSampler):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    metadata: dict[str, Any] | None = None
    stream: bool = False
    draft_tokens: DraftTokens = None
