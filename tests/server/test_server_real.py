"""The server end to end with the real engine on a tiny random checkpoint, over real uvicorn.

The "done when" of the server issue: the openai SDK (chat and completions, streaming and not,
models, tools, n>1), httpx for SSE framing, error bodies and a mid-stream disconnect, 8
concurrent greedy streams equal to the same requests one at a time, and a table of malformed
requests each answered with its 4xx while the server keeps serving. The engine is built on the
scheduler's worker thread (as ``mtpserve serve`` does), so mlx runs on that thread only.

A random model writes arbitrary bytes — invalid UTF-8 included — which is a good stress test of
the incremental detokenizer: streamed text must equal non-streamed text exactly.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fake_engine import LiveServer, metric

from server.app import create_app
from server.settings import ServerSettings

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path):
    from engine.runtime import Engine

    settings = ServerSettings(model=str(tiny_checkpoint), served_model_names=["demo"], max_n=8)

    def load() -> Any:
        return Engine.load(str(tiny_checkpoint), draft_tokens=2)

    app = create_app(load, settings)
    with LiveServer(app) as srv:
        srv.model = app.state.mtp.names[0]
        srv.engine = app.state.mtp.engine
        yield srv


def test_models(client: openai.OpenAI, server: LiveServer, tiny_checkpoint: Path) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == server.model and "demo" in ids
    # what the start-up log names as the weights' folder
    assert server.engine.model_dir.resolve() == tiny_checkpoint.resolve()


@pytest.mark.fast
def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    kw = dict(
        model="demo",
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say hello."},
        ],
        temperature=0,
        max_tokens=40,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    full = client.chat.completions.create(**kw, logprobs=True, top_logprobs=3)
    choice = full.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert full.usage.completion_tokens == len(choice.logprobs.content)
    assert full.usage.completion_tokens <= 40
    spec = full.usage.model_extra["speculative"]
    assert spec["draft_tokens"] == 2 and spec["proposed"] >= spec["accepted"] >= 0
    # the K in use is visible: every cycle ran K=2, or K=0/1 where max_tokens capped it
    assert sum(spec["cycles_by_draft_tokens"]) == spec["cycles"] > 0
    assert len(spec["cycles_by_draft_tokens"]) <= 3 and spec["generation_tokens_per_second"] > 0
    # the emitted tokens' bytes rebuild the text (minus a final EOS, which has no text)
    items = choice.logprobs.content
    if choice.finish_reason == "stop":
        items = items[:-1]
    raw = b"".join(bytes(i.bytes) for i in items)
    assert raw.decode("utf-8", errors="replace") == (choice.message.content or "")
    assert all(len(i.top_logprobs) == 3 for i in choice.logprobs.content)

    text, finish = "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert text == (choice.message.content or "") and finish == choice.finish_reason


def test_completions_string_tokens_and_stream(client: openai.OpenAI, server: LiveServer) -> None:
    prompt = "def add(a, b):\n"
    ids = server.engine.tokenizer.encode(prompt)
    a = client.completions.create(model="demo", prompt=prompt, max_tokens=30, temperature=0)
    b = client.completions.create(model="demo", prompt=ids, max_tokens=30, temperature=0)
    assert a.choices[0].text == b.choices[0].text
    assert a.usage.prompt_tokens == len(ids)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="demo", prompt=prompt, max_tokens=30, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == a.choices[0].text


def test_stop_string_from_greedy_output(client: openai.OpenAI) -> None:
    kw = dict(model="demo", prompt="The quick brown fox", temperature=0, max_tokens=40)
    text = client.completions.create(**kw).choices[0].text
    clean = [m for m in re.finditer(r"[^\ufffd]{3}", text) if m.start() > 2]
    if not clean:
        pytest.skip("greedy output has no clean 3-character span to use as a stop string")
    stop = clean[0].group(0)
    cut = client.completions.create(**kw, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(**kw, stop=[stop], stream=True)
        if c.choices
    )
    assert streamed == cut.choices[0].text


def test_n_choices_sampled_with_seed(client: openai.OpenAI) -> None:
    kw = dict(
        model="demo",
        messages=[{"role": "user", "content": "Tell me a story."}],
        n=3,
        seed=5,
        temperature=1.0,
        max_tokens=16,
    )
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    texts = [(c.message.content, extra(c.message)) for c in a.choices]
    assert texts == [(c.message.content, extra(c.message)) for c in b.choices]
    assert len(set(texts)) == 3
    assert a.usage.completion_tokens <= 48


def extra(message: Any) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


def test_tools_accepted_by_template(client: openai.OpenAI, server: LiveServer) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = client.chat.completions.create(
        model="demo", messages=messages, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 100  # the tool schema and instructions are in the prompt


def test_eight_concurrent_greedy_streams_equal_sequential(server: LiveServer) -> None:
    prompts = [f"Request {i}: " + f"tell me about item {i}. " * (1 + i % 3) for i in range(8)]

    async def one(ac: httpx.AsyncClient, prompt: str) -> tuple[str, str]:
        body = {
            "model": "demo",
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0,
            "max_tokens": 24,
            "stream": True,
        }
        content, reasoning = "", ""
        async with ac.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        content += c["delta"].get("content") or ""
                        reasoning += c["delta"].get("reasoning_content") or ""
        return content, reasoning

    async def run(concurrent: bool) -> list[tuple[str, str]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as ac:
            if concurrent:
                return list(await asyncio.gather(*(one(ac, p) for p in prompts)))
            return [await one(ac, p) for p in prompts]

    scheduler = server.app.state.mtp.scheduler
    sequential = asyncio.run(run(False))
    concurrent = asyncio.run(run(True))
    assert concurrent == sequential
    assert len(set(sequential)) > 1
    assert scheduler.peak_running >= 4  # they shared the batch's cycles


def test_mid_stream_disconnect_cancels(server: LiveServer, http: httpx.Client) -> None:
    cancelled_before = metric(http, 'mtpserve_generations_total{outcome="cancelled"}')
    tokens_before = metric(http, "mtpserve_generation_tokens_total")
    body = {
        "model": "demo",
        "prompt": "Once upon a time",
        "max_tokens": 1500,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    with (
        httpx.Client(base_url=server.url, timeout=60) as c,
        c.stream("POST", "/v1/completions", json=body) as r,
    ):
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: {")
            if seen >= 3:
                break
    deadline = time.monotonic() + 20
    while metric(http, 'mtpserve_generations_total{outcome="cancelled"}') <= cancelled_before:
        assert time.monotonic() < deadline, "generation was not cancelled"
        time.sleep(0.05)
    assert metric(http, "mtpserve_generation_tokens_total") - tokens_before < 1500
    t0 = time.monotonic()
    r = http.post("/v1/completions", json={"model": "demo", "prompt": "hi", "max_tokens": 4})
    assert r.status_code == 200 and time.monotonic() - t0 < 10


@pytest.mark.fast
def test_sse_framing_and_usage_chunk(http: httpx.Client) -> None:
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 10,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    frames = raw.split("\n\n")[:-1]
    assert all(f.startswith("data: ") for f in frames)
    chunks = [json.loads(f[6:]) for f in frames[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and 1 <= usage["completion_tokens"] <= 10
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}


REAL_MALFORMED: list[tuple[str, str, Any, int]] = [
    ("invalid json", "/v1/chat/completions", b"{", 400),
    ("no messages", "/v1/chat/completions", {"model": "demo"}, 400),
    ("unknown model", "/v1/chat/completions", chat(model="../../etc"), 404),
    ("empty prompt", "/v1/completions", {"model": "demo", "prompt": ""}, 400),
    ("id beyond vocab", "/v1/completions", {"model": "demo", "prompt": [320]}, 400),
    ("huge n", "/v1/chat/completions", chat(n=1_000_000), 400),
    ("negative temperature", "/v1/chat/completions", chat(temperature=-0.5), 400),
    (
        "nan top_p",
        "/v1/chat/completions",
        b'{"model":"demo","messages":[{"role":"user","content":"x"}],"top_p":NaN}',
        400,
    ),
    ("context exceeded", "/v1/chat/completions", chat(max_tokens=100_000), 400),
    (
        "prompt alone exceeds context",
        "/v1/completions",
        {"model": "demo", "prompt": [5] * 2100, "max_tokens": 1},
        400,
    ),
    ("logit bias out of vocab", "/v1/chat/completions", chat(logit_bias={"320": 1}), 400),
    ("draft tokens too many", "/v1/chat/completions", chat(draft_tokens=30), 400),
    (
        "bad content part",
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": [{"type": "input_audio"}]}]),
        400,
    ),
]


@pytest.mark.parametrize(
    "name,path,body,status", REAL_MALFORMED, ids=[m[0] for m in REAL_MALFORMED]
)
def test_malformed_then_next_request_served(
    http: httpx.Client, name: str, path: str, body: Any, status: int
) -> None:
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    ok = http.post("/v1/chat/completions", json=chat())
    assert ok.status_code == 200, ok.text


def test_a_request_the_engine_refuses_counts_as_rejected(http: httpx.Client) -> None:
    """The engine's own checks (here K past 8) answer 400 and count as ``rejected``, not as
    the server's ``error``."""
    rejected = 'mtpserve_generations_total{outcome="rejected"}'
    errors = 'mtpserve_generations_total{outcome="error"}'
    before = metric(http, rejected), metric(http, errors)
    r = http.post("/v1/chat/completions", json=chat(draft_tokens=9))
    assert r.status_code == 400 and r.json()["error"]["param"] == "draft_tokens", r.text
    deadline = time.monotonic() + 10  # counted by the worker just after it answers
    while metric(http, rejected) < before[0] + 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (metric(http, rejected), metric(http, errors)) == (before[0] + 1, before[1])


@pytest.mark.parametrize(
    "body",
    [
        chat(top_k=100_000),
        chat(top_k=1),
        chat(temperature=0, n=2),
        chat(min_p=1.0),
        chat(repetition_penalty=10, presence_penalty=2, frequency_penalty=-2, top_p=1e-9),
        chat(logit_bias={"5": 100, "6": -100}),
        chat(draft_tokens=0),
        chat(stop=["a", "b", "c"]),
    ],
    ids=[
        "top_k>=vocab",
        "top_k=1",
        "greedy n=2",
        "min_p=1",
        "extreme penalties",
        "logit_bias",
        "K=0",
        "stops",
    ],
)
def test_edge_sampling_values_are_served(http: httpx.Client, body: dict) -> None:
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_metrics_show_the_draft_length_in_use(client: openai.OpenAI, http: httpx.Client) -> None:
    client.completions.create(
        model="demo",
        prompt="def add(a, b):",
        max_tokens=24,
        temperature=0,
        extra_body={"draft_tokens": 3, "ignore_eos": True},
    )
    assert metric(http, 'mtpserve_spec_cycles_by_draft_tokens_total{k="3"}') > 0
    assert metric(http, "mtpserve_spec_draft_tokens_mean") > 0
