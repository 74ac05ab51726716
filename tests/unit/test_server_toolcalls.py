"""Reasoning / content / tool-call splitting (server/core/toolcalls.py), whole and incremental.

Every case is fed three ways — all at once, character by character, and in random chunks — and
must give the same result: markers split across stream deltas are the normal case.
"""

from __future__ import annotations

import json
import random

import pytest

from server.core.toolcalls import ChatOutputParser, ParsedDelta

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "units": {"type": ["string", "null"]},
                    "flags": {"type": "object"},
                },
            },
        },
    }
]


def split(text: str, how: str) -> list[str]:
    if how == "whole":
        return [text]
    if how == "chars":
        return list(text)
    rng = random.Random(len(text))
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 7)
        out.append(text[i : i + n])
        i += n
    return out


def parse(text: str, how: str, **kw) -> tuple[ParsedDelta, ChatOutputParser, list[ParsedDelta]]:
    parser = ChatOutputParser(**kw)
    total = ParsedDelta()
    deltas = []
    for piece in split(text, how):
        d = parser.feed(piece)
        deltas.append(d)
        total.extend(d)
    d = parser.finish()
    deltas.append(d)
    total.extend(d)
    return total, parser, deltas


HOWS = ["whole", "chars", "chunks"]


@pytest.mark.parametrize("how", HOWS)
def test_reasoning_then_content(how: str) -> None:
    text = "Let me think.\nStep two.\n</think>\n\nThe answer is 42."
    total, _, deltas = parse(text, how, start_in_reasoning=True)
    assert total.reasoning == "Let me think.\nStep two."
    assert total.content == "The answer is 42."
    assert not any("<" in d.reasoning + d.content for d in deltas)


@pytest.mark.parametrize("how", HOWS)
def test_no_reasoning_when_prompt_closed_it(how: str) -> None:
    total, _, _ = parse("Plain answer with a < sign and </b>.", how, start_in_reasoning=False)
    assert total.reasoning == "" and total.content == "Plain answer with a < sign and </b>."


@pytest.mark.parametrize("how", HOWS)
def test_model_opened_think_block(how: str) -> None:
    total, _, _ = parse("<think>\nhmm\n</think>\n\nok", how, start_in_reasoning=False)
    assert (total.reasoning, total.content) == ("hmm", "ok")


@pytest.mark.parametrize("how", HOWS)
def test_xml_tool_call_with_typed_parameters(how: str) -> None:
    text = (
        "Need weather.\n</think>\n\nChecking.\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
        '<parameter=flags>\n{"a": [1, 2]}\n</parameter>\n<parameter=units>\nmetric\n'
        "</parameter>\n</function>\n</tool_call>"
    )
    total, parser, _ = parse(text, how, start_in_reasoning=True, tools=TOOLS)
    assert total.reasoning == "Need weather."
    assert total.content == "Checking."
    assert len(parser.tool_calls) == 1
    call = parser.tool_calls[0]
    assert call.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.arguments) == {
        "city": "New York",
        "days": 3,
        "flags": {"a": [1, 2]},
        "units": "metric",
    }
    # streamed as: the name (with id) first, then the arguments, same index
    first, second = total.tool_calls
    assert (first.index, first.id, first.name, first.arguments) == (0, call.id, "get_weather", None)
    assert (second.index, second.id, second.name) == (0, None, None)
    assert json.loads(second.arguments) == json.loads(call.arguments)


@pytest.mark.parametrize("how", HOWS)
def test_tool_call_inside_reasoning_ends_it(how: str) -> None:
    text = (
        "thinking...\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n"
        "</parameter>\n</function>\n</tool_call>"
    )
    total, parser, _ = parse(text, how, start_in_reasoning=True, tools=TOOLS)
    assert total.reasoning == "thinking..."
    assert total.content == ""
    assert [json.loads(c.arguments) for c in parser.tool_calls] == [{"city": "Rome"}]


@pytest.mark.parametrize("how", HOWS)
def test_two_tool_calls_get_two_indexes(how: str) -> None:
    one = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n{c}\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    text = one.format(c="Paris") + "\n" + one.format(c="Rome")
    _, parser, _ = parse(text, how, tools=TOOLS)
    assert [c.index for c in parser.tool_calls] == [0, 1]
    assert [json.loads(c.arguments)["city"] for c in parser.tool_calls] == ["Paris", "Rome"]
    assert len({c.id for c in parser.tool_calls}) == 2


def test_json_style_tool_call() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    _, parser, _ = parse(text, "chars", tools=TOOLS)
    assert parser.tool_calls[0].name == "get_weather"
    assert json.loads(parser.tool_calls[0].arguments) == {"city": "Oslo"}


def test_tools_off_leaves_markup_in_content() -> None:
    text = "<tool_call>\n<function=f>\n</function>\n</tool_call>"
    total, parser, _ = parse(text, "chars", tools=None)
    assert total.content == text and parser.tool_calls == []


def test_unclosed_tool_call_at_end_is_still_parsed() -> None:
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n"
    _, parser, _ = parse(text, "chars", tools=TOOLS)
    assert json.loads(parser.tool_calls[0].arguments) == {"city": "Lima"}


def test_garbage_tool_block_returns_as_content() -> None:
    total, parser, _ = parse("<tool_call>not a call</tool_call>", "whole", tools=TOOLS)
    assert parser.tool_calls == []
    assert total.content == "<tool_call>not a call</tool_call>"


def test_partial_marker_at_end_is_flushed() -> None:
    total, _, _ = parse("answer </thi", "chars", start_in_reasoning=False)
    assert total.content == "answer </thi"
    total, _, _ = parse("reasoning <tool_c", "chars", start_in_reasoning=True, tools=TOOLS)
    assert total.reasoning == "reasoning <tool_c"


def test_a_tool_call_nested_past_the_json_parser_is_kept_as_text() -> None:
    """A model stuck repeating "[" inside a tool call must not break the stream: the parser
    recurses once per level, so the typed value stays the text it was, and a JSON-form block
    is not a call at all."""
    deep = "[" * 5000 + "]" * 5000
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=flags>\n"
        + deep
        + "\n</parameter>\n</function>\n</tool_call>"
    )
    _, parser, _ = parse(text, "whole", tools=TOOLS)
    assert json.loads(parser.tool_calls[0].arguments) == {"flags": deep}
    block = '<tool_call>\n{"name": "get_weather", "arguments": ' + deep + "}\n</tool_call>"
    total, parser, _ = parse(block, "whole", tools=TOOLS)
    assert parser.tool_calls == [] and total.content == block
