"""Anthropic Messages and OpenAI Responses — and what Chat Completions gained with them — against
the scripted FakeEngine over real uvicorn, driven by the official ``anthropic`` and ``openai``
SDKs unchanged (plus httpx for raw SSE and error bodies).

The scripted engine writes reasoning, text and Qwen XML tool calls on cue, so the mapping of the
core's output blocks onto each API's content blocks, output items and stream events is checked
exactly; tests/server/test_server_agent_real.py runs the same APIs against real checkpoints.
"""

from __future__ import annotations

import json
import time
from typing import Any

import anthropic
import httpx
import openai
import pytest
from fake_engine import FakeEngine, LiveServer

from server.app import create_app
from server.settings import ServerSettings

pytestmark = pytest.mark.fast  # the scripted fake engine answers at once: the whole file is quick

MODEL = "fake-model"
#: Anthropic's API thinks only when asked (the scripted engine writes reasoning either way)
CLAUDE_THINKING = {"type": "enabled", "budget_tokens": 1024}
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
ANTHROPIC_TOOLS = [
    {"name": "get_weather", "description": "Weather for a city", "input_schema": WEATHER_SCHEMA}
]
RESPONSES_TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": WEATHER_SCHEMA,
    }
]


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture(scope="module")
def server(engine: FakeEngine):
    with LiveServer(create_app(engine, ServerSettings(max_body_bytes=64 * 1024))) as srv:
        yield srv


def prompt_of(engine: FakeEngine) -> str:
    return engine.tokenizer.decode(engine.requests[-1].prompt_ids)


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


# ------------------------------------------------------------------------------------------
# Anthropic Messages
# ------------------------------------------------------------------------------------------
def test_messages_create_maps_thinking_text_and_tool_use(claude: anthropic.Anthropic) -> None:
    kw = dict(
        model=MODEL, messages=user("TRIGGER_TOOL"), tools=ANTHROPIC_TOOLS, thinking=CLAUDE_THINKING
    )
    m = claude.messages.create(max_tokens=1000, **kw)
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
    assert m.content[0].thinking == "I need the weather."
    assert m.content[1].text == "Let me check."
    assert m.content[2].name == "get_weather" and m.content[2].input == {"city": "Paris", "days": 3}
    assert m.stop_reason == "tool_use" and m.stop_sequence is None and m.role == "assistant"
    assert m.usage.input_tokens == claude.messages.count_tokens(**kw).input_tokens
    assert m.usage.output_tokens > 0 and m.usage.cache_read_input_tokens == 0


def test_messages_stream_events_in_documented_order(claude: anthropic.Anthropic) -> None:
    kw = dict(
        model=MODEL,
        max_tokens=1000,
        messages=user("TRIGGER_TOOL"),
        tools=ANTHROPIC_TOOLS,
        thinking=CLAUDE_THINKING,
    )
    events = list(claude.messages.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert events[0].message.usage.input_tokens > 0 and events[0].message.stop_reason is None
    open_index, blocks = None, []
    for event in events[1:-2]:  # each block: start, deltas of its kind, stop — in index order
        if event.type == "content_block_start":
            assert open_index is None and event.index == len(blocks)
            open_index = event.index
            blocks.append([event.content_block.type])
        elif event.type == "content_block_delta":
            assert event.index == open_index
            blocks[-1].append(event.delta.type)
        else:
            assert event.type == "content_block_stop" and event.index == open_index
            open_index = None
    assert [b[0] for b in blocks] == ["thinking", "text", "tool_use"]
    assert {d for b in blocks for d in b[1:]} == {
        "thinking_delta",
        "text_delta",
        "input_json_delta",
    }
    final = events[-2]
    assert final.delta.stop_reason == "tool_use" and final.usage.output_tokens > 0

    with claude.messages.stream(**kw) as stream:
        for _ in stream:
            pass
        message = stream.get_final_message()
    whole = claude.messages.create(**kw)
    assert [b.model_dump(exclude={"id"}) for b in message.content] == [
        b.model_dump(exclude={"id"}) for b in whole.content
    ]
    assert message.usage.output_tokens == whole.usage.output_tokens


def test_messages_tool_round_trip(claude: anthropic.Anthropic, engine: FakeEngine) -> None:
    first = claude.messages.create(
        model=MODEL, max_tokens=1000, messages=user("TRIGGER_TOOL"), tools=ANTHROPIC_TOOLS
    )
    call = first.content[-1]
    history = [
        *user("TRIGGER_TOOL"),
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "TRIGGER_PLAIN"}
            ],
        },
    ]
    answer = claude.messages.create(
        model=MODEL,
        max_tokens=100,
        system="Be brief.",
        messages=history,
        tools=ANTHROPIC_TOOLS,
        thinking={"type": "disabled"},
    )
    assert [b.type for b in answer.content] == ["text"]
    assert answer.content[0].text == "The answer is 42." and answer.stop_reason == "end_turn"
    prompt = prompt_of(engine)
    assert prompt.startswith("<|im_start|>system\n# Tools") and "Be brief." in prompt
    assert "<think>\nI need the weather.\n</think>\n\nLet me check." in prompt
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in prompt
    assert "<tool_response>\nTRIGGER_PLAIN\n</tool_response>" in prompt
    assert prompt.endswith("<think>\n\n</think>\n\n")  # thinking disabled


