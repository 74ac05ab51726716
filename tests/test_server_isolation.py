"""One bad request never hurts another: the real engine behind real uvicorn, with hostile
requests next to innocent ones.

Every innocent request's output must equal its output alone (rows are independent), a hostile
request gets its own 4xx in its API's shape, and the server keeps serving.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_engine import LiveServer

from server.app import create_app
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
        return Engine.load(str(tiny_checkpoint), draft_tokens=2)

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
