"""Every endpoint fuzzed from the app's own /openapi.json with schemathesis, bounded.

A real uvicorn serves the scripted FakeEngine (a short context, so any generated ``max_tokens``
stays cheap). Valid bodies get the served model's name (any other name is a correct 404), so
they reach the engine. schemathesis generates valid and invalid bodies for each operation from the
published request schemas; every answer must be below 500, every error must come in its API's
own shape (Anthropic's for /v1/messages*, OpenAI's elsewhere), and after the run the worker
thread is alive and a plain request is still served. The example count is bounded so the run
stays short; generation is derandomized so a failure reproduces.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from fake_engine import FakeEngine, LiveServer
from hypothesis import HealthCheck, given, settings
from schemathesis.generation import GenerationMode

from server.app import create_app
from server.settings import ServerSettings

EXAMPLES_PER_OPERATION = 8
#: statuses of the generated valid POST bodies, checked when the server stops
VALID_POST_STATUSES: list[int] = []


@pytest.fixture(scope="module")
def fuzzed_server():
    app = create_app(
        FakeEngine(context_length=160),
        ServerSettings(max_n=2, default_max_tokens=8, max_body_bytes=64 * 1024),
    )
    with LiveServer(app) as srv:
        yield srv
        if VALID_POST_STATUSES:  # valid bodies did reach the engine, not only the validators
            assert VALID_POST_STATUSES.count(200) >= 5, VALID_POST_STATUSES
        assert app.state.mtp.scheduler.alive, "the worker died during fuzzing"
        ok = httpx.post(
            srv.url + "/v1/chat/completions",
            json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert ok.status_code == 200, ok.text


@pytest.fixture(scope="module")
def api_schema(fuzzed_server: LiveServer):
    return schemathesis.openapi.from_url(fuzzed_server.url + "/openapi.json")


POSTS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/tokenize",
    "/detokenize",
]
#: (method, path, generation mode): request bodies valid and invalid; GETs have nothing invalid
CASES = [("POST", p, m) for p in POSTS for m in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
GETS = ("/v1/models", "/v1/models/{model_id}", "/tokenizer_info")
CASES += [("GET", p, GenerationMode.POSITIVE) for p in GETS]


def test_openapi_document_types_every_request_body(fuzzed_server: LiveServer) -> None:
    doc = httpx.get(fuzzed_server.url + "/openapi.json").json()
    posts = {path: ops["post"] for path, ops in doc["paths"].items() if "post" in ops}
    assert set(posts) == set(POSTS)
    for path, op in posts.items():
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        name = ref.rsplit("/", 1)[1]
        assert doc["components"]["schemas"][name]["required"], path


@pytest.mark.parametrize("method,path,mode", CASES, ids=[f"{m} {p} {g.value}" for m, p, g in CASES])
def test_fuzzed_requests_never_5xx_and_errors_keep_their_shape(
    api_schema, method: str, path: str, mode: GenerationMode
) -> None:
    operation = api_schema[path][method]
    statuses = VALID_POST_STATUSES if (method, mode) == ("POST", GenerationMode.POSITIVE) else []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def check(case) -> None:
        if mode is GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = "fake-model"  # any other name is a (correct) 404
        response = case.call(timeout=30)
        statuses.append(response.status_code)
        assert response.status_code < 500, (case.path, case.body, response.text)
        if response.status_code < 400:
            return
        body = response.json()
        if path.startswith("/v1/messages"):
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        else:
            assert set(body["error"]) == {"message", "type", "param", "code"}, body

    check()