def test_messages_stop_sequences_limits_and_sampling(
    claude: anthropic.Anthropic, engine: FakeEngine
) -> None:
    m = claude.messages.create(
        model=MODEL,
        max_tokens=100,
        messages=user("TRIGGER_STOP"),
        stop_sequences=["STOP"],
        thinking={"type": "disabled"},
        metadata={"user_id": "u1"},
        extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 7},
    )
    assert m.content[0].text == "one two three "
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "STOP")
    s = engine.requests[-1].sampling
    assert (s.temperature, s.top_p, s.top_k) == (0.5, 0.9, 7)
    m = claude.messages.create(model=MODEL, max_tokens=3, messages=user("TRIGGER_PLAIN"))
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3
    s = engine.requests[-1].sampling  # nothing sent: generation_config's defaults
    assert (s.temperature, s.top_k, s.top_p) == (1.0, 20, 0.95)


def test_messages_continue_an_assistant_prefill(
    claude: anthropic.Anthropic, engine: FakeEngine, http: httpx.Client
) -> None:
    """A final assistant turn of text is the start of the reply (Anthropic's prefill): the
    prompt ends with it after the generation prompt, thinking closed, and the reply is what
    follows it; count_tokens counts the same prompt."""
    messages = [
        {"role": "user", "content": "TRIGGER_PLAIN What is the answer?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Well,"}]},
    ]
    m = claude.messages.create(model=MODEL, max_tokens=32, messages=messages)
    prompt = prompt_of(engine)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nWell,"), prompt
    assert prompt.count("<|im_start|>assistant") == 1
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == "The answer is 42."
    count = claude.messages.count_tokens(model=MODEL, messages=messages).input_tokens
    assert count == len(engine.requests[-1].prompt_ids)
    r = http.post(
        "/v1/messages",
        json={
            "model": MODEL,
            "max_tokens": 5,
            "messages": messages,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
        },
    )
    assert r.status_code == 400 and "prefill" in r.json()["error"]["message"], r.text


ANTHROPIC_BAD = [
    ("no max_tokens", {"model": MODEL, "messages": user("x")}, 400, "invalid_request_error"),
    ("unknown model", {"model": "claude-x", "max_tokens": 5, "messages": user("x")}, 404, None),
    (
        "image block",
        {
            "model": MODEL,
            "max_tokens": 5,
            "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
        },
        400,
        "messages.0.content.0",
    ),
    ("bad role", {"model": MODEL, "max_tokens": 5, "messages": [{"role": "x"}]}, 400, None),
    (
        "a block whose type is not a string",
        {
            "model": MODEL,
            "max_tokens": 5,
            "messages": [{"role": "user", "content": [{"type": ["text"], "text": "x"}]}],
        },
        400,
        "invalid_request_error",
    ),
    ("empty body", b"", 400, "invalid_request_error"),
]


