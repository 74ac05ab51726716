"""What the official ``openai`` and ``anthropic`` SDKs (and the libraries built on them) rely on,
against a real server on the embedded demo model (models/qwen3.5-demo), greedy.

Each test holds one behaviour an agent or structured-output client reads without checking:
a named tool is called once; a tool call cut at the token limit is never shown as a finished
one and never carries template markup; Anthropic's API does not think unless asked; Chat
Completions' ``reasoning_effort`` turns thinking off; a JSON schema's object takes its own keys
only; Responses usage and cut items have the shape and status OpenAI's SDK and OpenAPI document
require; Anthropic's ``message_start`` usage is the real cache split; a reply ending in a
newline keeps it, chat logprobs line up with ``content``; ``temperature`` keeps OpenAI's bound.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import anthropic
import httpx
import jsonschema_rs
import openai
import pydantic
import pytest
from fake_engine import LiveServer
from openai.types.responses import Response, ResponseStreamEvent
from openai_spec import schema

from server.app import create_app
from server.settings import ServerSettings

DEMO = Path(__file__).resolve().parents[2] / "models" / "qwen3.5-demo"
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
}
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "answer", "description": "Answer", "parameters": ANSWER_SCHEMA},
    }
]
CLAUDE_TOOLS = [{"name": "answer", "description": "Answer", "input_schema": ANSWER_SCHEMA}]
RESPONSES_TOOLS = [{"type": "function", **CHAT_TOOLS[0]["function"]}]
QUESTION = [{"role": "user", "content": "Is the sky blue?"}]
NAMED = {"type": "function", "function": {"name": "answer"}}
GREEDY = {"temperature": 0}
NO_THINKING = {"enable_thinking": False}
#: template markup that must never reach a value
MARKUP = ("<parameter", "</parameter", "<function", "</function", "<tool_call", "</tool_call")


#: a question the demo model thinks about before answering (most it answers at once)
PONDERED = [{"role": "user", "content": "What is a list?"}]


def load_demo() -> Any:
    from engine.runtime import Engine

    engine = Engine.load(str(DEMO), draft_tokens=2)
    engine.enable_prefix_cache(64 << 20)  # as `mtpserve serve` does
    return engine


@pytest.fixture(scope="module")
def server():
    app = create_app(load_demo, ServerSettings(model=str(DEMO)))
    with LiveServer(app) as srv:
        srv.model = app.state.mtp.names[0]
        yield srv


def sse(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON data of every event of a stream, ``[DONE]`` left out."""
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        raw = r.read().decode()
    out = []
    for frame in raw.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in frame.split("\n") if not line.startswith(":"))
        if fields.get("data") and fields["data"] != "[DONE]":
            out.append(json.loads(fields["data"]))
    return out


def spec_errors(name: str, body: Any) -> list[str]:
    """Where ``body`` breaks the schema of OpenAI component ``name`` (tests/openai_spec.py)."""
    validator = jsonschema_rs.validator_for(schema(name))
    return [f"{list(e.instance_path)}: {e.message}" for e in validator.iter_errors(body)]


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"duplicate keys {keys}"
    return dict(pairs)


# ------------------------------------------------------------------------------------------
# 1. a named (forced) tool is called once
# ------------------------------------------------------------------------------------------
class Answer(pydantic.BaseModel):
    answer: Literal["yes", "no"]


def test_a_named_tool_is_called_once(
    client: openai.OpenAI, claude: anthropic.Anthropic, server: LiveServer
) -> None:
    kw: dict[str, Any] = dict(model=server.model, messages=QUESTION, max_tokens=150, **GREEDY)
    r = client.chat.completions.create(tools=CHAT_TOOLS, tool_choice=NAMED, **kw)
    assert r.choices[0].finish_reason == "tool_calls"
    [call] = r.choices[0].message.tool_calls
    assert json.loads(call.function.arguments)["answer"] in ("yes", "no")

    # openai's `parse` with a strict pydantic tool, as instructor's TOOLS mode sends it
    parsed = client.chat.completions.parse(
        tools=[openai.pydantic_function_tool(Answer)],
        tool_choice={"type": "function", "function": {"name": "Answer"}},
        **kw,
    )
    [call] = parsed.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Answer)

    # `required` with parallel_tool_calls false: exactly one call as well
    r = client.chat.completions.create(
        tools=CHAT_TOOLS, tool_choice="required", parallel_tool_calls=False, **kw
    )
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1

    m = claude.messages.create(
        model=server.model,
        messages=QUESTION,
        max_tokens=150,
        tools=CLAUDE_TOOLS,
        tool_choice={"type": "tool", "name": "answer"},
        extra_body=GREEDY,
    )
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]

    resp = client.responses.create(
        model=server.model,
        input="Is the sky blue?",
        tools=RESPONSES_TOOLS,
        tool_choice={"type": "function", "name": "answer"},
        max_output_tokens=150,
        **GREEDY,
    )
    assert resp.status == "completed"
    assert [item.type for item in resp.output if item.type != "reasoning"] == ["function_call"]


