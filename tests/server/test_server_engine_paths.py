"""Server behaviours against the real engine, black box over HTTP (real uvicorn on loopback).

tests/server/test_server_api.py proves these paths exactly against a scripted fake engine; here they
run once each through the real engine, with assertions on content:

* a **scripted** bigram checkpoint (tests/bigram_checkpoint.py: the real engine on weights that
  make greedy decoding write a chosen text, speculating K=2 with every draft accepted) for
  reasoning split, tool-call parsing and streaming, stop strings on chat, an engine error
  mid-stream and non-streaming cancellation;
* the tiny random checkpoint for logprobs on both endpoints (against an independent mlx-lm
  forward), completions echo and batch prompts, and request fields reaching the sampler (the
  same request through a separately loaded engine gives the same tokens);
* a server with an API key, a queue of one and a small body limit: 401 / 429 / 413 next to
  served requests.

Only the public HTTP API is used (plus the engine object, to inject one fault).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from bigram_checkpoint import DEMO_MODEL, script_transitions, write_bigram_checkpoint
from fake_engine import LiveServer, metric
from reference_logprobs import independent_logprobs

from engine.api import GenerationEvent
from server.app import create_app
from server.settings import ServerSettings

THINKING_REPLY = (
    "User wants one file</think>Let me check<tool_call><function=read_file><parameter=file>"
    "notes.txt</parameter></function>\n</tool_call>"
)
PLAIN_REPLY = "It is sunny and mild today"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {
                "type": "object",
                "properties": {"file": {"type": "string"}},
                "required": ["file"],
            },
        },
    }
]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def scripted_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Greedy replies: THINKING_REPLY after the thinking generation prompt (which ends in
    "<think>\\n"), PLAIN_REPLY after the non-thinking one (ends in "</think>\\n\\n")."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_MODEL))
    opens = tokenizer.encode("<think>\n", add_special_tokens=False)[-1]
    closes = tokenizer.encode("</think>\n\n", add_special_tokens=False)[-1]
    transitions, _ = script_transitions(tokenizer, {opens: THINKING_REPLY, closes: PLAIN_REPLY})
    return write_bigram_checkpoint(tmp_path_factory.mktemp("scripted"), transitions)


def serve(model_dir: Path, **settings: Any) -> LiveServer:
    from engine.runtime import Engine

    config = ServerSettings(model=str(model_dir), served_model_names=["m"], **settings)
    app = create_app(lambda: Engine.load(str(model_dir), draft_tokens=2), config)
    srv = LiveServer(app)
    srv.engine = app.state.mtp.engine
    return srv


@pytest.fixture(scope="module")
def server(scripted_checkpoint: Path):
    with serve(scripted_checkpoint) as srv:
        yield srv


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def ask(content: str = "Which file?") -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


# ---- the scripted engine ----------------------------------------------------------------------
@pytest.mark.fast
def test_reasoning_content_and_tool_call(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="m", messages=ask(), tools=TOOLS, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"] == "User wants one file"
    assert choice.message.content == "Let me check"
    (call,) = choice.message.tool_calls
    assert call.function.name == "read_file" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"file": "notes.txt"}
    spec = r.usage.model_extra["speculative"]
    assert spec["accepted"] == spec["proposed"] > 0  # the engine speculated (K=2)


def test_tool_call_streamed(client: openai.OpenAI) -> None:
    reasoning = content = name = arguments = ""
    finish = None
    for chunk in client.chat.completions.create(
        model="m", messages=ask(), tools=TOOLS, temperature=0, stream=True
    ):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                name += tc.function.name or ""
                arguments += tc.function.arguments or ""
    assert (reasoning, content, name) == ("User wants one file", "Let me check", "read_file")
    assert json.loads(arguments) == {"file": "notes.txt"} and finish == "tool_calls"


def test_stop_string_on_chat(client: openai.OpenAI) -> None:
    kw = dict(model="m", messages=ask("Weather?"), temperature=0, extra_body=NO_THINK)
    full = client.chat.completions.create(**kw)
    assert full.choices[0].message.content == PLAIN_REPLY
    cut = client.chat.completions.create(**kw, stop=["mild", "never"])
    assert cut.choices[0].message.content == "It is sunny and "
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < full.usage.completion_tokens
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**kw, stop="mild", stream=True)
        if c.choices
    )
    assert streamed == "It is sunny and "


def test_engine_error_mid_stream(server: LiveServer, http: httpx.Client) -> None:
    """A row of the batch (``Engine.row_steps``, which the server's batch drives) fails after
    two events."""
    engine = server.engine
    real_steps = engine.row_steps

    def failing(request, *args, **kwargs):
        steps = real_steps(request, *args, **kwargs)
        item, events = next(steps), 0
        while True:
            if isinstance(item, GenerationEvent):
                events += 1
                if events == 3:
                    raise RuntimeError("injected failure after two cycles")
            try:
                item = steps.send((yield item))
            except StopIteration:
                return

    engine.row_steps = failing
    try:
        body = {"model": "m", "messages": ask(), "stream": True, "temperature": 0} | NO_THINK
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            raw = r.read().decode()
    finally:
        engine.row_steps = real_steps
    frames = [f[6:] for f in raw.split("\n\n") if f.startswith("data: ")]
    text = "".join(
        c["delta"].get("content") or ""
        for f in frames
        if f.startswith("{") and "choices" in json.loads(f)
        for c in json.loads(f)["choices"]
    )
    assert text and PLAIN_REPLY.startswith(text) and text != PLAIN_REPLY  # two cycles' text
    errors = [json.loads(f)["error"] for f in frames if f.startswith("{") and "error" in f]
    assert errors and errors[-1]["type"] == "server_error"
    ok = http.post("/v1/chat/completions", json={"model": "m", "messages": ask()} | NO_THINK)
    assert ok.json()["choices"][0]["message"]["content"] == PLAIN_REPLY


def test_non_streaming_disconnect_cancels(server: LiveServer, http: httpx.Client) -> None:
    cancelled = 'mtpserve_generations_total{outcome="cancelled"}'
    before, tokens_before = (
        metric(http, cancelled),
        metric(http, "mtpserve_generation_tokens_total"),
    )
    body = {"model": "m", "prompt": "x", "max_tokens": 1900, "ignore_eos": True, "temperature": 0}
    with httpx.Client(base_url=server.url, timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json=body)
    wait_for(lambda: metric(http, cancelled) > before)
    assert metric(http, "mtpserve_generation_tokens_total") - tokens_before < 1900


# ---- the tiny random checkpoint ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_server(tiny_checkpoint: Path):
    with serve(tiny_checkpoint) as srv:
        yield srv


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_checkpoint: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_checkpoint))


@pytest.mark.fast
def test_logprobs_on_both_endpoints_equal_an_independent_forward(
    tiny_server: LiveServer, tiny_checkpoint: Path, load_engine
) -> None:
    """Sampled, K=2. The emitted ids come from a separately loaded engine on the same request
    (equal tokens: the test below); every value is checked against the plain forward."""
    from engine.api import GenerationRequest
    from engine.runtime import chat_prompt_ids
    from sampling.params import SamplingOverrides, resolve

    reference = load_engine("dense-tied", draft_tokens=0)
    params = resolve(reference.sampling_defaults, SamplingOverrides(temperature=1.5, seed=2))
    sdk = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0)
    extra = {"ignore_eos": True, "draft_tokens": 2}
    common = dict(model="m", max_tokens=12, temperature=1.5, seed=2)
    text_prompt = reference.tokenizer.encode("def add(a, b):")
    chat_prompt = chat_prompt_ids(reference.tokenizer, ask("hi"), enable_thinking=False)
    completion = sdk.completions.create(prompt=text_prompt, logprobs=3, extra_body=extra, **common)
    chat = sdk.chat.completions.create(
        messages=ask("hi"), logprobs=True, top_logprobs=3, extra_body=extra | NO_THINK, **common
    )
    assert chat.usage.prompt_tokens == len(chat_prompt)
    lp, items = completion.choices[0].logprobs, chat.choices[0].logprobs.content
    for prompt, chosen, tops in (
        (text_prompt, lp.token_logprobs, [sorted(t.values())[::-1] for t in lp.top_logprobs]),
        (
            chat_prompt,
            [i.logprob for i in items],
            [[t.logprob for t in i.top_logprobs] for i in items],
        ),
    ):
        request = GenerationRequest(prompt, params, 12, draft_tokens=2, ignore_eos=True)
        generated = [t for e in reference.generate(request) for t in e.token_ids]
        rows = independent_logprobs(tiny_checkpoint, prompt, generated)
        assert len(generated) == 12
        # chat's logprobs are its content's: newlines that open the reply are not content
        skip = 0
        if prompt is chat_prompt:
            text = reference.tokenizer.decode
            while skip < len(generated) and not text([generated[skip]]).strip("\n"):
                skip += 1
        assert len(chosen) == len(generated) - skip
        for i, token in enumerate(generated[skip:], start=skip):
            assert chosen[i - skip] == pytest.approx(rows[i, token], abs=2e-3)
            best = np.sort(rows[i])[::-1][:3]
            assert all(np.isclose(best, v, atol=2e-3).any() for v in tops[i - skip])
            assert len(tops[i - skip]) == 3 or prompt is text_prompt  # (texts may collide)


def test_completions_echo_and_batch_prompts(tiny_server: LiveServer, tiny_tokenizer) -> None:
    sdk = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0)
    prompts = ["def add(a, b):", "The quick brown fox"]
    batch = sdk.completions.create(model="m", prompt=prompts, max_tokens=8, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    alone = [
        sdk.completions.create(model="m", prompt=p, max_tokens=8, temperature=0).choices[0].text
        for p in prompts
    ]
    assert [c.text for c in batch.choices] == alone and alone[0] != alone[1]
    echoed = sdk.completions.create(
        model="m", prompt=prompts[1], max_tokens=8, temperature=0, echo=True
    )
    assert echoed.choices[0].text == prompts[1] + alone[1]
    n_prompt = sum(len(tiny_tokenizer.encode(p)) for p in prompts)
    assert batch.usage.prompt_tokens == n_prompt


def test_completions_echo_with_logprobs_scores_the_prompt_as_evaluation_harnesses_read_it(
    tiny_server: LiveServer, tiny_checkpoint: Path
) -> None:
    """lm-evaluation-harness's ``local-completions`` scores a continuation by sending context +
    continuation as the prompt with ``echo``, ``logprobs`` 1 and ``max_tokens`` 1, and summing
    ``token_logprobs[len(context):-1]``: every prompt token after the first carries its logprob
    after the tokens before it (the first none), as an independent forward gives them, streamed
    or not, and with ``max_tokens`` 0 (older harnesses) the prompt alone (with the conversation
    cache: tests/engine/test_prefix_cache.py)."""
    sdk = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0)
    context = [11, 200, 31, 7, 45, 99, 12, 5, 301, 42, 77, 150]  # (a 320-token vocabulary)
    continuation = [64, 3, 250, 18, 90]
    prompt = context + continuation
    rows = independent_logprobs(tiny_checkpoint, prompt[:1], prompt[1:])
    want = [rows[i, token] for i, token in enumerate(prompt[1:])]
    # the harness's payload
    payload = dict(model="m", prompt=[prompt], temperature=0, max_tokens=1, seed=1234)
    scored = sdk.completions.create(logprobs=1, echo=True, **payload)
    lp = scored.choices[0].logprobs
    assert len(lp.token_logprobs) == len(prompt) + 1 == len(lp.tokens) == len(lp.top_logprobs)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1 : len(prompt)] == pytest.approx(want, abs=2e-3)
    for i, top in enumerate(lp.top_logprobs[1 : len(prompt)]):
        assert list(top.values()) == pytest.approx([rows[i].max()], abs=2e-3)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # what the harness computes from it
    total = sum(lp.token_logprobs[len(context) : -1])
    assert total == pytest.approx(sum(want[len(context) - 1 :]), abs=1e-2)
    # max_tokens 0 (the form older harnesses send): the prompt alone, scored alike
    alone = sdk.completions.create(logprobs=1, echo=True, **payload | {"max_tokens": 0})
    assert alone.choices[0].text == scored.choices[0].text[: len(alone.choices[0].text)]
    assert alone.choices[0].logprobs.token_logprobs == lp.token_logprobs[: len(prompt)]
    assert alone.usage.completion_tokens == 0 and alone.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        sdk.completions.create(**payload | {"max_tokens": 0})
    # no logprobs asked: none given; streamed: the echo chunk carries the prompt's
    assert sdk.completions.create(echo=True, **payload).choices[0].logprobs is None
    chunks = list(sdk.completions.create(logprobs=1, echo=True, stream=True, **payload))
    assert chunks[0].choices[0].text == scored.choices[0].text[: len(chunks[0].choices[0].text)]
    assert chunks[0].choices[0].logprobs.token_logprobs == lp.token_logprobs[: len(prompt)]


def test_vllm_tokenizer_endpoints_tokenize_as_the_served_model(
    tiny_server: LiveServer, tiny_tokenizer
) -> None:
    """``/tokenizer_info``, ``/tokenize`` and ``/detokenize`` as vLLM answers them, which
    lm-evaluation-harness checks for (an ``eos_token`` in the info, a token list from
    ``/tokenize``) before it tokenizes on the server instead of fetching the tokenizer: the
    served model's own ids, which ``/v1/completions`` takes as the text itself."""
    http = httpx.Client(base_url=tiny_server.url, timeout=60)
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == tiny_tokenizer.eos_token
    assert info["chat_template"] == tiny_tokenizer.chat_template
    text = "def add(a, b):\n    return a + b"
    got = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert got["tokens"] == ids and got["count"] == len(ids) and got["max_model_len"] > len(ids)
    strs = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert "".join(strs["token_strs"]) == text
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": text}
    sdk = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0)
    as_text = sdk.completions.create(model="m", prompt=text, max_tokens=6, temperature=0)
    as_ids = sdk.completions.create(model="m", prompt=ids, max_tokens=6, temperature=0)
    assert as_text.choices[0].text == as_ids.choices[0].text
    for path, body, param in (
        ("/tokenize", {"messages": ask("x")}, "prompt"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
    ):
        r = http.post(path, json=body)
        assert 400 <= r.status_code < 500 and r.json()["error"]["param"] == param, (path, body)


SAMPLERS = {
    "greedy-penalties-bias": {
        "temperature": 0,
        "presence_penalty": 2.0,
        "frequency_penalty": 1.0,
        "repetition_penalty": 3.0,
        "logit_bias": {"5": 8.0},
    },
    # 2: the highest temperature OpenAI's API (and this server) takes
    "sampled-truncated": {"temperature": 2.0, "top_k": 5, "top_p": 0.9, "min_p": 0.05, "seed": 7},
    "sampled-penalties": {
        "temperature": 2.0,
        "presence_penalty": 2.0,
        "repetition_penalty": 3.0,
        "seed": 8,
    },
}


def test_request_fields_reach_the_sampler(
    tiny_server: LiveServer, tiny_checkpoint: Path, load_engine
) -> None:
    """The same request through a separately loaded engine (same checkpoint, sampler resolved
    from the checkpoint's defaults and the request) emits the same tokens, and every setting
    changes them. Compared by each token's logprob: equal tokens give equal values."""
    from engine.api import GenerationRequest
    from sampling.params import SamplingOverrides, resolve

    reference = load_engine("dense-tied", draft_tokens=0)
    prompt = reference.tokenizer.encode("def add(a, b):")
    outputs = []
    with httpx.Client(base_url=tiny_server.url, timeout=60) as http:
        for fields in [{"seed": 1}, *SAMPLERS.values()]:
            body = {"model": "m", "prompt": prompt, "max_tokens": 16, "logprobs": 0}
            body |= {"ignore_eos": True, "draft_tokens": 2, **fields}
            got = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
            bias = {int(t): v for t, v in fields.get("logit_bias", {}).items()}
            overrides = {k: v for k, v in fields.items() if k != "logit_bias"}
            params = resolve(reference.sampling_defaults, SamplingOverrides(**overrides))
            if bias:
                from dataclasses import replace

                params = replace(params, logit_bias=bias)
            request = GenerationRequest(
                prompt, params, 16, draft_tokens=2, ignore_eos=True, top_logprobs=0
            )
            expected = [lp.logprob for e in reference.generate(request) for lp in e.logprobs]
            assert got["token_logprobs"] == pytest.approx(expected, abs=1e-4), fields
            outputs.append(tuple(got["tokens"]))
    assert len(set(outputs)) == len(outputs)


# ---- a server with an API key, one row, a queue of one and a small body limit ----------------
@pytest.fixture(scope="module")
def guarded_server(scripted_checkpoint: Path):
    settings = {"max_queue": 1, "max_batch": 1, "max_body_bytes": 4096}
    with serve(scripted_checkpoint, api_key="sekrit", **settings) as srv:
        yield srv


def test_api_key_queue_full_and_body_too_large(guarded_server: LiveServer) -> None:
    key = {"Authorization": "Bearer sekrit"}
    body = {"model": "m", "messages": ask("Weather?"), "temperature": 0} | NO_THINK

    async def main(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as ac:
            r = await ac.post("/v1/chat/completions", json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = await ac.post("/v1/chat/completions", json=body, headers=key)
            assert r.json()["choices"][0]["message"]["content"] == PLAIN_REPLY
            big = body | {"messages": ask("x" * 8192)}
            r = await ac.post("/v1/chat/completions", json=big, headers=key)
            assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

            long = {"model": "m", "prompt": "x", "max_tokens": 1900, "ignore_eos": True}
            async with ac.stream(
                "POST", "/v1/completions", json=long | {"stream": True}, headers=key
            ) as running:
                lines = running.aiter_lines()
                while not (await anext(lines)).startswith("data: {"):
                    pass  # the first chunk: the long request holds the engine
                queued = asyncio.create_task(
                    ac.post("/v1/chat/completions", json=body, headers=key)
                )
                for _ in range(1500):
                    health = (await ac.get("/health")).json()
                    if health["queue_depth"] == 1:
                        break
                    await asyncio.sleep(0.02)
                assert health["queue_depth"] == 1
                rejected = await ac.post("/v1/chat/completions", json=body, headers=key)
                assert rejected.status_code == 429
                assert rejected.headers["retry-after"] and rejected.json()["error"]["code"]
            # the stream is closed: the running request is cancelled, the queued one runs
            served = await queued
            assert served.json()["choices"][0]["message"]["content"] == PLAIN_REPLY

    asyncio.run(main(guarded_server.url))
