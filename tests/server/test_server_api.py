"""The HTTP server against a FakeEngine with scripted replies, over real uvicorn on loopback.

Driven with the ``openai`` SDK (what users run) and with httpx for what the SDK hides: raw SSE
framing, error bodies, status codes, disconnects. The scripted engine is what makes reasoning,
tool calls, stop strings and multi-byte text checkable exactly;
tests/server/test_server_real.py runs the same flows against the real engine and a tiny checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
import openai
import pytest
from fake_engine import SCRIPTS, FakeEngine, LiveServer

from server.app import create_app
from server.settings import ServerSettings

pytestmark = pytest.mark.fast  # the scripted fake engine answers at once: the whole file is quick

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture(scope="module")
def server(engine: FakeEngine):
    settings = ServerSettings(
        model="/some/where/fake-model",
        served_model_names=["alias"],
        max_body_bytes=64 * 1024,
        max_queue=16,
    )
    with LiveServer(create_app(engine, settings)) as srv:
        yield srv


NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def chat(content: str, **kw: Any) -> dict[str, Any]:
    """A raw chat body; thinking off unless asked, so scripted replies land in ``content``."""
    return (
        {"model": "fake-model", "messages": [{"role": "user", "content": content}]} | NO_THINK | kw
    )


def extra(obj: Any, name: str) -> Any:
    """A non-standard field of an SDK object (reasoning_content, usage.speculative)."""
    value = getattr(obj, name, None)
    if value is None and obj.model_extra:
        value = obj.model_extra.get(name)
    return value


def sse_events(raw: str) -> list[str]:
    """Split an SSE body into data payloads, checking OpenAI's exact framing on the way."""
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    frames = raw.split("\n\n")
    assert frames[-1] == ""
    out = []
    for frame in frames[:-1]:
        assert frame.startswith("data: ") and "\n" not in frame, frame
        out.append(frame[len("data: ") :])
    return out


# ------------------------------------------------------------------------------------------
# models, health, metrics
# ------------------------------------------------------------------------------------------
def test_models_lists_name_and_aliases(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == "fake-model" and "alias" in ids and "/some/where/fake-model" in ids
    assert client.models.retrieve("alias").id == "alias"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other-model")


def test_health_and_metrics(http: httpx.Client) -> None:
    assert http.get("/health").json()["status"] == "ok"
    http.post("/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 4})
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in (
        "mtpserve_requests_total",
        "mtpserve_generation_tokens_total",
        "mtpserve_spec_draft_tokens_proposed_total",
        "mtpserve_spec_draft_tokens_accepted_total",
        "mtpserve_spec_acceptance_rate",
        "mtpserve_queue_depth",
        "mtpserve_time_to_first_token_seconds_bucket",
    ):
        assert name in text, name
    assert 'mtpserve_requests_total{endpoint="completions",status="200"}' in text


# ------------------------------------------------------------------------------------------
# chat completions
# ------------------------------------------------------------------------------------------
def test_chat_reasoning_separated(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "TRIGGER_REASON"}]
    )
    msg = r.choices[0].message
    assert msg.content == "Hello there!"
    assert extra(msg, "reasoning_content") == "The user greets me. I should answer."
    assert r.choices[0].finish_reason == "stop"
    assert r.object == "chat.completion" and r.model == "fake-model" and r.id.startswith("chatcmpl")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    spec = extra(r.usage, "speculative")
    assert set(spec) >= {"draft_tokens", "proposed", "accepted", "acceptance_rate"}
    assert spec["draft_tokens"] == 2 and 0 <= spec["acceptance_rate"] <= 1


def test_chat_alias_and_path_name_accepted(client: openai.OpenAI) -> None:
    for name in ("alias", "/some/where/fake-model"):
        r = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "TRIGGER_PLAIN"}], extra_body=NO_THINK
        )
        assert r.model == "fake-model"