# ------------------------------------------------------------------------------------------
# 2. a tool call cut at the token limit
# ------------------------------------------------------------------------------------------
def test_a_cut_tool_call_is_never_a_finished_one(
    client: openai.OpenAI, claude: anthropic.Anthropic, server: LiveServer, http: httpx.Client
) -> None:
    # one call only (the named function and parallel calls off): the cut is all that is tested
    kw: dict[str, Any] = dict(
        model=server.model, messages=QUESTION, parallel_tool_calls=False, **GREEDY
    )
    whole = client.chat.completions.create(
        tools=CHAT_TOOLS, tool_choice=NAMED, max_tokens=150, **kw
    )
    length = whole.usage.completion_tokens
    assert whole.choices[0].finish_reason == "tool_calls"
    # every cut point through the end of the call (its last token is the EOS token): its
    # closing tags and the tokens before them
    for max_tokens in range(length - 8, length - 1):
        r = client.chat.completions.create(
            tools=CHAT_TOOLS, tool_choice=NAMED, max_tokens=max_tokens, **kw
        )
        choice = r.choices[0]
        assert choice.finish_reason == "length"
        assert not any(tag in (choice.message.content or "") for tag in MARKUP), choice
        for call in choice.message.tool_calls or []:
            assert not any(tag in call.function.arguments for tag in MARKUP), call
            with pytest.raises(json.JSONDecodeError):  # a prefix of an object, never a whole
                json.loads(call.function.arguments)

        body = {
            "model": server.model,
            "input": "Is the sky blue?",
            "tools": RESPONSES_TOOLS,
            "tool_choice": {"type": "function", "name": "answer"},
            "parallel_tool_calls": False,
            "max_output_tokens": max_tokens,
        } | GREEDY
        resp = http.post("/v1/responses", json=body).json()
        assert resp["status"] == "incomplete"
        assert resp["output"][-1]["status"] == "incomplete", resp["output"]
        assert all(item["status"] == "completed" for item in resp["output"][:-1])

    claude_kw: dict[str, Any] = dict(
        model=server.model,
        messages=QUESTION,
        tools=CLAUDE_TOOLS,
        tool_choice={"type": "tool", "name": "answer", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    )
    whole_claude = claude.messages.create(max_tokens=150, **claude_kw)
    claude_length = whole_claude.usage.output_tokens
    for max_tokens in range(claude_length - 8, claude_length - 1):
        m = claude.messages.create(max_tokens=max_tokens, **claude_kw)
        assert m.stop_reason == "max_tokens"
        assert [b for b in m.content if b.type == "tool_use"] == []
        with claude.messages.stream(max_tokens=max_tokens, **claude_kw) as stream:
            for _ in stream:
                pass
            final = stream.get_final_message()
        assert final.stop_reason == "max_tokens"
        for block in final.content:  # the part that was written, as Anthropic streams it
            assert block.type != "tool_use" or block.input in ({}, {"answer": "no"}), block
            assert block.type != "tool_use" or not any(t in str(block.input) for t in MARKUP)

    # `required` with parallel calls allowed: the demo model goes on calling; a call the
    # limit cuts is the last one and the only one that does not parse
    cut_calls = 0
    for max_tokens in range(length, length + 12):
        r = client.chat.completions.create(
            tools=CHAT_TOOLS,
            tool_choice="required",
            max_tokens=max_tokens,
            **(kw | {"parallel_tool_calls": True}),
        )
        assert r.choices[0].finish_reason == "length"
        *finished, last = r.choices[0].message.tool_calls
        assert all(json.loads(c.function.arguments)["answer"] in ("yes", "no") for c in finished)
        try:
            assert json.loads(last.function.arguments)["answer"] in ("yes", "no")
        except json.JSONDecodeError:
            cut_calls += 1
    assert cut_calls


def test_a_cut_call_sent_back_reads_as_its_closed_parameters(
    http: httpx.Client, server: LiveServer
) -> None:
    """Agent loops (openai-agents) send a cut call back with the tool's error: its arguments,
    an unclosed object, read as the parameters that were closed; other text is still a 400."""

    def resend(arguments: str) -> httpx.Response:
        call = {"id": "call_1", "type": "function"}
        call["function"] = {"name": "answer", "arguments": arguments}
        messages = [
            *QUESTION,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Invalid JSON input"},
        ]
        body = {"model": server.model, "messages": messages, "tools": CHAT_TOOLS}
        return http.post("/v1/chat/completions", json=body | {"max_tokens": 2})

    assert resend('{"answer": "no"').status_code == 200
    assert resend("{").status_code == 200
    refused = resend("answer: no")
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "messages.1.tool_calls.0.function.arguments"


# ------------------------------------------------------------------------------------------
# 3. / 4. thinking: off on Anthropic's API unless asked; Chat Completions' reasoning_effort
# ------------------------------------------------------------------------------------------
def test_messages_think_only_when_asked(claude: anthropic.Anthropic, server: LiveServer) -> None:
    kw: dict[str, Any] = dict(
        model=server.model, messages=PONDERED, max_tokens=24, extra_body=GREEDY
    )
    plain = claude.messages.create(**kw)
    assert [b.type for b in plain.content] == ["text"] and plain.content[0].text
    thinking = claude.messages.create(thinking={"type": "enabled", "budget_tokens": 1024}, **kw)
    assert thinking.content[0].type == "thinking"
    assert (
        claude.messages.count_tokens(model=server.model, messages=kw["messages"]).input_tokens
        == plain.usage.input_tokens + plain.usage.cache_read_input_tokens
    )


def test_chat_reasoning_effort_turns_thinking_off(
    client: openai.OpenAI, server: LiveServer
) -> None:
    kw: dict[str, Any] = dict(model=server.model, messages=PONDERED, max_tokens=24, **GREEDY)
    default = client.chat.completions.create(**kw)
    assert default.usage.completion_tokens_details.reasoning_tokens > 0
    for effort in ("none", "minimal"):
        r = client.chat.completions.create(reasoning_effort=effort, **kw)
        assert r.usage.completion_tokens_details.reasoning_tokens == 0, effort
        assert not (r.choices[0].message.model_extra or {}).get("reasoning_content")
        assert r.choices[0].message.content
    high = client.chat.completions.create(reasoning_effort="high", **kw)
    assert high.usage.completion_tokens_details.reasoning_tokens > 0
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(extra_body={"reasoning_effort": "extreme"}, **kw)
    assert err.value.body["param"] == "reasoning_effort"


# ------------------------------------------------------------------------------------------
# 5. a JSON schema's object takes its own keys only
# ------------------------------------------------------------------------------------------
class Verdict(pydantic.BaseModel):
    answer: Literal["yes", "no"]
    sure: bool


def test_a_schema_without_additional_properties_takes_its_keys_only(
    client: openai.OpenAI, server: LiveServer, http: httpx.Client
) -> None:
    messages = [{"role": "user", "content": "Is the sky blue? Answer in JSON."}]
    # pydantic's schema, as instructor JSON_SCHEMA mode and `llm --schema` send it: no
    # additionalProperties, not strict
    body = {
        "model": server.model,
        "messages": messages,
        "max_tokens": 120,
        "chat_template_kwargs": NO_THINKING,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "Verdict", "schema": Verdict.model_json_schema()},
        },
    } | GREEDY
    r = http.post("/v1/chat/completions", json=body).json()
    assert r["choices"][0]["finish_reason"] == "stop", r
    content = r["choices"][0]["message"]["content"]
    value = json.loads(content, object_pairs_hook=no_duplicate_keys)
    assert set(value) == {"answer", "sure"}
    Verdict.model_validate(value)

    parsed = client.chat.completions.parse(
        model=server.model,
        messages=messages,
        max_tokens=120,
        response_format=Verdict,
        extra_body={"chat_template_kwargs": NO_THINKING},
        **GREEDY,
    )
    assert isinstance(parsed.choices[0].message.parsed, Verdict)


