"""One choice's engine events -> parsed output, the same for every API.

``ChoiceOutput.step(event)`` turns a ``GenerationEvent`` into an ``OutputDelta``:
- EOS ids end the text; the incremental detokenizer keeps multi-byte characters whole; the stop
  matcher cuts the text right before a stop string and cancels the engine (which stops within
  one cycle); tokens are counted as emitted, so usage and logprobs describe exactly those.
- The chat parser (server/core/toolcalls.py) splits the text into reasoning, content and
  tool-call deltas, in the order the model wrote them.
- A block view of the same output (``BlockEvent``: start / delta / stop of a reasoning, text or
  tool-call block) is what the block-structured APIs (Anthropic Messages, OpenAI Responses) map
  one to one onto their stream events; the non-streaming bodies are the finished blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.api import GenerationEvent, GenerationStats, TokenLogprob
from server.core.detokenizer import IncrementalDetokenizer, StopMatcher
from server.core.toolcalls import ChatOutputParser, ParsedDelta, ToolCall, ToolCallDelta

BlockKind = Literal["reasoning", "text", "tool_call"]
#: Neutral finish reasons: "stop" (EOS or a stop string), "length", "tool_calls".
FinishReason = str


@dataclass
class Block:
    """A finished (or growing) piece of output: reasoning text, answer text, or one tool call
    (``text`` is then its JSON arguments)."""

    kind: BlockKind
    text: str = ""
    call_id: str | None = None
    name: str | None = None
    #: False for a tool call the generation cut short (its ``text`` is then an unclosed prefix
    #: of the arguments object, ``ToolCall.complete``)
    complete: bool = True


@dataclass
class BlockEvent:
    type: Literal["start", "delta", "stop"]
    index: int
    block: Block
    delta: str = ""


class BlockAssembler:
    """Ordered parser parts -> block start / delta / stop events."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self._open: Block | None = None

    def _start(self, block: Block, out: list[BlockEvent]) -> None:
        self._close(out)
        self.blocks.append(block)
        self._open = block
        out.append(BlockEvent("start", len(self.blocks) - 1, block))

    def _close(self, out: list[BlockEvent]) -> None:
        if self._open is not None:
            out.append(BlockEvent("stop", len(self.blocks) - 1, self._open))
            self._open = None

    def _append(self, text: str, out: list[BlockEvent]) -> None:
        assert self._open is not None
        self._open.text += text
        out.append(BlockEvent("delta", len(self.blocks) - 1, self._open, text))

    def feed(self, parsed: ParsedDelta) -> list[BlockEvent]:
        out: list[BlockEvent] = []
        for kind, value in parsed.parts:
            if isinstance(value, ToolCallDelta):
                if value.name is not None:
                    self._start(Block("tool_call", call_id=value.id, name=value.name), out)
                if value.arguments is not None and self._open is not None:
                    self._open.complete = value.complete
                    self._append(value.arguments, out)
                    self._close(out)
                continue
            block_kind: BlockKind = "reasoning" if kind == "reasoning" else "text"
            if self._open is None or self._open.kind != block_kind:
                self._start(Block(block_kind), out)
            self._append(value, out)
        return out

    def finish(self) -> list[BlockEvent]:
        out: list[BlockEvent] = []
        self._close(out)
        return out


@dataclass
class OutputDelta:
    """What one engine event added to one choice."""

    #: The text (EOS dropped, cut at a stop string), before any parsing.
    text: str = ""
    #: The same text split into reasoning / content / tool calls (all content when unparsed).
    parsed: ParsedDelta = field(default_factory=ParsedDelta)
    blocks: list[BlockEvent] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    #: The logprobs of the tokens whose text is content (not reasoning, a tool call, the
    #: markup between them or the EOS token): what lines up with a chat reply's ``content``.
    content_logprobs: list[TokenLogprob] = field(default_factory=list)
    #: Per token: drafted by the MTP head and accepted (True) or chosen by the trunk (False).
    drafted: list[bool] | None = None
    #: Per token: the text it released (the detokenizer and the stop matcher may hold text
    #: back, which then counts for a later token).
    token_texts: list[str] = field(default_factory=list)
    cycle_draft_tokens: int | None = None
    finish_reason: FinishReason | None = None
    #: The prompt's scores, on a choice's first delta where the request asked for them
    #: (``GenerationEvent.prompt_logprobs``).
    prompt_logprobs: list[TokenLogprob] | None = None

    def trace(self) -> dict[str, Any]:
        """The opt-in ``mtp_trace`` extension of a streamed chat chunk (docs/SERVER.md)."""
        drafted = self.drafted or [False] * len(self.token_texts)
        return {
            "draft_tokens": self.cycle_draft_tokens,
            "tokens": [
                {"text": t, "drafted": d} for t, d in zip(self.token_texts, drafted, strict=True)
            ],
        }