def test_enable_thinking_false_reaches_template(client: openai.OpenAI, engine: FakeEngine) -> None:
    r = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "TRIGGER_PLAIN"}],
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    prompt = engine.tokenizer.decode(engine.requests[-1].prompt_ids)
    assert prompt.endswith("<think>\n\n</think>\n\n")
    assert r.choices[0].message.content == "The answer is 42."
    assert extra(r.choices[0].message, "reasoning_content") is None


def test_continue_final_message_continues_the_assistant_text(
    client: openai.OpenAI, engine: FakeEngine, http: httpx.Client
) -> None:
    """vLLM's ``continue_final_message``: the final assistant message is the start of the
    reply, after the generation prompt with thinking closed; the reply is what follows."""
    messages = [
        {"role": "user", "content": "TRIGGER_PLAIN What is the answer?"},
        {"role": "assistant", "content": "Well,"},
    ]
    r = client.chat.completions.create(
        model="fake-model",
        messages=messages,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    prompt = engine.tokenizer.decode(engine.requests[-1].prompt_ids)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nWell,"), prompt
    assert prompt.count("<|im_start|>assistant") == 1
    assert r.choices[0].message.content == "The answer is 42."
    for extra_fields, param in [
        ({"continue_final_message": True}, "messages.1"),  # the last message is the user's
        ({"continue_final_message": True, "add_generation_prompt": True}, "add_generation_prompt"),
        ({"add_generation_prompt": False}, "add_generation_prompt"),
    ]:
        body = chat("x") | extra_fields
        r = http.post(
            "/v1/chat/completions", json=body | {"messages": messages[:1] + body["messages"]}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    thinking = {"continue_final_message": True, "chat_template_kwargs": {"enable_thinking": True}}
    r = http.post("/v1/chat/completions", json=chat("x", messages=messages, **thinking))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "chat_template_kwargs.enable_thinking"
    fmt = {"continue_final_message": True, "response_format": {"type": "json_object"}}
    r = http.post("/v1/chat/completions", json=chat("x", messages=messages, **fmt))
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_draft_tokens_auto_asks_for_automatic_k_on_every_api(
    http: httpx.Client, engine: FakeEngine
) -> None:
    """``draft_tokens: "auto"`` reaches the engine as "auto" (automatic K even when the server
    runs a fixed K), an integer as itself, null as the server's default; anything else is a
    400 naming the field, on chat completions, responses and messages alike."""
    bodies = {
        "/v1/chat/completions": chat("TRIGGER_PLAIN hi"),
        "/v1/responses": {"model": "fake-model", "input": "TRIGGER_PLAIN hi"},
        "/v1/messages": {
            "model": "fake-model",
            "max_tokens": 16,
            "messages": [{"role": "user", "content": "TRIGGER_PLAIN hi"}],
        },
    }
    for path, body in bodies.items():
        for value, expected in (("auto", "auto"), (3, 3), (None, engine.default_draft_tokens)):
            r = http.post(path, json=body | {"draft_tokens": value})
            assert r.status_code == 200, (path, r.text)
            assert engine.requests[-1].draft_tokens == expected, (path, value)
        for bad in ("fast", -1, 33):
            r = http.post(path, json=body | {"draft_tokens": bad})
            assert r.status_code == 400, (path, bad, r.text)
            assert "draft_tokens" in r.text, (path, r.text)


def test_include_reasoning_false_keeps_raw_text(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "TRIGGER_REASON"}],
        extra_body={"include_reasoning": False},
    )
    assert r.choices[0].message.content == (
        "The user greets me. I should answer.\n</think>\n\nHello there!"
    )


def test_chat_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "TRIGGER_REASON"}]
    )
    stream = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "TRIGGER_REASON"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    content, reasoning, finish, usage, roles = "", "", None, None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            roles.append(choice.delta.role)
            content += choice.delta.content or ""
            reasoning += extra(choice.delta, "reasoning_content") or ""
            finish = choice.finish_reason or finish
    assert roles[0] == "assistant"
    assert content == full.choices[0].message.content
    assert reasoning == extra(full.choices[0].message, "reasoning_content")
    assert finish == "stop"
    assert usage.completion_tokens == full.usage.completion_tokens
    assert extra(usage, "speculative")["proposed"] > 0