# ------------------------------------------------------------------------------------------
# 6. Responses: usage shape, a cut item's status, the response.incomplete event
# ------------------------------------------------------------------------------------------
def test_responses_usage_and_incomplete_items_validate(
    http: httpx.Client, server: LiveServer
) -> None:
    body = {"model": server.model, "input": "def fibonacci(n):", "max_output_tokens": 12} | GREEDY
    raw = http.post("/v1/responses", json=body).json()
    # openai-python's own model, validated (the SDK itself only constructs it)
    response = Response.model_validate(raw, strict=True)
    assert response.status == "incomplete" and response.output[-1].status == "incomplete"
    assert response.usage.input_tokens_details.cache_write_tokens == 0
    assert not spec_errors("Response", raw)

    events = sse(http, "/v1/responses", body | {"stream": True})
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    for event in events:
        adapter.validate_python(event, strict=True)
        assert not spec_errors(event["type"], event), event
    assert events[-1]["type"] == "response.incomplete"
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done[-1]["status"] == "incomplete" == events[-1]["response"]["output"][-1]["status"]


# ------------------------------------------------------------------------------------------
# 7. Anthropic's message_start usage is the cache split message_delta reports
# ------------------------------------------------------------------------------------------
def test_message_start_usage_is_the_cache_split(
    claude: anthropic.Anthropic, server: LiveServer
) -> None:
    kw: dict[str, Any] = dict(
        model=server.model,
        messages=[{"role": "user", "content": "Write a python function for the cache split."}],
        max_tokens=8,
        extra_body=GREEDY,
    )
    for _ in range(2):  # the second turn reads the first's prompt from the cache
        events = list(claude.messages.create(stream=True, **kw))
        start, delta = events[0].message.usage, events[-2].usage
        assert events[0].type == "message_start" and events[-2].type == "message_delta"
        assert (start.input_tokens, start.cache_read_input_tokens) == (
            delta.input_tokens,
            delta.cache_read_input_tokens,
        )
    assert delta.cache_read_input_tokens > 0


