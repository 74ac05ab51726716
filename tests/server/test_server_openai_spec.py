"""Every body the OpenAI-style endpoints send validates against OpenAI's published schemas.

Approach, stated plainly: tests/openai_spec.py holds our own compact JSON Schemas, each mirroring
a named component of OpenAI's OpenAPI document (openai/openai-openapi) — required fields, types,
nullability, enums — written from reading that document (nothing is downloaded here, nothing of
it is committed). jsonschema-rs validates against them: chat completions (logprobs, n > 1, tools,
reasoning), every chat and completion stream chunk (usage chunk and mid-stream error included),
completions, models, error bodies of each endpoint, Responses objects and every Responses stream
event. A required field left out (chat messages once lacked ``refusal``) fails here, so clients
generated from that document parse what mtpserve sends.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema_rs
import pytest
from fake_engine import FakeEngine, LiveServer
from openai_spec import schema

from server.app import create_app
from server.settings import ServerSettings

pytestmark = pytest.mark.fast  # the scripted fake engine answers at once: the whole file is quick

MODEL = "fake-model"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
RESPONSES_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]


@pytest.fixture(scope="module")
def server():
    with LiveServer(create_app(FakeEngine(), ServerSettings(max_body_bytes=64 * 1024))) as srv:
        yield srv


def check(name: str, body: Any) -> None:
    errors = [
        f"{list(e.instance_path)}: {e.message}"
        for e in jsonschema_rs.validator_for(schema(name)).iter_errors(body)
    ]
    assert not errors, (name, errors, body)


def sse(http: httpx.Client, path: str, body: dict[str, Any]) -> list[tuple[str | None, Any]]:
    """(event name, JSON data) of every event of a stream, ``[DONE]`` left out."""
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    out = []
    for frame in raw.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in frame.split("\n") if not line.startswith(":"))
        if fields.get("data") and fields["data"] != "[DONE]":
            out.append((fields.get("event"), json.loads(fields["data"])))
    return out


def chat(content: str, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


def test_schemas_reject_what_the_spec_requires() -> None:
    """The schemas can fail: a message without ``refusal`` or a chunk without ``created``."""
    message = {"role": "assistant", "content": "hi"}
    with pytest.raises(jsonschema_rs.ValidationError):
        jsonschema_rs.validator_for(schema("ChatCompletionResponseMessage")).validate(message)
    chunk = {"id": "x", "object": "chat.completion.chunk", "model": MODEL, "choices": []}
    with pytest.raises(jsonschema_rs.ValidationError):
        jsonschema_rs.validator_for(schema("CreateChatCompletionStreamResponse")).validate(chunk)


@pytest.mark.parametrize(
    "body",
    [
        chat("TRIGGER_REASON", logprobs=True, top_logprobs=2),
        chat("random words", n=2, max_tokens=6, seed=1, temperature=0.8),
        chat("TRIGGER_TWO_TOOLS", tools=TOOLS),
        chat(
            "TRIGGER_TOOL",
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        ),
    ],
    ids=["logprobs+reasoning", "n=2", "tools", "named tool"],
)
def test_chat_bodies_and_chunks(http: httpx.Client, body: dict[str, Any]) -> None:
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    check("CreateChatCompletionResponse", r.json())
    stream = body | {"stream": True, "stream_options": {"include_usage": True}}
    events = sse(http, "/v1/chat/completions", stream)
    for _, chunk in events:
        check("CreateChatCompletionStreamResponse", chunk)
    assert events[-1][1]["usage"]["total_tokens"] > 0


def test_completions_bodies_and_chunks(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "prompt": ["TRIGGER_UNICODE", "x"],
        "max_tokens": 8,
        "logprobs": 2,
        "echo": True,
        "n": 2,
    }
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200
    check("CreateCompletionResponse", r.json())
    for _, chunk in sse(
        http, "/v1/completions", body | {"stream": True, "stream_options": {"include_usage": True}}
    ):
        check("CompletionChunk", chunk)


def test_models_and_error_bodies(http: httpx.Client) -> None:
    check("ListModelsResponse", http.get("/v1/models").json())
    check("Model", http.get(f"/v1/models/{MODEL}").json())
    failures = [
        http.get("/v1/models/nope"),
        http.post("/v1/chat/completions", content=b"{"),
        http.post("/v1/chat/completions", json=chat("x", temperature=-1)),
        http.post("/v1/chat/completions", json=chat("TRIGGER_CRASH_NOW")),
        http.post("/v1/completions", json={"model": MODEL, "prompt": [10**6]}),
        http.post("/v1/responses", json={"model": MODEL, "input": 5}),
        http.post(
            "/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": "r"}
        ),
        http.post("/v1/nothing", json={}),
    ]
    for r in failures:
        assert 400 <= r.status_code < 600
        check("ErrorResponse", r.json())
    events = sse(http, "/v1/chat/completions", chat("TRIGGER_CRASH_LATER", stream=True))
    check("ErrorResponse", events[-1][1])


@pytest.mark.parametrize(
    "body",
    [
        {"input": "TRIGGER_TOOL", "tools": RESPONSES_TOOLS, "instructions": "Be brief."},
        {
            "input": "TRIGGER_TOOL",
            "tools": RESPONSES_TOOLS,
            "tool_choice": {"type": "function", "name": "get_weather"},
            "metadata": {"k": "v"},
        },
        {"input": [{"role": "user", "content": "TRIGGER_PLAIN"}], "max_output_tokens": 3},
        {"input": "TRIGGER_REASON", "reasoning": {"effort": "high"}, "temperature": 0.5},
    ],
    ids=["tools", "named tool", "incomplete", "reasoning"],
)
def test_responses_objects_and_events(http: httpx.Client, body: dict[str, Any]) -> None:
    body = {"model": MODEL} | body
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200
    check("Response", r.json())
    events = sse(http, "/v1/responses", body | {"stream": True})
    for name, event in events:
        assert name == event["type"]
        check(name, event)
    assert events[-1][0] in ("response.completed", "response.incomplete")


def test_responses_error_event(http: httpx.Client) -> None:
    events = sse(
        http,
        "/v1/responses",
        {"model": MODEL, "input": "TRIGGER_CRASH_LATER", "stream": True, "max_output_tokens": 300},
    )
    assert events[-1][0] == "error"
    check("error", events[-1][1])