def test_system_developer_assistant_tool_roles_and_text_parts(
    client: openai.OpenAI, engine: FakeEngine
) -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Paris?"}],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]
    r = client.chat.completions.create(
        model="fake-model",
        messages=messages + [{"role": "user", "content": "TRIGGER_PLAIN"}],
        tools=TOOLS,
        extra_body=NO_THINK,
    )
    assert r.choices[0].message.content == "The answer is 42."
    prompt = engine.tokenizer.decode(engine.requests[-1].prompt_ids)
    assert "Be brief." in prompt and "Weather\nin Paris?" in prompt
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in prompt
    assert "<tool_response>\nsunny, 21C\n</tool_response>" in prompt
    assert '"name": "get_weather"' in prompt  # tool schema in the system prompt


def test_mtp_trace_covers_reasoning_and_stops_with_the_text(http: httpx.Client) -> None:
    """The trace's token texts are the raw text (reasoning markers included), cut where the
    text is cut by a stop string; every emitted token is traced once."""

    def traced(body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any], str]:
        body = body | {"stream": True, "mtp_trace": True, "stream_options": {"include_usage": True}}
        r = http.post("/v1/chat/completions", json=body)
        chunks = [json.loads(e) for e in sse_events(r.text) if e != "[DONE]"]
        traces = [ch["mtp_trace"] for c in chunks for ch in c["choices"] if "mtp_trace" in ch]
        tokens = [t for trace in traces for t in trace["tokens"]]
        content = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
        return tokens, chunks[-1]["usage"], content

    tokens, usage, content = traced(
        chat("TRIGGER_REASON", chat_template_kwargs={"enable_thinking": True})
    )
    assert "".join(t["text"] for t in tokens) == SCRIPTS["TRIGGER_REASON"]
    assert content == "Hello there!"
    assert len(tokens) == usage["completion_tokens"]
    assert sum(t["drafted"] for t in tokens) == usage["speculative"]["accepted"] > 0

    tokens, usage, content = traced(chat("TRIGGER_STOP", stop=["STOP"]))
    assert "".join(t["text"] for t in tokens) == content == "one two three "
    assert len(tokens) == usage["completion_tokens"]


def test_tool_call_non_streaming(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "TRIGGER_TOOL"}], tools=TOOLS
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert extra(choice.message, "reasoning_content") == "I need the weather."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}


def test_deprecated_function_calling_is_refused_not_ignored(client: openai.OpenAI) -> None:
    """``functions`` / ``function_call`` (OpenAI's deprecated function calling) are a 400 that
    names them and what to send instead; ignored, the reply would come without the functions."""
    ask = [{"role": "user", "content": "TRIGGER_TOOL"}]
    functions = [tool["function"] for tool in TOOLS]
    for fields, param in (
        ({"functions": functions}, "functions"),
        ({"function_call": "auto"}, "function_call"),
    ):
        with pytest.raises(openai.BadRequestError, match="deprecated") as refused:
            client.chat.completions.create(model="fake-model", messages=ask, **fields)
        assert refused.value.body["param"] == param
    hi = [{"role": "user", "content": "hi"}]
    served = client.chat.completions.create(
        model="fake-model", messages=hi, extra_body={"functions": []}
    )
    assert served.choices[0].finish_reason in ("stop", "length")  # an empty list is no functions


def test_tool_calls_streamed_as_deltas(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "TRIGGER_TWO_TOOLS"}],
        tools=TOOLS,
        stream=True,
    )
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] += tc.id or ""
                if tc.function is not None:
                    slot["name"] += tc.function.name or ""
                    slot["arguments"] += tc.function.arguments or ""
    assert finish == "tool_calls"
    assert sorted(calls) == [0, 1]
    assert [json.loads(calls[i]["arguments"]) for i in (0, 1)] == [
        {"city": "Paris"},
        {"city": "Rome"},
    ]
    assert all(c["name"] == "get_weather" and c["id"].startswith("call_") for c in calls.values())


