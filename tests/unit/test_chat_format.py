"""The chat format (server/core/chat_format.py): marker ids looked up once per tokenizer, and a
rendered prompt's facts — an open think block, where the last turn begins — decided at render
time, on the repository's Qwen-style tokenizer and template (engine.model.tokenizer_build)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from fake_engine import load_tokenizer

from server.core.chat_format import (
    THINK_CLOSE,
    THINK_OPEN,
    TOOL_CLOSE,
    TOOL_OPEN,
    TURN_START,
    ChatFormat,
    render,
    text_opens_reasoning,
)
from server.errors import APIError

MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "<think>\nold\n</think>\n\nhello"},
    {"role": "user", "content": "more"},
]


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer()


def state_of(tok: Any, **template_kwargs: Any) -> Any:
    """The parts of a ServerState that rendering reads."""
    engine = SimpleNamespace(tokenizer=tok, context_length=4096)
    settings = SimpleNamespace(chat_template_kwargs=template_kwargs)
    return SimpleNamespace(engine=engine, settings=settings)


def test_ids_are_looked_up_once_per_tokenizer(tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    chat = ChatFormat.of(tok)
    assert chat is ChatFormat.of(tok)
    markers = (TURN_START, THINK_OPEN, THINK_CLOSE, TOOL_OPEN, TOOL_CLOSE)
    ids = (chat.turn_start, chat.think_open, chat.think_close, chat.tool_open, chat.tool_close)
    assert list(ids) == tok.convert_tokens_to_ids(list(markers))
    assert chat.tool_call_ids == (chat.tool_open, chat.tool_close)

    def counted(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a marker id was looked up again")

    monkeypatch.setattr(tok, "convert_tokens_to_ids", counted, raising=False)
    for thinking in (True, False):
        render(state_of(tok), MESSAGES, None, {"enable_thinking": thinking})
    assert ChatFormat.of(tok) is chat


def test_a_vocabulary_without_the_markers_has_no_ids() -> None:
    class Plain:
        def convert_tokens_to_ids(self, text: str) -> int:
            return 0  # the unknown token, as HF tokenizers answer

        def convert_ids_to_tokens(self, token: int) -> str:
            return "<unk>"

    chat = ChatFormat.of(Plain())
    assert chat == ChatFormat(None, None, None, None, None)
    assert chat.tool_call_ids is None
    # the facts fall back to the text when the ids cannot say
    assert chat.prompt([5, 6], "<|im_start|>assistant\n<think>\n").opens_reasoning
    assert chat.prompt([5, 6], "x").last_turn_start is None


@pytest.mark.parametrize("thinking", [None, True, False])
def test_render_decides_the_facts_from_the_ids(tok: Any, thinking: bool | None) -> None:
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    prompt = render(state_of(tok), MESSAGES, None, kwargs)
    chat = ChatFormat.of(tok)
    assert prompt.ids == tok.encode(prompt.text, add_special_tokens=False)
    # thinking is on unless the template is told otherwise: the prompt ends inside <think>
    opens = thinking is not False
    assert prompt.opens_reasoning is opens
    assert prompt.opens_reasoning is text_opens_reasoning(prompt.text)
    tail = "<|im_start|>assistant\n<think>\n" + ("" if opens else "\n</think>\n\n")
    assert prompt.text.endswith(tail)
    # the last turn is the generation prompt's: everything before it is history
    start = prompt.last_turn_start
    assert start is not None and prompt.ids[start] == chat.turn_start
    assert chat.turn_start not in prompt.ids[start + 1 :]
    assert tok.decode(prompt.ids[start:]) == tail
    assert prompt.tools is None


def test_the_server_default_sits_under_the_request(tok: Any) -> None:
    off = state_of(tok, enable_thinking=False)
    assert not render(off, MESSAGES, None, None).opens_reasoning
    assert render(off, MESSAGES, None, {"enable_thinking": True}).opens_reasoning


def test_a_prefill_continues_the_reply_and_tools_are_kept(tok: Any) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    prompt = render(state_of(tok), MESSAGES, tools, {"enable_thinking": False}, prefill="Sure")
    assert prompt.text.endswith("</think>\n\nSure") and not prompt.opens_reasoning
    assert prompt.tools is tools
    assert prompt.ids[prompt.last_turn_start] == ChatFormat.of(tok).turn_start


def test_template_errors_are_400s(tok: Any) -> None:
    with pytest.raises(APIError) as err:
        render(state_of(tok), [{"role": "nobody"}], None, None, param="input")
    assert err.value.status == 400 and err.value.param == "input"


def test_raw_ids_never_open_a_reasoning(tok: Any) -> None:
    chat = ChatFormat.of(tok)
    ids = tok.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    prompt = chat.prompt(ids)
    assert not prompt.opens_reasoning and prompt.last_turn_start == 0


def test_text_opens_reasoning() -> None:
    assert text_opens_reasoning("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert not text_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not text_opens_reasoning("<|im_start|>assistant\n")
    old = "<|im_start|>assistant\n<think>\nx\n</think>\n\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert not text_opens_reasoning(old)
