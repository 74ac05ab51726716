"""Split generated chat text into reasoning, content and tool calls — incrementally.

Qwen3.5/3.6 output: the generation prompt already opens ``<think>\\n``, so the
model's text starts inside the reasoning and closes it with ``</think>``; with
``enable_thinking: false`` the prompt holds an empty think block and output is content. Tool
calls are XML blocks::

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

and a ``<tool_call>`` inside the reasoning ends the reasoning implicitly. The parser is fed the
text deltas of a stream (markers may be split across deltas, so a tail that could be the start
of a marker is held back) and reports reasoning / content / tool-call deltas in the shapes the
OpenAI streaming API uses. The non-streaming response is the sum of the same deltas, so both
paths return the same thing.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from sampling.constraint import declared_type
from server.core.chat_format import THINK_CLOSE, THINK_OPEN, TOOL_CLOSE, TOOL_OPEN
from server.core.finite import loads_keeping_huge

_FUNCTION_RE = re.compile(r"<function=([^>\n]+)>")
_PARAM_RE = re.compile(
    r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|\Z)", re.S
)
#: A parameter whose closing tag was written: all that a call cut short can be trusted with.
_CLOSED_PARAM_RE = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def partial_marker_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``markers``."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None
    #: False on the arguments of a call the generation cut short (see ``ToolCall``)
    complete: bool = True


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    #: JSON object text; for a call cut short (``complete`` False) a prefix of one: the
    #: parameters whose closing tag was written, the object left open, so that no client
    #: mistakes it for a finished call (OpenAI's own truncated arguments look the same)
    arguments: str
    complete: bool = True


#: One piece of parsed output in the order the model wrote it: ("reasoning", text),
#: ("content", text) or ("tool_call", ToolCallDelta).
Part = tuple[str, "str | ToolCallDelta"]


@dataclass
class ParsedDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    #: The same output in order (block-structured APIs need to know what came first).
    parts: list[Part] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def add_text(self, kind: str, text: str) -> None:
        if kind == "reasoning":
            self.reasoning += text
        else:
            self.content += text
        if self.parts and self.parts[-1][0] == kind:
            self.parts[-1] = (kind, self.parts[-1][1] + text)  # type: ignore[operator]
        else:
            self.parts.append((kind, text))

    def add_tool_call(self, delta: ToolCallDelta) -> None:
        self.tool_calls.append(delta)
        self.parts.append(("tool_call", delta))

    def extend(self, other: ParsedDelta) -> None:
        for kind, value in other.parts:
            if kind == "tool_call":
                self.add_tool_call(value)  # type: ignore[arg-type]
            else:
                self.add_text(kind, value)  # type: ignore[arg-type]


def _param_types(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, str]]:
    """function name -> {parameter name -> JSON-schema type} from the request's tools."""
    out: dict[str, dict[str, str]] = {}
    for tool in tools or []:
        fn = tool.get("function") or {}
        props = ((fn.get("parameters") or {}).get("properties")) or {}
        types = {
            key: declared_type(schema) if isinstance(schema, dict) else ""
            for key, schema in props.items()
        }
        if isinstance(fn.get("name"), str):
            out[fn["name"]] = types
    return out


def _convert_value(raw: str, kind: str | None) -> Any:
    """Parameter text -> JSON value following the tool's declared type (strings stay strings)."""
    value = raw
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    if kind in (None, "", "string"):
        return value
    try:
        return loads_keeping_huge(value)
    except (ValueError, RecursionError):  # RecursionError: nested past the parser's depth
        if kind == "boolean" and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        return value