def test_tool_choice_none_and_named(client: openai.OpenAI, engine: FakeEngine) -> None:
    r = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "TRIGGER_TOOL"}],
        tools=TOOLS,
        tool_choice="none",
    )
    assert r.choices[0].message.tool_calls is None
    assert "<tool_call>" in r.choices[0].message.content
    assert "get_weather" not in engine.tokenizer.decode(engine.requests[-1].prompt_ids)
    r = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "TRIGGER_TOOL"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert r.choices[0].finish_reason == "tool_calls"


def test_n_choices_with_seed(client: openai.OpenAI, engine: FakeEngine) -> None:
    kw = dict(
        model="fake-model",
        messages=[{"role": "user", "content": "random words"}],
        n=3,
        seed=11,
        temperature=0.9,
        max_tokens=8,
        extra_body=NO_THINK,
    )
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]  # reproducible with a seed
    assert len(set(texts)) == 3  # choice i uses seed + i
    assert [r.sampling.seed for r in engine.requests[-3:]] == [11, 12, 13]
    assert a.usage.completion_tokens == 24

    stream = client.chat.completions.create(**kw, stream=True)
    got = {0: "", 1: "", 2: ""}
    for chunk in stream:
        for c in chunk.choices:
            got[c.index] += c.delta.content or ""
    assert [got[i] for i in range(3)] == texts


def test_sampling_resolution_reaches_engine(client: openai.OpenAI, engine: FakeEngine) -> None:
    client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "TRIGGER_PLAIN"}],
        temperature=0.5,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        seed=3,
        logit_bias={"5": 2.0},
        max_completion_tokens=7,
        extra_body={"top_k": 7, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    r = engine.requests[-1]
    s = r.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (0.5, 0.9, 7, 0.05)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, 0.25, 1.1)
    assert s.logit_bias == {5: 2.0} and s.seed == 3 and r.max_tokens == 7
    assert r.stop_token_ids == engine.eos_token_ids
    client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "TRIGGER_PLAIN"}], max_tokens=5
    )
    s = engine.requests[-1].sampling  # generation_config defaults fill what the request omits
    assert (s.temperature, s.top_k, s.top_p) == (1.0, 20, 0.95)


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "TRIGGER_UNICODE"}],
        logprobs=True,
        top_logprobs=3,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    items = r.choices[0].logprobs.content
    # the content's tokens: every one but the closing <|im_end|>, which is not content
    assert len(items) == r.usage.completion_tokens - 1
    raw = b"".join(bytes(i.bytes) for i in items)
    assert raw.decode() == r.choices[0].message.content == "héllo → 世界 🙂 naïve café"
    assert all(len(i.top_logprobs) == 3 and i.logprob <= 0 for i in items)


def test_stop_strings_cut_text_and_cancel(client: openai.OpenAI, engine: FakeEngine) -> None:
    kw = dict(model="fake-model", prompt="TRIGGER_STOP", stop=["STOP", "never"], max_tokens=50)
    r = client.completions.create(**kw)
    assert r.choices[0].text == "one two three " and r.choices[0].finish_reason == "stop"
    full_len = len(engine.tokenizer.encode("one two three STOP four five")) + 1
    assert r.usage.completion_tokens < full_len
    text = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
    assert text == "one two three "
    chat_r = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "TRIGGER_STOP"}],
        stop="STOP",
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert chat_r.choices[0].message.content == "one two three "
    assert chat_r.choices[0].finish_reason == "stop"


