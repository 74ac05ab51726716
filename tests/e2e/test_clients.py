"""The client libraries people point at a local OpenAI- or Anthropic-compatible server, unchanged,
against one real server on the embedded demo model (``make test-clients``; part of ``make test``).

Versions are pinned in the ``clients`` extra of pyproject.toml, so a library that changes a type
or a request shape fails here first. Each test asserts the library's own result object (a
pydantic model from a structured-output call, an agent's final output, a tool the agent ran).
Every response body and stream event the server sent during the module is recorded at the ASGI
layer and, in the last test, validated: OpenAI's against the schemas of tests/openai_spec.py
(mirroring OpenAI's published OpenAPI document), Anthropic's against the ``anthropic`` SDK's own
types, strictly.

The demo model is not an assistant: what these tests hold is that each library's request is
served and its parse of the reply succeeds, with greedy decoding so that runs repeat. A library
that is not installed is a skip naming it (``pip install -e ".[clients]"``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any, Literal

import anthropic
import jsonschema_rs
import openai
import pydantic
import pytest
from fake_engine import LiveServer
from openai_spec import schema

from server.app import create_app
from server.settings import ServerSettings

# litellm reads its model price list from the network at import unless told to use its copy
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

DEMO = Path(__file__).resolve().parents[2] / "models" / "qwen3.5-demo"
QUESTION = "Is the sky blue?"
#: room for the demo model's short reasoning and a small JSON object or tool call
MAX_TOKENS = 200
GREEDY = {"temperature": 0}
#: the modules of the `clients` extra's libraries
LIBRARIES = (
    "instructor",
    "pydantic_ai",
    "langchain_openai",
    "langchain_anthropic",
    "agents",
    "litellm",
    "llm",
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]


class Answer(pydantic.BaseModel):
    answer: Literal["yes", "no"]


class Recorder:
    """ASGI middleware: passes every request through and keeps (path, status, body) of each
    HTTP response, streamed ones whole."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.exchanges: list[tuple[str, int, bytes]] = []

    async def __call__(
        self,
        scope: Scope,
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status, chunks = 0, []

        async def tee(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
            await send(message)

        await self.app(scope, receive, tee)
        self.exchanges.append((scope["path"], status, b"".join(chunks)))


def load_demo() -> Any:
    from engine.runtime import Engine

    engine = Engine.load(str(DEMO), draft_tokens=2)
    engine.enable_prefix_cache(64 << 20)  # as `mtpserve serve` does
    return engine


@pytest.fixture(scope="module")
def recorder() -> Recorder:
    return Recorder(create_app(load_demo, ServerSettings(model=str(DEMO))))


@pytest.fixture(scope="module")
def server(recorder: Recorder):
    with LiveServer(recorder) as srv:
        srv.model = recorder.app.state.mtp.names[0]
        yield srv


def needs(module: str) -> Any:
    """The library, or a skip that names the extra to install."""
    return pytest.importorskip(
        module, reason=f'{module} is not installed: pip install -e ".[clients]"'
    )


# ------------------------------------------------------------------------------------------
# instructor
# ------------------------------------------------------------------------------------------
def test_instructor_tools_json_schema_async_and_from_provider(server: LiveServer) -> None:
    instructor = needs("instructor")
    kw: dict[str, Any] = dict(
        model=server.model,
        response_model=Answer,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=MAX_TOKENS,
        max_retries=0,  # a reply that does not parse is a failure here, not a retry
        **GREEDY,
    )
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        patched = instructor.from_openai(client, mode=mode)
        assert isinstance(patched.chat.completions.create(**kw), Answer), mode

    async def run_async() -> Any:
        async_client = openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0
        )
        return await instructor.from_openai(async_client).chat.completions.create(**kw)

    assert isinstance(asyncio.run(run_async()), Answer)
    provided = instructor.from_provider(
        f"openai/{server.model}", base_url=server.url + "/v1", api_key="unused"
    )
    assert isinstance(provided.chat.completions.create(**kw), Answer)


# ------------------------------------------------------------------------------------------
# pydantic-ai
# ------------------------------------------------------------------------------------------
def test_pydantic_ai_output_type(server: LiveServer) -> None:
    needs("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    provider = OpenAIProvider(base_url=server.url + "/v1", api_key="unused")
    agent = Agent(
        OpenAIChatModel(server.model, provider=provider),
        output_type=Answer,
        model_settings=ModelSettings(max_tokens=MAX_TOKENS, **GREEDY),
    )
    assert isinstance(agent.run_sync(QUESTION).output, Answer)


def test_pydantic_ai_tools_beside_each_output_mode(server: LiveServer) -> None:
    """An agent with a tool and an output type, the output as a tool (pydantic-ai's default:
    tool_choice required over both tools) and as the API's own structured output
    (``NativeOutput``: the tools and ``response_format`` in one request); each run ends with an
    ``Answer``. (``PromptedOutput`` asks for any JSON object and leaves the schema to the
    prompt, which the demo model does not follow.)"""
    needs("pydantic_ai")
    from pydantic_ai import Agent, NativeOutput, ToolOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    provider = OpenAIProvider(base_url=server.url + "/v1", api_key="unused")
    for output in (ToolOutput(Answer), NativeOutput(Answer)):
        agent = Agent(
            OpenAIChatModel(server.model, provider=provider),
            output_type=output,
            model_settings=ModelSettings(max_tokens=MAX_TOKENS, **GREEDY),
        )

        @agent.tool_plain
        def look_up(topic: Literal["sky", "sea"]) -> str:
            """Facts about a topic."""
            return f"the {topic} is blue"

        result = agent.run_sync(QUESTION)
        assert isinstance(result.output, Answer), type(output).__name__


# ------------------------------------------------------------------------------------------
# langchain
# ------------------------------------------------------------------------------------------
def test_langchain_with_structured_output(server: LiveServer) -> None:
    needs("langchain_openai")
    needs("langchain_anthropic")
    from langchain_anthropic import ChatAnthropic
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model=server.model, base_url=server.url + "/v1", api_key="unused", max_tokens=MAX_TOKENS
    ).bind(**GREEDY)
    for method in ("json_schema", "function_calling"):
        structured = ChatOpenAI(
            model=server.model,
            base_url=server.url + "/v1",
            api_key="unused",
            max_tokens=MAX_TOKENS,
            temperature=0,
        ).with_structured_output(Answer, method=method)
        assert isinstance(structured.invoke(QUESTION), Answer), method
    assert isinstance(chat.invoke(QUESTION).content, str)

    claude = ChatAnthropic(
        model=server.model,
        base_url=server.url,
        api_key="unused",
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert isinstance(claude.with_structured_output(Answer).invoke(QUESTION), Answer)
    chunks = list(claude.stream(QUESTION))
    assert chunks and all(isinstance(c.content, str | list) for c in chunks)


# ------------------------------------------------------------------------------------------
# openai-agents: Chat Completions and Responses models, a tool round trip, streamed too
# ------------------------------------------------------------------------------------------
def agents_sdk() -> Any:
    """The openai-agents package, its tracing off (traces would go to OpenAI's servers)."""
    agents = needs("agents")
    agents.set_tracing_disabled(True)
    return agents


def agents_model(agents: Any, server: LiveServer, model_class: type) -> tuple[Any, Any]:
    """The served model as the Agents SDK's ``model_class`` on a client of its own, and the
    settings of a run whose first turn must call a tool (the SDK then resets tool_choice to
    auto), greedy and one call at a time."""
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    settings = agents.ModelSettings(
        tool_choice="required", parallel_tool_calls=False, max_tokens=MAX_TOKENS, **GREEDY
    )
    return model_class(model=server.model, openai_client=client), settings


def test_openai_agents_tool_round_trip_on_both_models(server: LiveServer) -> None:
    agents = agents_sdk()
    ran: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Lima"]) -> str:
        """The weather in a city."""
        ran.append(city)
        return f"sunny in {city}"

    async def run(model_class: type, streamed: bool) -> str:
        model, settings = agents_model(agents, server, model_class)
        agent = agents.Agent(
            name="weather",
            instructions="Answer with the weather tool.",
            tools=[get_weather],
            model=model,
            model_settings=settings,
            # streamed, the run ends with the tool's output: the demo model's free text after
            # it runs to max_tokens, which the SDK's stream treats as a failed turn
            tool_use_behavior="stop_on_first_tool" if streamed else "run_llm_again",
        )
        if not streamed:
            return (await agents.Runner.run(agent, "Weather in Paris?", max_turns=3)).final_output
        result = agents.Runner.run_streamed(agent, "Weather in Paris?", max_turns=3)
        kinds = {event.type async for event in result.stream_events()}
        assert "raw_response_event" in kinds
        return result.final_output

    for model_class in (agents.OpenAIChatCompletionsModel, agents.OpenAIResponsesModel):
        for streamed in (False, True):
            ran.clear()
            output = asyncio.run(run(model_class, streamed))
            assert ran in (["Paris"], ["Lima"]), (model_class, streamed, ran)
            assert isinstance(output, str), (model_class, streamed)
            if streamed:
                assert output == f"sunny in {ran[0]}"


def test_openai_agents_output_type_with_tools(server: LiveServer) -> None:
    """An agent with tools and an output type: after the required tool call the SDK sends the
    tools and the output type's schema together (tool_choice back to auto), and the model
    either calls a tool or answers in the schema; the run ends with an ``Answer``."""
    agents = agents_sdk()
    ran: list[str] = []

    @agents.function_tool
    def look_up(topic: Literal["sky", "sea"]) -> str:
        """Facts about a topic."""
        ran.append(topic)
        return f"the {topic} is blue"

    for model_class in (agents.OpenAIChatCompletionsModel, agents.OpenAIResponsesModel):
        ran.clear()
        model, settings = agents_model(agents, server, model_class)
        agent = agents.Agent(
            name="facts",
            instructions="Look the topic up, then answer.",
            tools=[look_up],
            output_type=Answer,
            model=model,
            model_settings=settings,
        )
        result = asyncio.run(agents.Runner.run(agent, QUESTION, max_turns=4))
        assert isinstance(result.final_output, Answer), model_class
        assert ran and set(ran) <= {"sky", "sea"}, (model_class, ran)


# ------------------------------------------------------------------------------------------
# litellm through its openai/ and anthropic/ providers
# ------------------------------------------------------------------------------------------
def test_litellm_openai_and_anthropic_providers(server: LiveServer) -> None:
    litellm = needs("litellm")
    messages = [{"role": "user", "content": QUESTION}]
    routes = {
        f"openai/{server.model}": server.url + "/v1",
        f"anthropic/{server.model}": server.url,
    }
    for model, base in routes.items():
        kw: dict[str, Any] = dict(
            model=model, api_base=base, api_key="unused", messages=messages, **GREEDY
        )
        reply = litellm.completion(max_tokens=24, **kw)
        assert reply.choices[0].finish_reason in ("stop", "length"), model
        assert reply.usage.completion_tokens > 0, model
        chunks = list(litellm.completion(max_tokens=24, stream=True, **kw))
        assert "".join(c.choices[0].delta.content or "" for c in chunks), model
        # JSON mode: a response_format (on anthropic/, a forced tool call)
        structured = litellm.completion(max_tokens=MAX_TOKENS, response_format=Answer, **kw)
        Answer.model_validate_json(structured.choices[0].message.content)


# ------------------------------------------------------------------------------------------
# llm (Simon Willison's CLI) with --schema
# ------------------------------------------------------------------------------------------
def test_llm_cli_schema(
    server: LiveServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    needs("llm")
    from click.testing import CliRunner
    from llm.cli import cli

    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: demo\n  model_name: {server.model}\n  api_base: {server.url}/v1\n"
        "  supports_schema: true\n"
    )
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path))
    args = ["-m", "demo", "--schema", "answer, sure bool", "--no-log", "-o", "temperature", "0"]
    result = CliRunner().invoke(cli, [*args, "-o", "max_tokens", str(MAX_TOKENS), QUESTION])
    assert result.exit_code == 0, result.output
    value = json.loads(result.output)
    assert set(value) == {"answer", "sure"} and isinstance(value["sure"], bool)