def parse_tool_block(body: str, types: dict[str, dict[str, str]]) -> tuple[str, dict] | None:
    """The text between ``<tool_call>`` and ``</tool_call>`` -> (name, arguments) or None."""
    match = _FUNCTION_RE.search(body)
    if match is not None:
        name = match.group(1).strip()
        fn_types = types.get(name, {})
        args = {
            key.strip(): _convert_value(raw, fn_types.get(key.strip()))
            for key, raw in _PARAM_RE.findall(body[match.end() :])
        }
        return name, args
    # Qwen3 / Hermes JSON form: {"name": ..., "arguments": {...}}
    try:
        data = loads_keeping_huge(body.strip())
    except (ValueError, RecursionError):
        return None
    if isinstance(data, dict) and isinstance(data.get("name"), str):
        args = data.get("arguments", data.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = loads_keeping_huge(args)
            except (ValueError, RecursionError):
                args = {"value": args}
        return data["name"], args if isinstance(args, dict) else {"value": args}
    return None


class ChatOutputParser:
    """Incremental splitter: ``feed(delta)`` and finally ``finish()``; both return a ParsedDelta.

    States: ``reasoning`` (inside the think block), ``content``, ``tool`` (inside a tool-call
    block, which is buffered until it closes; its name is reported as soon as it is known).
    Newlines right after a state change, and trailing newlines before one, are dropped so that
    ``</think>\\n\\nAnswer`` gives content ``Answer``.
    """

    def __init__(
        self,
        *,
        start_in_reasoning: bool = False,
        parse_reasoning: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        self.parse_reasoning = parse_reasoning
        self.parse_tools = tools is not None
        self._types = _param_types(tools)
        self.state = "reasoning" if (start_in_reasoning and parse_reasoning) else "content"
        self._buffer = ""  # unprocessed text (possible marker prefix, or a tool block)
        self._pending_nl = ""  # trailing newlines not yet emitted
        self._started = False  # anything emitted in the current state yet
        self._content_seen = False  # any content emitted at all (a late <think> is content)
        self.tool_calls: list[ToolCall] = []
        self._tool_name_sent = False
        self._tool_id: str | None = None

    # helpers ---------------------------------------------------------------------------------
    def _markers(self) -> tuple[str, ...]:
        if self.state == "reasoning":
            return (THINK_CLOSE, TOOL_OPEN) if self.parse_tools else (THINK_CLOSE,)
        if self.state == "content":
            markers: tuple[str, ...] = (TOOL_OPEN,) if self.parse_tools else ()
            if self.parse_reasoning and not self._content_seen:
                markers += (THINK_OPEN,)
            return markers
        return (TOOL_CLOSE,)

    def _emit(self, text: str, out: ParsedDelta) -> None:
        """Emit text in the current (reasoning/content) state, holding trailing newlines."""
        if not text:
            return
        if not self._started:
            text = text.lstrip("\n")
            if not text:
                return
            self._started = True
        text = self._pending_nl + text
        stripped = text.rstrip("\n")
        self._pending_nl = text[len(stripped) :]
        if not stripped:
            return
        out.add_text("reasoning" if self.state == "reasoning" else "content", stripped)
        if self.state != "reasoning" and stripped.strip():
            self._content_seen = True

    def _switch(self, state: str) -> None:
        self.state = state
        self._pending_nl = ""
        self._started = False

    def _tool_progress(self, out: ParsedDelta) -> None:
        """Inside a tool block: report the function name as soon as it is complete."""
        if self._tool_name_sent:
            return
        match = _FUNCTION_RE.search(self._buffer)
        if match is None:
            return
        self._tool_id = new_tool_call_id()
        out.add_tool_call(
            ToolCallDelta(index=len(self.tool_calls), id=self._tool_id, name=match.group(1).strip())
        )
        self._tool_name_sent = True

    def _close_tool(self, body: str, out: ParsedDelta, *, complete: bool) -> None:
        """A tool block ended: by its closing tag (``complete``) or by the model's end of
        turn without one, both read as far as the block parses."""
        parsed = parse_tool_block(body, self._types)
        if parsed is None:
            # Not a tool call after all: give the text back as content.
            self._switch("content")
            if self._tool_name_sent:
                # The name delta went out already; report an empty-argument call to stay
                # consistent with what the client has seen.
                name = _FUNCTION_RE.search(body)
                parsed = (name.group(1).strip() if name else "unknown", {})
            else:
                self._emit(TOOL_OPEN + body + (TOOL_CLOSE if complete else ""), out)
                return
        name, args = parsed
        self._add_call(name, json.dumps(args, ensure_ascii=False), out, complete=True)

    def _cut_tool(self, body: str, out: ParsedDelta) -> None:
        """A tool block the generation ended inside: never a finished call, never markup in a
        value. With its name known it is reported incomplete (``ToolCall.complete``) with the
        parameters that were closed; without one, nothing of it is reported."""
        self._switch("content")
        match = _FUNCTION_RE.search(body)
        if match is None:
            return
        fn_types = self._types.get(match.group(1).strip(), {})
        args = {
            key.strip(): _convert_value(raw, fn_types.get(key.strip()))
            for key, raw in _CLOSED_PARAM_RE.findall(body[match.end() :])
        }
        arguments = json.dumps(args, ensure_ascii=False)[:-1]  # the object left open
        self._add_call(match.group(1).strip(), arguments, out, complete=False)

    def _add_call(self, name: str, arguments: str, out: ParsedDelta, *, complete: bool) -> None:
        index = len(self.tool_calls)
        call_id = self._tool_id or new_tool_call_id()
        if self._tool_name_sent:
            delta = ToolCallDelta(index=index, arguments=arguments, complete=complete)
        else:
            delta = ToolCallDelta(index, call_id, name, arguments, complete)
        out.add_tool_call(delta)
        self.tool_calls.append(ToolCall(index, call_id, name, arguments, complete))
        self._tool_name_sent = False
        self._tool_id = None
        self._switch("content")

    # API ---------------------------------------------------------------------------------
    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buffer += text
        while True:
            buf = self._buffer
            if self.state == "tool":
                end = buf.find(TOOL_CLOSE)
                if end < 0:
                    self._tool_progress(out)
                    return out
                self._tool_progress_from(buf[:end], out)
                self._buffer = buf[end + len(TOOL_CLOSE) :]
                self._close_tool(buf[:end], out, complete=True)
                continue
            markers = self._markers()
            hits = [(buf.find(m), m) for m in markers if buf.find(m) >= 0]
            if hits:
                at, marker = min(hits)
                self._emit(buf[:at], out)
                self._buffer = buf[at + len(marker) :]
                if marker == THINK_CLOSE:
                    self._switch("content")
                elif marker == THINK_OPEN:
                    self._switch("reasoning")
                elif marker == TOOL_OPEN:
                    self._switch("tool")
                continue
            hold = partial_marker_suffix(buf, markers)
            self._emit(buf[: len(buf) - hold], out)
            self._buffer = buf[len(buf) - hold :]
            return out

    def finish(self, *, cut: bool = False) -> ParsedDelta:
        """End of generation: flush held text. An unclosed tool block is parsed if possible
        when the model ended it (EOS, a stop string); when the token limit ``cut`` it, it is
        an incomplete call (``_cut_tool``)."""
        out = ParsedDelta()
        buf, self._buffer = self._buffer, ""
        if self.state == "tool":
            self._tool_progress_from(buf, out)
            if cut:
                self._cut_tool(buf, out)
            else:
                self._close_tool(buf, out, complete=False)
        else:
            self._emit(buf, out)
            if self._pending_nl:
                # newlines the model ended on are its text; only those before a state change
                # (a tool call, the end of the reasoning) are layout
                out.add_text(
                    "reasoning" if self.state == "reasoning" else "content", self._pending_nl
                )
        self._pending_nl = ""
        return out

    @property
    def content_started(self) -> bool:
        """Whether content text has been emitted since the last state change (the newlines
        that open the content are dropped, so they do not count)."""
        return self.state == "content" and self._started

    def _tool_progress_from(self, body: str, out: ParsedDelta) -> None:
        self._buffer = body
        self._tool_progress(out)
        self._buffer = ""