@pytest.mark.parametrize("name,body,status,what", ANTHROPIC_BAD, ids=[b[0] for b in ANTHROPIC_BAD])
def test_messages_errors_in_anthropic_shape(
    http: httpx.Client, name: str, body: Any, status: int, what: str | None
) -> None:
    json_type = {"content-type": "application/json"}
    kw = {"content": body, "headers": json_type} if isinstance(body, bytes) else {"json": body}
    r = http.post("/v1/messages", **kw)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and set(err["error"]) == {"type", "message"}
    assert err["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert what is None or what in err["error"]["message"] or what == err["error"]["type"]


def test_messages_error_after_stream_start_is_an_error_event(
    claude: anthropic.Anthropic, http: httpx.Client
) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 300,
        "messages": user("TRIGGER_CRASH_LATER"),
        "stream": True,
    }
    with http.stream("POST", "/v1/messages", json=body) as r:
        raw = r.read().decode()
    frames = [f.split("\n") for f in raw.strip().split("\n\n")]
    assert frames[0][0] == "event: message_start" and frames[-1][0] == "event: error"
    assert json.loads(frames[-1][1][6:])["error"]["type"] == "api_error"
    with pytest.raises(anthropic.APIError):
        for _ in claude.messages.create(
            stream=True, **{k: v for k, v in body.items() if k != "stream"}
        ):
            pass


# ------------------------------------------------------------------------------------------
# OpenAI Responses
# ------------------------------------------------------------------------------------------
def test_responses_create_items_and_usage(client: openai.OpenAI, engine: FakeEngine) -> None:
    r = client.responses.create(model=MODEL, input="TRIGGER_TOOL", tools=RESPONSES_TOOLS)
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
    assert r.output[0].content[0].text == "I need the weather."
    assert r.output_text == "Let me check." and r.status == "completed"
    call = r.output[2]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 3}
    chat = client.chat.completions.create(
        model=MODEL,
        messages=user("TRIGGER_TOOL"),
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Weather for a city",
                    "parameters": WEATHER_SCHEMA,
                },
            }
        ],
    )
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    r = client.responses.create(
        model=MODEL, instructions="Be brief.", input="TRIGGER_PLAIN", reasoning={"effort": "none"}
    )
    assert r.output_text == "The answer is 42." and [o.type for o in r.output] == ["message"]
    assert prompt_of(engine).startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_responses_stream_events_in_documented_order(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(
            model=MODEL, input="TRIGGER_TOOL", tools=RESPONSES_TOOLS, stream=True
        )
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    body = types[2:-1]
    expected_items = []
    i = 0
    while i < len(body):  # per item: added, (part added), deltas, (done events), item done
        assert body[i] == "response.output_item.added"
        item = events[2 + i].item
        end = body.index("response.output_item.done", i)
        kinds = set(body[i + 1 : end])
        if item.type == "message":
            assert kinds == {
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
            }
        elif item.type == "reasoning":
            assert kinds == {
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
            }
        else:
            assert kinds == {
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
            }
        expected_items.append(item.type)
        i = end + 1
    assert expected_items == ["reasoning", "message", "function_call"]
    final = events[-1].response
    assert final.usage.output_tokens > 0 and [o.type for o in final.output] == expected_items


def test_responses_function_call_round_trip_with_stream(
    client: openai.OpenAI, engine: FakeEngine
) -> None:
    with client.responses.stream(model=MODEL, input="TRIGGER_TOOL", tools=RESPONSES_TOOLS) as s:
        for _ in s:
            pass
        first = s.get_final_response()
    call = first.output[-1]
    history = [
        {"role": "user", "content": "TRIGGER_TOOL"},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "TRIGGER_PLAIN"},
    ]
    with client.responses.stream(
        model=MODEL, input=history, tools=RESPONSES_TOOLS, reasoning={"effort": "none"}
    ) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        answer = s.get_final_response()
    assert "".join(deltas) == answer.output_text == "The answer is 42."
    prompt = prompt_of(engine)
    assert "<think>\nI need the weather.\n</think>\n\nLet me check." in prompt
    assert "<parameter=days>\n3\n</parameter>" in prompt
    assert "<tool_response>\nTRIGGER_PLAIN\n</tool_response>" in prompt