class ChoiceOutput:
    """One choice: engine events -> ``OutputDelta``s, with EOS, stop strings, parsing and
    token accounting."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        eos_ids: frozenset[int],
        stop: list[str],
        ignore_eos: bool,
        cancel: Callable[[], None],
        parser: ChatOutputParser | None,
    ) -> None:
        self._eos = frozenset() if ignore_eos else frozenset(eos_ids)
        self._detok = IncrementalDetokenizer(tokenizer, skip_ids=self._eos)
        self._stop = StopMatcher(stop)
        self._cancel = cancel
        self.parser = parser
        self.assembler = BlockAssembler()
        self.completion_tokens = 0
        #: tokens generated while the output was inside the think block
        self.reasoning_tokens = 0
        self.stats: GenerationStats | None = None
        self.finish_reason: FinishReason | None = None
        self.text = ""

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the output, if one did."""
        return self._stop.matched

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.parser.tool_calls if self.parser is not None else []

    @property
    def blocks(self) -> list[Block]:
        return self.assembler.blocks

    def _is_content_token(self, was_content: bool, emit: str) -> bool:
        """Whether a token just fed (its released text ``emit``) belongs to the content: fed
        in the content state and still in it, and not one of the newlines that open the
        content, which the parser drops. A token whose text is held back (part of a
        character) counts: its text reaches the content with the next one."""
        if self.parser is None:
            return True
        if not was_content or self.parser.state != "content":
            return False
        return self.parser.content_started or not emit

    def _parse(self, text: str, out: OutputDelta) -> None:
        out.text += text
        self.text += text
        if self.parser is None:
            if text:
                out.parsed.add_text("content", text)
            return
        out.parsed.extend(self.parser.feed(text))

    def step(self, event: GenerationEvent) -> OutputDelta:
        out = OutputDelta(
            cycle_draft_tokens=event.cycle_draft_tokens, prompt_logprobs=event.prompt_logprobs
        )
        if self.finish_reason is not None:
            return out
        if event.stats is not None:
            self.stats = event.stats
        finish: str | None = None
        for i, token in enumerate(event.token_ids):
            self.completion_tokens += 1
            if self.parser is not None and self.parser.state == "reasoning":
                self.reasoning_tokens += 1
            out.token_ids.append(token)
            out.token_texts.append("")
            logprob = None
            if event.logprobs is not None and i < len(event.logprobs):
                logprob = event.logprobs[i]
                out.logprobs.append(logprob)
            if token in self._eos:
                finish = "stop"
                break
            was_content = self.parser is None or self.parser.state == "content"
            emit, stopped = self._stop.feed(self._detok.add([token]))
            out.token_texts[-1] = emit
            self._parse(emit, out)
            if logprob is not None and self._is_content_token(was_content, emit):
                out.content_logprobs.append(logprob)
            if stopped:
                finish = "stop"
                self._cancel()  # the engine stops at its next cycle
                break
        if event.drafted is not None:
            out.drafted = event.drafted[: len(out.token_ids)]
        if finish is None and event.finish_reason is not None:
            finish = event.finish_reason
        if finish is not None:
            if not self._stop.stopped:
                emit, _ = self._stop.feed(self._detok.flush())
                emit += self._stop.flush()
                if out.token_texts:
                    out.token_texts[-1] += emit
                self._parse(emit, out)
            if self.parser is not None:
                out.parsed.extend(self.parser.finish(cut=finish == "length"))
                if self.parser.tool_calls and finish == "stop":
                    finish = "tool_calls"
            self.finish_reason = finish
            out.finish_reason = finish
        out.blocks = self.assembler.feed(out.parsed)
        if finish is not None:
            out.blocks += self.assembler.finish()
        return out
