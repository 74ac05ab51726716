"""One bad request never hurts another: the real engine behind real uvicorn, with hostile
requests next to innocent ones.

Every innocent request's output must equal its output alone (rows are independent), a hostile
request gets its own 4xx in its API's shape, and the server keeps serving.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_engine import LiveServer, metric

from server.app import create_app
from server.core.finite import loads_strict
from server.settings import ServerSettings

#: Schemas llguidance compiles whose grammar allows no complete JSON: no first token at all,
#: and a dead end after ``{"a": `` (a property that is itself forever).
NO_FIRST_TOKEN = {"$ref": "#"}
DEAD_END_LATER = {
    "type": "object",
    "properties": {"a": {"$ref": "#/properties/a"}},
    "required": ["a"],
}


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path):
    from engine.runtime import Engine

    settings = ServerSettings(model=str(tiny_checkpoint), served_model_names=["demo"], max_batch=8)

    def load() -> Any:
        engine = Engine.load(str(tiny_checkpoint), draft_tokens=2)
        engine.enable_prefix_cache(64 << 20)
        return engine

    app = create_app(load, settings)
    with LiveServer(app) as srv:
        srv.engine = app.state.mtp.engine
        yield srv


def chat_body(text: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "demo",
        "messages": [{"role": "user", "content": text}],
        "temperature": 0,
        "max_tokens": 48,
        "ignore_eos": True,
        **extra,
    } | {"chat_template_kwargs": {"enable_thinking": False}}


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def post(http: httpx.Client, body: dict[str, Any], path: str = "/v1/chat/completions") -> Any:
    return http.post(path, json=body)


INNOCENT = [f"Tell me story number {i} about a lighthouse." for i in range(4)]


def test_unsatisfiable_grammar_is_refused_at_admission(http: httpx.Client) -> None:
    r = post(http, chat_body("hi", response_format=schema_format(NO_FIRST_TOKEN)))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "unsatisfiable_grammar"
    streamed = post(
        http, chat_body("hi", stream=True, response_format=schema_format(NO_FIRST_TOKEN))
    )
    assert streamed.status_code == 400, streamed.text
    # a thinking reply: free reasoning first, so it is the answer's grammar that is asked
    thinking = chat_body("hi", response_format=schema_format(NO_FIRST_TOKEN))
    thinking["chat_template_kwargs"] = {"enable_thinking": True}
    r = post(http, thinking)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "unsatisfiable_grammar"


def test_a_grammar_dead_end_fails_its_own_row_only(server: LiveServer, http: httpx.Client) -> None:
    alone = [post(http, chat_body(t)).json()["choices"][0]["message"]["content"] for t in INNOCENT]

    def run(body: dict[str, Any]) -> httpx.Response:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            return post(c, body)

    hostile = chat_body("json please", response_format=schema_format(DEAD_END_LATER))
    for _ in range(2):  # the hostile request first, then last: it shares cycles either way
        bodies = [hostile, *(chat_body(t) for t in INNOCENT)]
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(run, bodies))
        bad, *good = answers
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["code"] == "unsatisfiable_grammar"
        assert [r.status_code for r in good] == [200] * len(good)
        assert [r.json()["choices"][0]["message"]["content"] for r in good] == alone
    assert http.get("/health").json()["status"] == "ok"


# -- a web page must not drive the server (server.guard) ---------------------------------------


def test_a_cross_site_page_cannot_drive_the_server(server: LiveServer, http: httpx.Client) -> None:
    body = json.dumps(chat_body("hi", max_tokens=2))
    # the "simple request" any page may send without asking the browser first
    plain = http.post(
        "/v1/chat/completions",
        content=body,
        headers={"content-type": "text/plain", "origin": "https://evil.example"},
    )
    assert plain.status_code == 403, plain.text
    assert plain.json()["error"]["code"] == "origin_not_allowed"
    # text/plain without an Origin (curl -d): still not JSON
    unlabeled = http.post(
        "/v1/chat/completions", content=body, headers={"content-type": "text/plain"}
    )
    assert unlabeled.status_code == 415
    assert unlabeled.json()["error"]["type"] == "invalid_request_error"
    # Anthropic's shape on /v1/messages
    msg = http.post("/v1/messages", content=b"{}", headers={"content-type": "text/plain"})
    assert msg.status_code == 415 and msg.json()["type"] == "error"
    # DNS rebinding: the attacker's name resolving to 127.0.0.1
    rebound = http.post(
        "/v1/chat/completions",
        content=body,
        headers={"host": "evil.example", "content-type": "application/json"},
    )
    assert rebound.status_code == 403, rebound.text
    assert rebound.json()["error"]["code"] == "host_not_allowed"
    assert (
        http.get("/v1/models", headers={"host": f"evil.example:{server.port}"}).status_code == 403
    )


def test_the_chat_page_and_plain_clients_still_work(server: LiveServer, http: httpx.Client) -> None:
    # the chat page: same origin as the server, by IP or by name
    for host in (f"127.0.0.1:{server.port}", f"localhost:{server.port}"):
        r = http.post(
            "/v1/chat/completions",
            json=chat_body("hi", max_tokens=2),
            headers={"host": host, "origin": f"http://{host}"},
        )
        assert r.status_code == 200, r.text
    assert http.get("/", headers={"origin": f"http://127.0.0.1:{server.port}"}).status_code == 200
    # a JSON media type with parameters is JSON
    r = http.post(
        "/v1/chat/completions",
        content=json.dumps(chat_body("hi", max_tokens=2)),
        headers={"content-type": "application/json; charset=utf-8"},
    )
    assert r.status_code == 200, r.text


def test_allowed_hosts_and_origins_open_what_they_name(tiny_checkpoint: Path) -> None:
    from fake_engine import FakeEngine

    settings = ServerSettings(
        allowed_hosts=["llm.example"], allowed_origins=["https://app.example"]
    )
    with LiveServer(create_app(FakeEngine(), settings)) as srv, httpx.Client(base_url=srv.url) as c:
        assert c.get("/v1/models", headers={"host": "llm.example"}).status_code == 200
        assert c.get("/v1/models", headers={"host": "other.example"}).status_code == 403
        ok = c.get("/v1/models", headers={"origin": "https://app.example"})
        assert ok.status_code == 200
        assert c.get("/v1/models", headers={"origin": "https://b.example"}).status_code == 403


def test_missing_key_is_each_apis_own_401_and_an_open_bind_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from fake_engine import FakeEngine

    open_bind = ServerSettings(host="0.0.0.0")
    with (
        caplog.at_level("WARNING", logger="server.app"),
        LiveServer(create_app(FakeEngine(), open_bind)),
    ):
        pass
    assert any("without an API key" in r.getMessage() for r in caplog.records)
    caplog.clear()
    keyed = ServerSettings(host="0.0.0.0", api_key="sekrit")
    with (
        caplog.at_level("WARNING", logger="server.app"),
        LiveServer(create_app(FakeEngine(), keyed)) as srv,
        httpx.Client(base_url=srv.url) as c,
    ):
        assert not any("without an API key" in r.getMessage() for r in caplog.records)
        body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        anthropic = c.post("/v1/messages", json=body)
        assert anthropic.status_code == 401
        assert anthropic.json()["type"] == "error"
        assert anthropic.json()["error"]["type"] == "authentication_error"
        openai_style = c.post("/v1/chat/completions", json=body)
        assert openai_style.status_code == 401
        error = openai_style.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
        assert c.get("/v1/models", headers={"authorization": "Bearer sekrit"}).status_code == 200


# -- strict JSON in, finite JSON out (server.core.finite) --------------------------------------

NUMBER_TOOL = {
    "name": "get_weather",
    "description": "Weather forecast",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "number"}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def fake_server():
    from fake_engine import FakeEngine

    with LiveServer(create_app(FakeEngine(), ServerSettings())) as srv:
        yield srv


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999"])
@pytest.mark.fast
def test_non_finite_numbers_in_a_request_are_refused(fake_server: LiveServer, number: str) -> None:
    tool = {
        "type": "function",
        "name": "f",
        "parameters": {"type": "object", "properties": {"x": {"type": "number", "maximum": 0}}},
    }
    raw = json.dumps(
        {"model": "fake-model", "input": "hi", "max_output_tokens": 4, "tools": [tool]}
    )
    raw = raw.replace('"maximum": 0', f'"maximum": {number}')
    with httpx.Client(base_url=fake_server.url, timeout=60) as c:
        r = c.post("/v1/responses", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "invalid_json"
        chat = raw.replace('"input": "hi"', '"messages": [], "temperature": ' + number)
        r = c.post(
            "/v1/chat/completions", content=chat, headers={"content-type": "application/json"}
        )
        assert r.status_code == 400, r.text


@pytest.mark.fast
def test_a_huge_number_the_model_writes_stays_json(fake_server: LiveServer) -> None:
    body = {
        "model": "fake-model",
        "max_tokens": 200,
        "tools": [NUMBER_TOOL],
        "messages": [{"role": "user", "content": "TRIGGER_HUGE_NUMBER"}],
    }
    with httpx.Client(base_url=fake_server.url, timeout=60) as c:
        r = c.post("/v1/messages", json=body)
        assert r.status_code == 200, r.text
        call = next(b for b in r.json()["content"] if b["type"] == "tool_use")
        assert call["input"] == {"city": "Paris", "days": "1e999"}
        with c.stream("POST", "/v1/messages", json=body | {"stream": True}) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
        chat = {
            **body,
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "parameters": NUMBER_TOOL["input_schema"]},
                }
            ],
            "stream": True,
        }
        with c.stream("POST", "/v1/chat/completions", json=chat) as s:
            lines += [line for line in s.iter_lines() if line.startswith("data: {")]
    for line in lines:  # every event is strict JSON
        assert loads_strict(line[6:]) is not None, line
    assert any("1e999" in line for line in lines)


# -- sampling ------------------------------------------------------------------------------------


def test_a_tiny_temperature_is_greedy(http: httpx.Client) -> None:
    def text(temperature: float) -> str:
        body = chat_body("Tell me about the sea.", temperature=temperature, seed=7, max_tokens=24)
        r = post(http, body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    greedy = text(0)
    assert [text(t) for t in (1e-40, 1e-30, 1e-6)] == [greedy] * 3


# -- refusals before a stream starts; n choices share one prefill --------------------------------


def test_a_request_the_engine_refuses_is_refused_before_its_stream(http: httpx.Client) -> None:
    for stream in (False, True):
        r = post(http, chat_body("hi", draft_tokens=12, stream=stream))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "draft_tokens"


def test_n_choices_prefill_their_prompt_once(http: httpx.Client) -> None:
    prompt = "A prompt no other test sends, long enough to be worth sharing: " + "tide " * 40
    body = chat_body(prompt, n=3, temperature=1.0, seed=3, max_tokens=8)
    reused = metric(http, "mtpserve_prompt_cache_reused_tokens_total")
    r = post(http, body)
    assert r.status_code == 200, r.text
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    # choices 2 and 3 restore what choice 1 prefilled (all but the prompt's last token)
    delta = metric(http, "mtpserve_prompt_cache_reused_tokens_total") - reused
    assert delta == 2 * (prompt_tokens - 1)
    texts = [c["message"]["content"] for c in r.json()["choices"]]
    alone = post(http, chat_body(prompt, temperature=1.0, seed=4, max_tokens=8)).json()
    assert alone["choices"][0]["message"]["content"] == texts[1]


# -- limits before tokenizing, tokenizing off the event loop -----------------------------------


@pytest.fixture
def encode_threads(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The threads the server's tokenizer encoded on, from now on."""
    import threading

    tokenizer = server.engine.tokenizer
    encode = tokenizer.encode
    threads: list[str] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return encode(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", recording)
    return threads


def test_cheap_limits_come_before_tokenizing(
    server: LiveServer, http: httpx.Client, encode_threads: list[str]
) -> None:
    many = {"model": "demo", "prompt": ["one more prompt"] * 20_000, "max_tokens": 1}
    r = post(http, many, "/v1/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert encode_threads == []
    from server.core.chat_format import longest_token_chars

    # more characters than the context can hold at the longest token's length
    engine = server.engine
    huge = "x" * (engine.context_length * longest_token_chars(engine.tokenizer) + 1)
    r = post(http, {"model": "demo", "prompt": huge, "max_tokens": 1}, "/v1/completions")
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert encode_threads == []


def test_prompts_are_tokenized_off_the_event_loop(
    server: LiveServer, http: httpx.Client, encode_threads: list[str]
) -> None:
    assert post(http, chat_body("hi", max_tokens=1)).status_code == 200
    assert post(http, {"model": "demo", "prompt": "hi", "max_tokens": 1}, "/v1/completions")
    anthropic = {"model": "demo", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    assert post(http, anthropic, "/v1/messages").status_code == 200
    assert post(http, {"model": "demo", "input": "hi", "max_output_tokens": 1}, "/v1/responses")
    assert len(encode_threads) >= 4
    assert server.thread.name not in encode_threads


# -- nothing slow between the batch's steps -----------------------------------------------------


def test_grammars_compile_and_cache_files_are_written_off_the_engine_thread(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from engine.cache import disk_writer
    from engine.runtime import Engine
    from sampling import constraint

    threads: dict[str, list[str]] = {"grammar": [], "disk": []}
    compile_grammar = constraint.TokenConstraint.__init__
    write_file = disk_writer._write_file

    def recording_compile(self: Any, *args: Any) -> None:
        threads["grammar"].append(threading.current_thread().name)
        compile_grammar(self, *args)

    def recording_write(*args: Any) -> None:
        threads["disk"].append(threading.current_thread().name)
        write_file(*args)

    monkeypatch.setattr(constraint.TokenConstraint, "__init__", recording_compile)
    monkeypatch.setattr(disk_writer, "_write_file", recording_write)

    def load() -> Any:
        engine = Engine.load(str(tiny_checkpoint), draft_tokens=2)
        engine.enable_prefix_cache(64 << 20, tmp_path)
        return engine

    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    app = create_app(load, ServerSettings(served_model_names=["demo"]))
    with LiveServer(app) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        r = post(c, chat_body("json", n=2, response_format=schema_format(schema)))
        assert r.status_code == 200, r.text
        assert post(c, chat_body("x " * 300, max_tokens=4)).status_code == 200
        app.state.mtp.engine.prefix_cache.writer.drain()  # the files handed over are written
    assert threads["grammar"] and threads["disk"]
    assert "mtpserve-engine" not in threads["grammar"] + threads["disk"]