def test_responses_stateless_and_errors(client: openai.OpenAI, http: httpx.Client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_123")
    assert info.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="x", extra_body={"conversation": "conv_1"})
    assert info.value.body["param"] == "conversation"
    r = client.responses.create(model=MODEL, input="TRIGGER_PLAIN", store=True, max_output_tokens=2)
    assert r.store is False and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    for body, param in [
        ({"model": MODEL}, "input"),
        ({"model": MODEL, "input": [{"type": "item_reference", "id": "x"}]}, "input.0"),
        (
            {"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input.0.content.0",
        ),
        ({"model": MODEL, "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": MODEL, "input": [{"type": {"a": 1}, "role": "user"}]}, "input.0.type"),
    ]:
        r = http.post("/v1/responses", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ------------------------------------------------------------------------------------------
# one conversation, four APIs: greedy outputs agree
# ------------------------------------------------------------------------------------------
def test_greedy_output_equal_across_apis(
    client: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    system, question = "You are terse.", "random words please"
    chat = (
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": system}, *user(question)],
            temperature=0,
            max_tokens=12,
        )
        .choices[0]
        .message
    )
    message = claude.messages.create(
        model=MODEL,
        system=system,
        messages=user(question),
        max_tokens=12,
        thinking=CLAUDE_THINKING,
        extra_body={"temperature": 0},
    )
    response = client.responses.create(
        model=MODEL, instructions=system, input=question, temperature=0, max_output_tokens=12
    )
    reasoning = chat.model_extra.get("reasoning_content")
    assert reasoning and message.content[0].thinking == reasoning
    assert response.output[0].content[0].text == reasoning


# ------------------------------------------------------------------------------------------
# chat completions: refusal, usage details, include_usage
# ------------------------------------------------------------------------------------------
def test_chat_refusal_usage_details_and_usage_chunk(http: httpx.Client, engine: FakeEngine) -> None:
    body = {"model": MODEL, "messages": user("TRIGGER_PLAIN"), "max_tokens": 20}
    engine.cached_tokens = 5
    try:
        r = http.post("/v1/chat/completions", json=body).json()
        with http.stream(
            "POST",
            "/v1/chat/completions",
            json=body | {"stream": True, "stream_options": {"include_usage": True}},
        ) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    finally:
        engine.cached_tokens = 0
    message = r["choices"][0]["message"]
    assert "refusal" in message and message["refusal"] is None
    assert r["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 5
    }


# ------------------------------------------------------------------------------------------
# a server with other settings: template default, fast pings, an API key
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def configured():
    engine = FakeEngine(cycle_delay=0.03)
    settings = ServerSettings(
        api_key="sekrit", chat_template_kwargs={"enable_thinking": False}, sse_ping_seconds=0.02
    )
    with LiveServer(create_app(engine, settings)) as srv:
        srv.engine = engine
        yield srv


def keyed_stream(srv: LiveServer, path: str, body: dict, bearer: bool = False) -> Any:
    """A streamed POST with the API key, as ``x-api-key`` or as a Bearer token."""
    headers = {"Authorization": "Bearer sekrit"} if bearer else {"x-api-key": "sekrit"}
    return httpx.stream("POST", srv.url + path, json=body, headers=headers, timeout=30)


def test_server_template_default_and_request_override(configured: LiveServer) -> None:
    sdk = openai.OpenAI(base_url=configured.url + "/v1", api_key="sekrit", max_retries=0)
    r = sdk.chat.completions.create(model=MODEL, messages=user("TRIGGER_PLAIN"))
    assert r.choices[0].message.content == "The answer is 42."
    assert prompt_of(configured.engine).endswith("<think>\n\n</think>\n\n")
    sdk.chat.completions.create(
        model=MODEL,
        messages=user("TRIGGER_PLAIN"),
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    assert prompt_of(configured.engine).endswith("<think>\n")


def test_x_api_key_and_pings_while_generating(configured: LiveServer) -> None:
    claude = anthropic.Anthropic(base_url=configured.url, api_key="sekrit", max_retries=0)
    assert claude.messages.create(model=MODEL, max_tokens=50, messages=user("TRIGGER_PLAIN"))
    with pytest.raises(anthropic.AuthenticationError) as info:
        anthropic.Anthropic(base_url=configured.url, api_key="nope", max_retries=0).messages.create(
            model=MODEL, max_tokens=5, messages=user("x")
        )
    assert info.value.body["error"]["type"] == "authentication_error"
    body = {"model": MODEL, "max_tokens": 50, "messages": user("TRIGGER_PLAIN"), "stream": True}
    with keyed_stream(configured, "/v1/messages", body) as r:
        raw = r.read().decode()
    assert raw.count('event: ping\ndata: {"type":"ping"}') > 1  # the first, then keep-alives
    sdk = openai.OpenAI(base_url=configured.url + "/v1", api_key="sekrit", max_retries=0)
    chat_body = {"model": MODEL, "messages": user("TRIGGER_PLAIN"), "stream": True}
    with keyed_stream(configured, "/v1/chat/completions", chat_body, bearer=True) as r:
        assert ": ping" in r.read().decode()  # comment lines: ignored by SSE clients
    text = "".join(
        c.choices[0].delta.content or ""
        for c in sdk.chat.completions.create(
            model=MODEL, messages=user("TRIGGER_PLAIN"), stream=True
        )
        if c.choices
    )
    assert text == "The answer is 42."


def test_messages_stream_disconnect_cancels(configured: LiveServer) -> None:
    engine = configured.engine
    before = len(engine.cancel_seen)
    body = {"model": MODEL, "max_tokens": 3000, "messages": user("go"), "stream": True}
    with keyed_stream(configured, "/v1/messages", body) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n > 10:
                break
    deadline = time.monotonic() + 10
    while len(engine.cancel_seen) == before:
        assert time.monotonic() < deadline, "generation was not cancelled"
        time.sleep(0.01)
    assert engine.cancel_seen[-1] < 3000


# ------------------------------------------------------------------------------------------
# structured output: each API's format field reaches the engine as one grammar
# ------------------------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
FORMATS = {
    "/v1/chat/completions": (
        {"messages": user("TRIGGER_PLAIN")},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "v", "schema": SCHEMA},
            }
        },
    ),
    "/v1/responses": (
        {"input": "TRIGGER_PLAIN"},
        {"text": {"format": {"type": "json_schema", "name": "v", "schema": SCHEMA}}},
    ),
    "/v1/messages": (
        {"messages": user("TRIGGER_PLAIN"), "max_tokens": 8},
        {"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}},
    ),
}


#: per API: the request fields that turn thinking on, and off
THINKING = {
    "/v1/chat/completions": (
        {"chat_template_kwargs": {"enable_thinking": True}},
        {"chat_template_kwargs": {"enable_thinking": False}},
    ),
    "/v1/responses": ({"reasoning": {"effort": "low"}}, {"reasoning": {"effort": "none"}}),
    "/v1/messages": (
        {"thinking": {"type": "enabled", "budget_tokens": 1024}},
        {"thinking": {"type": "disabled"}},
    ),
}


@pytest.mark.parametrize("path", list(FORMATS))
def test_a_format_reaches_the_engine_as_its_schemas_grammar(
    http: httpx.Client, engine: FakeEngine, path: str
) -> None:
    """Thinking off: the grammar is the schema's from the reply's first token. Thinking on: the
    reasoning is free text and the schema's grammar starts after ``</think>``."""
    from sampling.constraint import json_schema_grammar

    body, fmt = FORMATS[path]
    think_end = engine.tokenizer.get_vocab()["</think>"]
    for thinking, end in zip(THINKING[path], (think_end, None), strict=True):
        r = http.post(path, json={"model": MODEL} | body | fmt | thinking)
        assert r.status_code == 200, r.text
        assert engine.requests[-1].grammar == json_schema_grammar(SCHEMA, reasoning_end=end)
        opens = prompt_of(engine).endswith("<think>\n")
        assert opens == (end is not None), prompt_of(engine)[-40:]
        if path == "/v1/responses":
            assert r.json()["text"]["format"] == fmt["text"]["format"]
    r = http.post(path, json={"model": MODEL} | body)
    assert r.status_code == 200 and engine.requests[-1].grammar is None


def test_messages_take_the_structured_outputs_betas_output_format(
    http: httpx.Client, engine: FakeEngine
) -> None:
    """Older anthropic SDKs send the beta's top-level ``output_format``: the same grammar."""
    from sampling.constraint import json_schema_grammar

    body = {"model": MODEL, "max_tokens": 8, "messages": user("TRIGGER_PLAIN")}
    body |= {
        "output_format": {"type": "json_schema", "schema": SCHEMA},
        "thinking": {"type": "disabled"},
    }
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    assert engine.requests[-1].grammar == json_schema_grammar(SCHEMA)


FORMAT_BAD = [
    (
        "/v1/messages",
        {"output_format": {"type": "json_schema", "schema": {"type": "foo"}}},
        "output_format.schema",
    ),
    # (path, extra body fields, param the 400 names; Anthropic: a word of the message)
    (
        "/v1/chat/completions",
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}},
        "response_format.json_schema.schema",
    ),
    (
        "/v1/chat/completions",
        {"response_format": {"type": "json_schema"}},
        "response_format.json_schema",
    ),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type"),
    (
        "/v1/responses",
        {"text": {"format": {"type": "json_schema", "name": "v", "schema": {"not": {}}}}},
        "text.format.schema",
    ),
    (
        "/v1/messages",
        {"output_config": {"format": {"type": "json_schema", "schema": {"type": "foo"}}}},
        "foo",
    ),
]


