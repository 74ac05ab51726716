"""Anthropic Messages and OpenAI Responses with the real engine, through the official SDKs.

Two checkpoints, one live uvicorn server each: the embedded demo model (models/qwen3.5-demo) and a
tiny random test checkpoint. For the same conversation — plain, and one holding a finished tool
round (the assistant's tool call and the tool's result; the tool list itself is left out, as
its ~300-token system block only slows these CPU runs down) — greedy output through
``messages.create`` / ``messages.stream`` and ``responses.create`` / ``responses.stream`` equals
``/v1/chat/completions``' token for token (reasoning, text and any parsed tool call alike), the
token counts agree (``count_tokens`` included), and the SDKs parse every streamed event in order
with usage at the end. Neither model writes tool calls on purpose; that a tool call the model
writes comes back as ``tool_use`` / ``function_call`` is covered with the scripted engine in
tests/server/test_server_agent_apis.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import anthropic
import openai
import pydantic
import pytest
from fake_engine import LiveServer

from server.app import create_app
from server.settings import ServerSettings

DEMO = Path(__file__).resolve().parents[2] / "models" / "qwen3.5-demo"
MAX_TOKENS = 20
SYSTEM = "You are a terse coding assistant."
QUESTION = "def fibonacci(n):"
RESULT = "def fibonacci(n):\n    return n"
#: Chat Completions thinks by default, Anthropic's API only when asked: asked here, to compare
THINKING = {"type": "enabled", "budget_tokens": 1024}
CONVERSATION = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module", params=["demo", "tiny"])
def server(request: pytest.FixtureRequest, tiny_checkpoint: Path):
    from engine.runtime import Engine

    path = str(DEMO if request.param == "demo" else tiny_checkpoint)
    app = create_app(lambda: Engine.load(path, draft_tokens=2), ServerSettings(model=path))
    with LiveServer(app) as srv:
        srv.model = app.state.mtp.names[0]
        yield srv


def chat_turn(client: openai.OpenAI, model: str, messages: list) -> tuple:
    r = client.chat.completions.create(
        model=model,
        messages=messages,
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    msg = r.choices[0].message
    parts = [("reasoning", (msg.model_extra or {}).get("reasoning_content"))]
    parts += [("text", msg.content)]
    parts += [
        ("tool", c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []
    ]
    return [p for p in parts if p[-1]], r.usage


def claude_parts(blocks: list) -> list:
    out: list[tuple] = []
    for b in blocks:
        if b.type == "thinking":
            out.append(("reasoning", b.thinking))
        elif b.type == "text":
            out.append(("text", b.text))
        else:
            out.append(("tool", b.name, b.input))
    return [p for p in out if p[-1]]


def responses_parts(output: list) -> list:
    out: list[tuple] = []
    for item in output:
        if item.type == "reasoning":
            out.append(("reasoning", item.content[0].text))
        elif item.type == "message":
            out.append(("text", item.content[0].text))
        else:
            out.append(("tool", item.name, json.loads(item.arguments)))
    return [p for p in out if p[-1]]


def test_messages_equal_chat_completions(
    server: LiveServer, client: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    expected, usage = chat_turn(client, server.model, CONVERSATION)
    kw: dict[str, Any] = dict(
        model=server.model,
        system=SYSTEM,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=MAX_TOKENS,
        thinking=THINKING,
        extra_body={"temperature": 0},
    )
    message = claude.messages.create(**kw)
    assert claude_parts(message.content) == expected
    assert message.usage.output_tokens == usage.completion_tokens
    assert message.usage.input_tokens == usage.prompt_tokens
    counted = claude.messages.count_tokens(
        model=server.model, system=SYSTEM, messages=kw["messages"], thinking=THINKING
    )
    assert counted.input_tokens == usage.prompt_tokens

    with claude.messages.stream(**kw) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_message()
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert claude_parts(final.content) == expected
    assert final.usage.output_tokens == usage.completion_tokens


def test_messages_tool_round_trip_equals_chat(
    server: LiveServer, client: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    history = [
        {"role": "user", "content": "Show me fib.py"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Reading it."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "read_file",
                    "input": {"path": "fib.py"},
                },
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": RESULT}],
        },
    ]
    openai_history = [
        {"role": "user", "content": "Show me fib.py"},
        {
            "role": "assistant",
            "content": "Reading it.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "read_file", "arguments": '{"path": "fib.py"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": RESULT},
    ]
    expected, usage = chat_turn(client, server.model, openai_history)
    message = claude.messages.create(
        model=server.model,
        messages=history,
        max_tokens=MAX_TOKENS,
        thinking=THINKING,
        extra_body={"temperature": 0},
    )
    assert claude_parts(message.content) == expected
    assert message.usage.input_tokens == usage.prompt_tokens

    items = [
        {"role": "user", "content": "Show me fib.py"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Reading it."}],
        },
        {
            "type": "function_call",
            "call_id": "toolu_1",
            "name": "read_file",
            "arguments": '{"path": "fib.py"}',
        },
        {"type": "function_call_output", "call_id": "toolu_1", "output": RESULT},
    ]
    with client.responses.stream(
        model=server.model,
        input=items,
        temperature=0,
        max_output_tokens=MAX_TOKENS,
    ) as stream:
        events = list(stream)
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert responses_parts(events[-1].response.output) == expected
    assert events[-1].response.usage.input_tokens == usage.prompt_tokens


def test_responses_equal_chat_completions(server: LiveServer, client: openai.OpenAI) -> None:
    expected, usage = chat_turn(client, server.model, CONVERSATION)
    kw: dict[str, Any] = dict(
        model=server.model,
        instructions=SYSTEM,
        input=QUESTION,
        temperature=0,
        max_output_tokens=MAX_TOKENS,
    )
    response = client.responses.create(**kw)
    assert responses_parts(response.output) == expected
    assert response.usage.output_tokens == usage.completion_tokens
    assert response.usage.input_tokens == usage.prompt_tokens
    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.usage.output_tokens == usage.completion_tokens
    assert responses_parts(events[-1].response.output) == expected


class Verdict(pydantic.BaseModel):
    """A structured reply every field of which is bounded, so even a random model finishes."""

    answer: Literal["yes", "no", "maybe"]
    #: (Anthropic's SDK moves a number's bounds into its description: a bounded number is not
    #: bounded there.)
    sure: bool


def test_structured_output_through_each_sdk(
    server: LiveServer, client: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    """Each SDK's own structured-output helper gets its object back: Chat Completions'
    ``parse(response_format=)``, Responses' ``parse(text_format=)``, Messages'
    ``parse(output_format=)``; the three replies (greedy, same conversation, thinking off: a
    random model need never close its reasoning) are one JSON text, streamed or not."""
    messages = [{"role": "user", "content": "Is water wet? Reply in JSON."}]
    no_think = {"chat_template_kwargs": {"enable_thinking": False}}
    chat = client.chat.completions.parse(
        model=server.model,
        messages=messages,
        response_format=Verdict,
        temperature=0,
        extra_body=no_think,
    )
    verdict = chat.choices[0].message.parsed
    assert isinstance(verdict, Verdict) and chat.choices[0].finish_reason == "stop"
    text = chat.choices[0].message.content
    assert not (chat.choices[0].message.model_extra or {}).get("reasoning_content")

    response = client.responses.parse(
        model=server.model,
        input=messages,
        text_format=Verdict,
        temperature=0,
        reasoning={"effort": "none"},
    )
    assert response.output_parsed == verdict and response.output_text == text
    assert response.text.format.type == "json_schema"

    message = claude.messages.parse(
        model=server.model,
        messages=messages,
        max_tokens=200,
        output_format=Verdict,
        thinking={"type": "disabled"},
        extra_body={"temperature": 0},
    )
    assert message.parsed_output == verdict and message.content[0].text == text

    with client.chat.completions.stream(
        model=server.model,
        messages=messages,
        response_format=Verdict,
        temperature=0,
        extra_body=no_think,
    ) as stream:
        chunks = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert "".join(chunks) == text and final.choices[0].message.parsed == verdict


def test_a_required_tool_call_is_made_whatever_the_model(
    server: LiveServer, client: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    """Neither model calls tools on its own; with the call required (one call, a tool without
    arguments) both do, and each API reports it as its own tool call."""
    tool = {"name": "now", "description": "The current time", "parameters": {"properties": {}}}
    ask = [{"role": "user", "content": "What time is it?"}]
    chat = client.chat.completions.create(
        model=server.model,
        messages=ask,
        tools=[{"type": "function", "function": tool}],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert [c.function.name for c in choice.message.tool_calls] == ["now"]
    message = claude.messages.create(
        model=server.model,
        messages=ask,
        max_tokens=64,
        tools=[
            {
                "name": "now",
                "description": "The current time",
                "input_schema": {"type": "object", "properties": {}},
            }
        ],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        thinking={"type": "disabled"},
        extra_body={"temperature": 0},
    )
    assert message.stop_reason == "tool_use"
    assert [b.name for b in message.content if b.type == "tool_use"] == ["now"]