# ------------------------------------------------------------------------------------------
# text completions
# ------------------------------------------------------------------------------------------
def test_completions_string_and_token_prompts(client: openai.OpenAI, engine: FakeEngine) -> None:
    ids = engine.tokenizer.encode("TRIGGER_PLAIN")
    a = client.completions.create(model="fake-model", prompt="TRIGGER_PLAIN", max_tokens=32)
    b = client.completions.create(model="fake-model", prompt=ids, max_tokens=32)
    assert a.choices[0].text == b.choices[0].text == "The answer is 42."
    assert a.object == "text_completion" and a.usage.prompt_tokens == len(ids)
    e = client.completions.create(
        model="fake-model", prompt="TRIGGER_PLAIN", max_tokens=32, echo=True
    )
    assert e.choices[0].text == "TRIGGER_PLAIN" + "The answer is 42."


def test_completions_batch_and_length(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model="fake-model",
        prompt=["TRIGGER_PLAIN", "some text"],
        max_tokens=3,
        n=2,
        temperature=0,
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.choices[0].text == r.choices[1].text  # greedy, same prompt
    # more choices than the server takes at once: the prompt batch is named, or n
    with pytest.raises(openai.BadRequestError, match="9 prompts of 1 choice each") as batch:
        client.completions.create(model="fake-model", prompt=["x"] * 9, max_tokens=1)
    assert batch.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError, match="n must be at most") as many:
        client.completions.create(model="fake-model", prompt="x", max_tokens=1, n=9)
    assert many.value.body["param"] == "n"
    # a suffix (fill-in-the-middle) is refused, not ignored; an empty one is no suffix
    with pytest.raises(openai.BadRequestError, match="suffix") as fim:
        client.completions.create(model="fake-model", prompt="def f(", suffix="):", max_tokens=1)
    assert fim.value.body["param"] == "suffix"
    assert client.completions.create(model="fake-model", prompt="x", suffix="", max_tokens=1)
    # best_of: served only as n itself, never ranked silently
    with pytest.raises(openai.BadRequestError, match="best_of") as best:
        client.completions.create(model="fake-model", prompt="x", best_of=3, max_tokens=1)
    assert best.value.body["param"] == "best_of"
    assert client.completions.create(model="fake-model", prompt="x", best_of=2, n=2, max_tokens=1)


def test_completions_streaming_with_logprobs(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model="fake-model",
            prompt="TRIGGER_UNICODE",
            max_tokens=64,
            stream=True,
            logprobs=2,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == "héllo → 世界 🙂 naïve café"
    tokens = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens
    ]
    assert len(tokens) == chunks[-1].usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


# ------------------------------------------------------------------------------------------
# raw SSE framing and UTF-8 safety
# ------------------------------------------------------------------------------------------
def test_raw_sse_framing(http: httpx.Client) -> None:
    body = chat("TRIGGER_UNICODE", stream=True, stream_options={"include_usage": True})
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode("utf-8")
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    pieces = [d.get("reasoning_content", "") + d.get("content", "") for d in deltas]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == "héllo → 世界 🙂 naïve café"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"


# ------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------
GOOD = chat("TRIGGER_PLAIN", max_tokens=8)
BIG = "x" * (70 * 1024)


def replaying_tool_call(arguments: str) -> dict[str, Any]:
    """A chat request whose history holds an assistant tool call with these ``arguments``."""
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    history = [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "user", "content": "x"},
    ]
    return chat("x") | {"messages": history}