@pytest.mark.parametrize("path,fields,what", FORMAT_BAD)
def test_a_format_that_cannot_be_enforced_is_a_400(
    http: httpx.Client, path: str, fields: dict[str, Any], what: str
) -> None:
    body = {"model": MODEL} | FORMATS[path][0] | fields
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    if path == "/v1/messages":
        assert r.json()["type"] == "error" and what in r.json()["error"]["message"], r.text
    else:
        assert r.json()["error"]["param"] == what, r.text


PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
#: per API: a tool list with get_weather, tool_choice "required" one call only, and "auto"
FORCED = {
    "/v1/chat/completions": (
        {
            "tools": [
                {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}
            ]
        },
        {"tool_choice": "required", "parallel_tool_calls": False},
        {"tool_choice": "auto"},
    ),
    "/v1/responses": (
        {"tools": [{"type": "function", "name": "get_weather", "parameters": PARAMS}]},
        {"tool_choice": "required", "parallel_tool_calls": False},
        {"tool_choice": "auto"},
    ),
    "/v1/messages": (
        {"tools": [{"name": "get_weather", "input_schema": PARAMS}]},
        {"tool_choice": {"type": "any", "disable_parallel_tool_use": True}},
        {"tool_choice": {"type": "auto"}},
    ),
}