# ------------------------------------------------------------------------------------------
# the official SDKs: Anthropic with and without thinking (and what every test above sent)
# ------------------------------------------------------------------------------------------
def test_anthropic_with_and_without_thinking(server: LiveServer) -> None:
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    kw: dict[str, Any] = dict(
        model=server.model,
        messages=[{"role": "user", "content": "What is a list?"}],
        max_tokens=MAX_TOKENS,
        extra_body=GREEDY,
    )
    plain = claude.messages.create(**kw)
    assert [b.type for b in plain.content] == ["text"]
    with claude.messages.stream(thinking={"type": "enabled", "budget_tokens": 1024}, **kw) as s:
        for _ in s:
            pass
        thought = s.get_final_message()
    assert [b.type for b in thought.content] == ["thinking", "text"]


def sse_data(raw: str) -> list[dict[str, Any]]:
    """The JSON data of each event of a stream, ``[DONE]`` and comments left out."""
    out = []
    for frame in re.split(r"\r?\n\r?\n", raw.strip()):
        for line in frame.splitlines():
            if line.startswith("data: ") and line[6:] != "[DONE]":
                out.append(json.loads(line[6:]))
    return out


def openai_errors(name: str, body: Any) -> list[str]:
    validator = jsonschema_rs.validator_for(schema(name))
    return [f"{name} {list(e.instance_path)}: {e.message}" for e in validator.iter_errors(body)]