MALFORMED: list[tuple[str, str, Any, int, str | None]] = [
    # (name, path, body, status, param or code expected)
    ("invalid json", "/v1/chat/completions", b"{not json", 400, "invalid_json"),
    ("empty body", "/v1/chat/completions", b"", 400, "invalid_json"),
    ("json array", "/v1/chat/completions", [1, 2], 400, "invalid_json"),
    (
        "json nested past the parser's depth",
        "/v1/chat/completions",
        b'{"model": "fake-model", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        400,
        "invalid_json",
    ),
    ("missing messages", "/v1/chat/completions", {"model": "fake-model"}, 400, "messages"),
    ("empty messages", "/v1/chat/completions", chat("x") | {"messages": []}, 400, "messages"),
    (
        "bad role",
        "/v1/chat/completions",
        chat("x") | {"messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages.0.role",
    ),
    (
        "content int",
        "/v1/chat/completions",
        chat("x") | {"messages": [{"role": "user", "content": 5}]},
        400,
        "messages.0.content",
    ),
    (
        "image part",
        "/v1/chat/completions",
        chat("x")
        | {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                }
            ]
        },
        400,
        "messages.0.content.0",
    ),
    (
        "temperature string",
        "/v1/chat/completions",
        chat("x", temperature="hot"),
        400,
        "temperature",
    ),
    ("temperature negative", "/v1/chat/completions", chat("x", temperature=-1), 400, "temperature"),
    ("top_p zero", "/v1/chat/completions", chat("x", top_p=0), 400, "top_p"),
    ("top_k negative", "/v1/chat/completions", chat("x", top_k=-5), 400, "top_k"),
    ("min_p above one", "/v1/chat/completions", chat("x", min_p=2), 400, "min_p"),
    (
        "presence penalty",
        "/v1/chat/completions",
        chat("x", presence_penalty=5),
        400,
        "presence_penalty",
    ),
    (
        "repetition penalty zero",
        "/v1/chat/completions",
        chat("x", repetition_penalty=0),
        400,
        "repetition_penalty",
    ),
    ("logit_bias key", "/v1/chat/completions", chat("x", logit_bias={"abc": 1}), 400, "logit_bias"),
    (
        "logit_bias id",
        "/v1/chat/completions",
        chat("x", logit_bias={"999999": 1}),
        400,
        "logit_bias",
    ),
    ("seed negative", "/v1/chat/completions", chat("x", seed=-1), 400, "seed"),
    ("n zero", "/v1/chat/completions", chat("x", n=0), 400, "n"),
    ("n huge", "/v1/chat/completions", chat("x", n=10_000), 400, "n"),
    ("max_tokens zero", "/v1/chat/completions", chat("x", max_tokens=0), 400, "max_tokens"),
    (
        "max_tokens beyond context",
        "/v1/chat/completions",
        chat("x", max_tokens=10**9),
        400,
        "context_length_exceeded",
    ),
    ("too many stops", "/v1/chat/completions", chat("x", stop=["a"] * 100), 400, "stop"),
    (
        "top_logprobs huge",
        "/v1/chat/completions",
        chat("x", logprobs=True, top_logprobs=500),
        400,
        "top_logprobs",
    ),
    (
        "top_logprobs without logprobs",
        "/v1/chat/completions",
        chat("x", top_logprobs=2),
        400,
        "top_logprobs",
    ),
    (
        "tool_choice without tools",
        "/v1/chat/completions",
        chat("x", tool_choice="required"),
        400,
        "tool_choice",
    ),
    (
        "unknown tool_choice name",
        "/v1/chat/completions",
        chat("x", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
        400,
        "tool_choice",
    ),
    (
        "bad tool arguments",
        "/v1/chat/completions",
        replaying_tool_call("{oops"),
        400,
        "messages.0.tool_calls.0.function.arguments",
    ),
    (
        "tool arguments nested past the parser's depth",
        "/v1/chat/completions",
        replaying_tool_call("[" * 5000 + "]" * 5000),
        400,
        "messages.0.tool_calls.0.function.arguments",
    ),
    (
        "unknown model",
        "/v1/chat/completions",
        chat("x") | {"model": "/etc/passwd"},
        404,
        "model_not_found",
    ),
    ("engine rejects", "/v1/chat/completions", chat("TRIGGER_BAD_PARAM"), 400, "top_k"),
    ("engine crashes", "/v1/chat/completions", chat("TRIGGER_CRASH_NOW"), 500, "engine_error"),
    ("body too large", "/v1/chat/completions", chat(BIG), 413, "body_too_large"),
    ("empty prompt", "/v1/completions", {"model": "fake-model", "prompt": ""}, 400, "prompt"),
    ("empty id list", "/v1/completions", {"model": "fake-model", "prompt": []}, 400, "prompt"),
    (
        "id out of range",
        "/v1/completions",
        {"model": "fake-model", "prompt": [10**6]},
        400,
        "prompt",
    ),
    ("negative id", "/v1/completions", {"model": "fake-model", "prompt": [-3]}, 400, "prompt"),
    (
        "prompt object",
        "/v1/completions",
        {"model": "fake-model", "prompt": {"a": 1}},
        400,
        "prompt",
    ),
    (
        "completions logprobs huge",
        "/v1/completions",
        {"model": "fake-model", "prompt": "x", "logprobs": 99},
        400,
        "logprobs",
    ),
    ("no route", "/v1/nothing", {}, 404, "not_found"),
]