# ------------------------------------------------------------------------------------------
# 8. trailing newline, logprobs of the content only, temperature's bound
# ------------------------------------------------------------------------------------------
def test_chat_logprobs_are_the_contents(client: openai.OpenAI, server: LiveServer) -> None:
    kw: dict[str, Any] = dict(model=server.model, messages=PONDERED, logprobs=True, **GREEDY)
    # thinking on: the reasoning, </think> and the newlines after it have no place in them
    r = client.chat.completions.create(max_tokens=120, **kw)
    choice = r.choices[0]
    assert (choice.message.model_extra or {}).get("reasoning_content") and choice.message.content
    assert "".join(t.token for t in choice.logprobs.content) == choice.message.content
    streamed = client.chat.completions.create(max_tokens=120, stream=True, **kw)
    chunks = [c.choices[0] for c in streamed if c.choices]
    tokens = [t.token for c in chunks if c.logprobs for t in c.logprobs.content]
    assert "".join(tokens) == choice.message.content


def test_content_keeps_its_last_newline(client: openai.OpenAI, server: LiveServer) -> None:
    kw: dict[str, Any] = dict(
        model=server.model,
        messages=[{"role": "user", "content": "def fibonacci(n):"}],
        logprobs=True,
        extra_body={"chat_template_kwargs": NO_THINKING},
        **GREEDY,
    )
    off = client.chat.completions.create(max_tokens=60, **kw)
    texts = [t.token for t in off.choices[0].logprobs.content]
    # cut right after a token that ends in a newline (thinking off: the reply is content from
    # its first token): the content ends with that newline
    cut = next(i for i, t in enumerate(texts) if t.endswith("\n") and "".join(texts[:i]).strip())
    expected = "".join(texts[: cut + 1])
    r = client.chat.completions.create(max_tokens=cut + 1, **kw)
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content == expected and expected.endswith("\n")
    streamed = client.chat.completions.create(max_tokens=cut + 1, stream=True, **kw)
    chunks = [c.choices[0] for c in streamed if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == expected


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", {"messages": QUESTION}),
        ("/v1/completions", {"prompt": "def"}),
        ("/v1/responses", {"input": "hi"}),
    ],
)
def test_temperature_above_two_is_a_400(
    http: httpx.Client, server: LiveServer, path: str, body: dict[str, Any]
) -> None:
    r = http.post(path, json={"model": server.model, "temperature": 2.5, "max_tokens": 2} | body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "temperature"
    ok = http.post(path, json={"model": server.model, "temperature": 2, "max_tokens": 2} | body)
    assert ok.status_code == 200