def test_every_body_and_event_validates(recorder: Recorder) -> None:
    """Last in the module: everything the server answered during the tests above."""
    from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent

    claude_event = pydantic.TypeAdapter(RawMessageStreamEvent)
    problems: list[str] = []
    seen: set[str] = set()
    for path, status, raw in recorder.exchanges:
        text = raw.decode()
        streamed = text.lstrip().startswith(("data:", "event:", ":"))
        seen.add(path + (" stream" if streamed else ""))
        if status != 200:
            body = json.loads(text)
            if path.startswith("/v1/messages"):
                assert body["type"] == "error", body
            else:
                problems += openai_errors("ErrorResponse", body)
            continue
        if path == "/v1/chat/completions":
            if streamed:
                for chunk in sse_data(text):
                    problems += openai_errors("CreateChatCompletionStreamResponse", chunk)
            else:
                problems += openai_errors("CreateChatCompletionResponse", json.loads(text))
        elif path == "/v1/responses":
            if streamed:
                for event in sse_data(text):
                    problems += openai_errors(event["type"], event)
            else:
                problems += openai_errors("Response", json.loads(text))
        elif path == "/v1/messages":
            try:
                if streamed:
                    for event in sse_data(text):
                        if event["type"] != "ping":
                            claude_event.validate_python(event, strict=True)
                else:
                    Message.model_validate(json.loads(text), strict=True)
            except pydantic.ValidationError as exc:
                problems.append(f"{path}: {exc}")
        elif path == "/v1/messages/count_tokens":
            MessageTokensCount.model_validate(json.loads(text), strict=True)
        elif path == "/v1/models":
            problems += openai_errors("ListModelsResponse", json.loads(text))
    assert not problems, problems[:5]
    if all(importlib.util.find_spec(name) for name in LIBRARIES):
        # what the libraries above reach: every API, streamed and not
        for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
            assert {path, path + " stream"} <= seen, seen