@pytest.mark.parametrize("path", list(FORCED))
def test_a_required_tool_call_reaches_the_engine_as_a_grammar(
    http: httpx.Client, engine: FakeEngine, path: str
) -> None:
    """``tool_choice`` required (Anthropic: ``any``) with parallel calls off: the engine gets
    the grammar of exactly one call of the tools shown; with ``auto`` no grammar."""
    from sampling.constraint import tool_call_grammar

    tools, forced, auto = FORCED[path]
    body = {"model": MODEL} | FORMATS[path][0] | tools | THINKING[path][1]
    vocab = engine.tokenizer.get_vocab()
    expected = tool_call_grammar(
        [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}],
        (vocab["<tool_call>"], vocab["</tool_call>"]),
        parallel=False,
    )
    r = http.post(path, json=body | forced)
    assert r.status_code == 200, r.text
    assert engine.requests[-1].grammar == expected
    r = http.post(path, json=body | auto)
    assert r.status_code == 200 and engine.requests[-1].grammar is None


@pytest.mark.parametrize("path", list(FORCED))
def test_tools_beside_an_output_format_reach_the_engine_as_calls_or_the_json(
    http: httpx.Client, engine: FakeEngine, path: str
) -> None:
    """An output format with tools shown (an agent with an output type): ``auto`` gives the
    engine the grammar of the tools' calls or the schema's JSON; a forced call the calls'
    alone (the format is for the answer that follows the tools' results); no tools shown
    (``none``) the schema's alone."""
    from sampling.constraint import json_schema_grammar, tool_call_grammar

    tools, forced, auto = FORCED[path]
    body = {"model": MODEL} | FORMATS[path][0] | FORMATS[path][1] | tools | THINKING[path][1]
    shown = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]
    vocab = engine.tokenizer.get_vocab()
    ids = (vocab["<tool_call>"], vocab["</tool_call>"])
    r = http.post(path, json=body | auto)
    assert r.status_code == 200, r.text
    assert engine.requests[-1].grammar == tool_call_grammar(shown, ids, answer_schema=SCHEMA)
    r = http.post(path, json=body | forced)
    assert r.status_code == 200, r.text
    assert engine.requests[-1].grammar == tool_call_grammar(shown, ids, parallel=False)
    none = {"type": "none"} if path == "/v1/messages" else "none"
    r = http.post(path, json=body | {"tool_choice": none})
    assert r.status_code == 200, r.text
    assert engine.requests[-1].grammar == json_schema_grammar(SCHEMA)