@pytest.mark.parametrize("name,path,body,status,what", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_request_gets_4xx_and_server_keeps_serving(
    http: httpx.Client, name: str, path: str, body: Any, status: int, what: str | None
) -> None:
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert what in (err["param"], err["code"]), err
    ok = http.post("/v1/chat/completions", json=GOOD)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]


def test_an_error_message_names_no_class_of_the_server(http: httpx.Client) -> None:
    """pydantic words a non-object as "a valid dictionary or instance of ChatMessage": the
    client sees what it must send, not the server's class names."""
    r = http.post("/v1/chat/completions", json=chat("x") | {"messages": ["hi"]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "messages.0: Input should be an object"


@pytest.mark.parametrize(
    "body",
    [
        chat("TRIGGER_PLAIN", top_k=10**9),  # >= vocab: top-k off
        chat("TRIGGER_PLAIN", top_k=-1),  # vLLM's "off"
        chat("TRIGGER_PLAIN", some_future_field={"x": 1}, user="u1", store=False),
        chat("TRIGGER_PLAIN", chat_template_kwargs={"tokenize": True, "enable_thinking": False}),
        chat("TRIGGER_PLAIN", temperature=0, n=2, stop=""),
    ],
    ids=["top_k huge", "top_k -1", "unknown fields", "reserved template kwargs", "empty stop"],
)
def test_odd_but_valid_requests_succeed(http: httpx.Client, body: dict) -> None:
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "The answer is 42."


def test_streaming_error_after_start_is_an_error_event(
    http: httpx.Client, client: openai.OpenAI
) -> None:
    with http.stream(
        "POST",
        "/v1/chat/completions",
        json=chat("TRIGGER_CRASH_LATER long", stream=True, max_tokens=200),
    ) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    events = sse_events(raw)
    last = json.loads(events[-2])
    assert last["error"]["code"] == "engine_error" and last["error"]["type"] == "server_error"
    assert any("choices" in json.loads(e) for e in events[:-2])  # it had started streaming
    with pytest.raises(openai.APIError):
        for _ in client.chat.completions.create(
            model="fake-model",
            messages=[{"role": "user", "content": "TRIGGER_CRASH_LATER"}],
            stream=True,
        ):
            pass
    assert http.post("/v1/chat/completions", json=GOOD).status_code == 200


# ------------------------------------------------------------------------------------------
# concurrency and cancellation
# ------------------------------------------------------------------------------------------
def test_concurrent_greedy_streams_equal_sequential(server: LiveServer, engine: FakeEngine) -> None:
    prompts = [f"prompt number {i} " * (i + 1) for i in range(8)]

    async def one(ac: httpx.AsyncClient, prompt: str) -> str:
        body = {
            "model": "fake-model",
            "prompt": prompt,
            "max_tokens": 24,
            "temperature": 0,
            "stream": True,
        }
        text = ""
        async with ac.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def run(concurrent: bool) -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as ac:
            if concurrent:
                return list(await asyncio.gather(*(one(ac, p) for p in prompts)))
            return [await one(ac, p) for p in prompts]

    sequential = asyncio.run(run(False))
    concurrent = asyncio.run(run(True))
    assert concurrent == sequential and len(set(sequential)) == 8
    assert engine.max_active == 1 and len(engine.threads) == 1
    assert threading.get_ident() not in engine.threads


def _wait_for(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_streaming_disconnect_cancels_generation(server: LiveServer, engine: FakeEngine) -> None:
    before = len(engine.cancel_seen)
    body = chat("TRIGGER_SLOW go", stream=True, max_tokens=3000)
    with (
        httpx.Client(base_url=server.url, timeout=30) as c,
        c.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        lines = r.iter_lines()
        seen = 0
        for line in lines:
            if line.startswith("data: {"):
                seen += 1
            if seen >= 3:
                break
    # the connection is closed here; the engine notices within one cycle
    assert _wait_for(lambda: len(engine.cancel_seen) > before)
    assert engine.cancel_seen[-1] < 3000
    assert _wait_for(lambda: engine.active == 0)
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.post("/v1/chat/completions", json=GOOD).status_code == 200


def test_non_streaming_disconnect_cancels_generation(
    server: LiveServer, engine: FakeEngine
) -> None:
    before = len(engine.cancel_seen)
    body = {"model": "fake-model", "prompt": "TRIGGER_SLOW go", "max_tokens": 3000}
    with httpx.Client(base_url=server.url, timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json=body)
    assert _wait_for(lambda: len(engine.cancel_seen) > before)
    assert engine.cancel_seen[-1] < 3000
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.post("/v1/chat/completions", json=GOOD).status_code == 200


# ------------------------------------------------------------------------------------------
# servers with other settings: API key, a tiny queue
# ------------------------------------------------------------------------------------------
def test_api_key_required_on_v1_and_tokenizer_routes() -> None:
    app = create_app(FakeEngine(), ServerSettings(api_key="sekrit"))
    with LiveServer(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic sekrit"}):
            r = c.post("/v1/chat/completions", json=GOOD, headers=headers)
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert c.get("/v1/models", headers=headers).status_code == 401
            assert c.get("/tokenizer_info", headers=headers).status_code == 401
            assert c.post("/tokenize", json={"prompt": "x"}, headers=headers).status_code == 401
        assert c.get("/health").status_code == 200
        ok = {"Authorization": "Bearer sekrit"}
        assert c.post("/tokenize", json={"prompt": "x"}, headers=ok).status_code == 200
        assert c.post("/v1/chat/completions", json=GOOD, headers=ok).status_code == 200
        sdk = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekrit", max_retries=0)
        assert sdk.models.list().data[0].id == "fake-model"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_queue_full_gets_429_with_retry_after() -> None:
    engine = FakeEngine(cycle_delay=0.02)
    app = create_app(engine, ServerSettings(max_queue=1, retry_after_seconds=3))
    body = {"model": "fake-model", "prompt": "hello", "max_tokens": 2000, "temperature": 0}

    async def main(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as ac:
            running = asyncio.create_task(ac.post("/v1/completions", json=body))
            assert await asyncio.to_thread(_wait_for, lambda: engine.active == 1)
            queued = asyncio.create_task(ac.post("/v1/completions", json=body | {"max_tokens": 2}))
            for _ in range(500):  # poll the queue until the second request waits in it
                if (await ac.get("/health")).json()["queue_depth"] == 1:
                    break
                await asyncio.sleep(0.01)
            rejected = await ac.post("/v1/completions", json=body)
            sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.RateLimitError):
                await sdk.completions.create(model="fake-model", prompt="x", max_tokens=2)
            running.cancel()  # disconnect: frees the engine for the queued one
            return [rejected, await queued]

    with LiveServer(app) as srv:
        rejected, queued = asyncio.run(main(srv.url))
    assert rejected.status_code == 429
    assert rejected.headers["retry-after"] == "3"
    assert rejected.json()["error"]["code"] == "queue_full"
    assert queued.status_code == 200
