"""Request bodies of OpenAI's chat and text completions (pydantic v2).

Unknown fields are ignored (``extra="ignore"``) so clients that send newer OpenAI fields keep
working; known fields are type-checked here and range-checked where the range does not depend on
the model (vocabulary- and context-dependent checks happen in server/core/requests.py, with the
engine's numbers). The sampler fields come from the one definition in sampling/params.py
(server/core/sampler_schema.py); their bounds are checked when the request is resolved. Response
bodies are built as plain dicts in the OpenAI shapes by the adapters.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from server.core.extensions import DraftTokens
from server.core.requests import ReasoningEffort
from server.core.sampler_schema import sampler_fields_model


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class TextPart(_Base):
    type: Literal["text"] = "text"
    text: str


class OtherPart(_Base):
    """Any non-text content part (image_url, input_audio, ...): accepted by the schema so the
    route can answer with a clear 400 instead of a pydantic union error."""

    type: str


ContentPart = TextPart | OtherPart


class FunctionCall(_Base):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Base):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(_Base):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Base):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Base):
    name: str


class NamedToolChoice(_Base):
    type: Literal["function"] = "function"
    function: NamedFunction


class JSONSchemaFormat(_Base):
    name: str = Field("response", max_length=64)
    description: str | None = None
    #: ``schema`` shadows a BaseModel attribute, hence the alias
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    #: Accepted: every reply follows its schema whatever ``strict`` says.
    strict: bool | None = None


class ResponseFormat(_Base):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StreamOptions(_Base):
    include_usage: bool = False


StopField = Annotated[str | list[str] | None, Field(default=None)]


#: OpenAI bounds temperature to [0, 2]; the sampler's own bounds are checked when the request
#: is resolved (server.core.requests), like every other API's
OpenAISampler = sampler_fields_model("OpenAISampler", _Base, wire_max={"temperature": 2})


class SamplingFields(OpenAISampler):
    """Fields shared by chat and text completions (every sampler field of the definition)."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    logit_bias: dict[str, float] | None = None
    stop: StopField = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    draft_tokens: DraftTokens = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    #: OpenAI's deprecated function calling: refused when sent (``tools`` is served), never
    #: ignored, which would answer without the functions
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    #: false: a forced tool call (``tool_choice`` required or named) is exactly one call
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    #: none / minimal: thinking off; low and above: on (``chat_template_kwargs`` wins)
    reasoning_effort: ReasoningEffort | None = None
    #: Structured output: the reply follows a JSON schema (or is any JSON object).
    response_format: ResponseFormat | None = None
    #: Extension (vLLM-compatible): the final assistant message is the start of the reply,
    #: which the model continues (a prefill); ``add_generation_prompt`` false goes with it.
    continue_final_message: bool = False
    add_generation_prompt: bool | None = None
    #: Extension (vLLM-compatible): whether to split reasoning out of the content.
    include_reasoning: bool = True
    #: Extension (vLLM-compatible): the most tokens the reasoning takes before the server
    #: writes ``</think>`` in the model's place (where the reply starts inside a think block)
    thinking_token_budget: int | None = Field(None, ge=0)
    #: Extension, opt-in: each streamed chunk carries ``choices[i].mtp_trace`` with the K of
    #: its engine cycle and, per token, its text and whether it was an accepted MTP draft.
    mtp_trace: bool = False


PromptField = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: PromptField
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    #: 0 with ``echo``: the prompt alone, echoed (and scored, with ``logprobs``)
    max_tokens: int | None = Field(16, ge=0)
    #: text after the completion (fill-in-the-middle): refused when sent, never ignored
    suffix: str | None = None
    #: candidates drawn to return the n most likely: only n itself is served (each choice as
    #: drawn), never a silent n where more were asked for
    best_of: int | None = Field(None, ge=1)
