"""The chat format in one place: ChatML as Qwen3.5/3.6 write it, rendered into a prompt.

The markers the server reads in a prompt or a reply — the turn start, the think block, the
tool-call block — are named here once, and their token ids are looked up once per tokenizer
(``ChatFormat.of``). ``render`` turns template messages into a ``Prompt`` whose facts are
decided at render time from its token ids: whether the generation prompt leaves a think block
open (``opens_reasoning``), where its last turn begins (``last_turn_start``, the position the
conversation cache also snapshots) and which tools it shows. The rest of the server uses those
facts and ids instead of searching the text or the vocabulary again.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from server.errors import APIError, bad_request
from server.state import ServerState

#: ChatML's turn header: every message (and the generation prompt) begins with it.
TURN_START = "<|im_start|>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"

#: Template arguments a request may not set: they belong to the renderer itself.
_RESERVED_TEMPLATE_KWARGS = {
    "conversation",
    "messages",
    "tools",
    "tokenize",
    "add_generation_prompt",
    "return_dict",
    "return_tensors",
    "chat_template",
    "documents",
}


def token_id(tokenizer: Any, text: str) -> int | None:
    """The id of the single token spelled ``text`` (None if the vocabulary has none); a lookup,
    not ``get_vocab()``, which builds a dict of the whole vocabulary on every call."""
    found = tokenizer.convert_tokens_to_ids(text)
    if isinstance(found, int) and tokenizer.convert_ids_to_tokens(found) == text:
        return found
    return None


@dataclass
class Prompt:
    """One prompt as the engine gets it, with what the server needs to know about it: its text
    (None for raw token ids) and ids, and the facts ``ChatFormat.facts`` decides once."""

    ids: list[int]
    text: str | None = None
    #: The tools shown to the model (None: tool-call parsing off).
    tools: list[dict[str, Any]] | None = None
    #: The generation prompt leaves a think block open: the reply starts inside the reasoning.
    opens_reasoning: bool = False
    #: Index of the last turn-start token (where the prompt's last turn begins); None if none.
    last_turn_start: int | None = None


#: One ChatFormat per tokenizer, dropped with it (a test process loads many tokenizers).
_FORMATS: weakref.WeakKeyDictionary[Any, ChatFormat] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class ChatFormat:
    """The markers' token ids in one tokenizer's vocabulary (None where it has no such token)."""

    turn_start: int | None
    think_open: int | None
    think_close: int | None
    tool_open: int | None
    tool_close: int | None

    @classmethod
    def of(cls, tokenizer: Any) -> ChatFormat:
        """The tokenizer's format, its ids looked up on the first call only."""
        try:
            return _FORMATS[tokenizer]
        except KeyError:
            pass
        except TypeError:  # a tokenizer that cannot be weakly referenced is looked up each time
            return cls.lookup(tokenizer)
        found = _FORMATS[tokenizer] = cls.lookup(tokenizer)
        return found

    @classmethod
    def lookup(cls, tokenizer: Any) -> ChatFormat:
        return cls(
            turn_start=token_id(tokenizer, TURN_START),
            think_open=token_id(tokenizer, THINK_OPEN),
            think_close=token_id(tokenizer, THINK_CLOSE),
            tool_open=token_id(tokenizer, TOOL_OPEN),
            tool_close=token_id(tokenizer, TOOL_CLOSE),
        )

    @property
    def tool_call_ids(self) -> tuple[int, int] | None:
        """The ids that open and close a tool call, None unless the vocabulary has both."""
        if self.tool_open is None or self.tool_close is None:
            return None
        return self.tool_open, self.tool_close

    def last_turn_start(self, ids: list[int]) -> int | None:
        """Index of the last turn-start token in ``ids`` (None if there is none)."""
        if self.turn_start is None:
            return None
        for i in range(len(ids) - 1, -1, -1):
            if ids[i] == self.turn_start:
                return i
        return None

    def opens_reasoning(self, ids: list[int], text: str | None = None) -> bool:
        """Whether the prompt leaves a think block open: its last think-open comes after its
        last think-close and its last turn start. Read from the ids, walking back from the end;
        from ``text`` when the vocabulary lacks one of the three markers (a marker spelled in
        pieces is still a marker in the text)."""
        markers = (self.think_open, self.think_close, self.turn_start)
        if None in markers:
            return text is not None and text_opens_reasoning(text)
        for token in reversed(ids):
            if token in markers:
                return token == self.think_open
        return False

    def prompt(
        self, ids: list[int], text: str | None = None, tools: list[dict[str, Any]] | None = None
    ) -> Prompt:
        """A prompt with its facts decided, once; raw token ids (``text`` None) never open a
        reasoning: only a rendered chat prompt's reply is parsed."""
        return Prompt(
            ids=ids,
            text=text,
            tools=tools,
            opens_reasoning=text is not None and self.opens_reasoning(ids, text),
            last_turn_start=self.last_turn_start(ids),
        )


def text_opens_reasoning(text: str) -> bool:
    """``ChatFormat.opens_reasoning`` read from the rendered text alone."""
    open_at = text.rfind(THINK_OPEN)
    if open_at < 0:
        return False
    return open_at > text.rfind(THINK_CLOSE) and open_at > text.rfind(TURN_START)


def render(
    state: ServerState,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any] | None,
    param: str = "messages",
    prefill: str = "",
) -> Prompt:
    """Template messages -> a prompt and its facts; the server's default template kwargs sit
    under the request's. Template errors are the client's 400. ``prefill``: the start of the
    assistant's reply, written after the generation prompt so that the model continues it."""
    tokenizer = state.engine.tokenizer
    merged = dict(state.settings.chat_template_kwargs) | dict(template_kwargs or {})
    kwargs = {k: v for k, v in merged.items() if k not in _RESERVED_TEMPLATE_KWARGS}
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs
        )
    except Exception as exc:  # jinja2 TemplateError, TypeError from odd kwargs, ...
        raise bad_request(f"could not apply the chat template: {exc}", param=param) from exc
    if not isinstance(text, str):
        raise bad_request("the chat template did not produce text", param=param)
    text += prefill
    check_text_fits(state, text, param)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise bad_request("the rendered prompt is empty", param=param)
    return ChatFormat.of(tokenizer).prompt(list(ids), text, tools)


def check_text_fits(state: ServerState, text: str, param: str) -> None:
    """A text longer than the context could hold at the longest token's length is refused
    without tokenizing it (a 400 that costs nothing, however large the body)."""
    engine = state.engine
    limit = engine.context_length * longest_token_chars(engine.tokenizer)
    if len(text) > limit:
        raise APIError(
            400,
            f"This model's maximum context length is {engine.context_length} tokens, and the "
            f"prompt's {len(text)} characters are more than that many tokens can hold.",
            param=param,
            code="context_length_exceeded",
        )


_LONGEST_TOKEN: dict[int, int] = {}


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token can stand for (its byte-level spelling's length: one
    character per byte, and a text character is at least one byte); computed once."""
    key = id(tokenizer)
    if key not in _LONGEST_TOKEN:
        _LONGEST_TOKEN[key] = max((len(t) for t in tokenizer.get_vocab()), default=1) or 1
    return _LONGEST_TOKEN[key]