def test_a_thinking_budget_reaches_the_engine_where_the_reply_reasons(
    http: httpx.Client, engine: FakeEngine
) -> None:
    """Anthropic's ``budget_tokens`` (and Chat Completions' ``thinking_token_budget``, vLLM's
    field) becomes the request's reasoning budget with the id of ``</think>`` when thinking is
    on; thinking off (the prompt closes the block itself) carries none; a budget below 1 (below
    0) is a 400."""
    chat = {"model": MODEL, "max_tokens": 8, "messages": user("TRIGGER_PLAIN")}
    think = {"chat_template_kwargs": {"enable_thinking": True}}
    r = http.post("/v1/chat/completions", json=chat | think | {"thinking_token_budget": 0})
    assert r.status_code == 200, r.text
    assert engine.requests[-1].reasoning_budget == 0
    no_think = {"chat_template_kwargs": {"enable_thinking": False}}
    r = http.post("/v1/chat/completions", json=chat | no_think | {"thinking_token_budget": 3})
    assert r.status_code == 200 and engine.requests[-1].reasoning_budget is None
    r = http.post("/v1/chat/completions", json=chat | {"thinking_token_budget": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget"
    body = {"model": MODEL, "max_tokens": 8, "messages": user("TRIGGER_PLAIN")}
    r = http.post("/v1/messages", json=body | {"thinking": {"type": "enabled", "budget_tokens": 5}})
    assert r.status_code == 200, r.text
    req = engine.requests[-1]
    assert req.reasoning_budget == 5
    assert req.reasoning_end == engine.tokenizer.get_vocab()["</think>"]
    r = http.post("/v1/messages", json=body | {"thinking": {"type": "disabled"}})
    assert r.status_code == 200 and engine.requests[-1].reasoning_budget is None
    r = http.post("/v1/messages", json=body | {"thinking": {"type": "enabled", "budget_tokens": 0}})
    assert r.status_code == 400 and "budget_tokens" in r.text, r.text
