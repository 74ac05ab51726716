"""Token ids -> text, incrementally, for streaming; and stop strings matched across tokens.

Why this exists: a byte-level BPE splits one multi-byte UTF-8 character over several tokens, so
decoding token by token produces U+FFFD for each half (a serving bug seen in other servers).
``IncrementalDetokenizer`` decodes a short window that ends at the newest token and starts a few
tokens back (so tokenizers that drop a leading space at the start of a decode still see the
context), and holds text back while it ends in U+FFFD: the missing bytes usually arrive with the
next token. ``StopMatcher`` works on that text and holds back any tail that could still become a
stop string, so a stop string split across tokens is found and never half-emitted.

Neither class imports mlx; both run with the request (on the server's event loop), not inside
the decode cycle.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from functools import lru_cache
from typing import Any

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a character.

    The algorithm (the one Hugging Face TGI and vLLM use): keep two offsets into the id list.
    ``prefix_offset..read_offset`` is text already emitted, kept as left context;
    ``prefix_offset..end`` is decoded on each step, and the part beyond the context is new text.
    If the new text ends with U+FFFD the last token ended inside a character and nothing is
    emitted yet. ``flush()`` at the end emits whatever is left, invalid bytes included.
    """

    def __init__(self, tokenizer: Any, skip_ids: Collection[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._skip_ids = frozenset(skip_ids)
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._text: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._text)

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(
            list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def add(self, token_ids: Iterable[int]) -> str:
        """Append tokens; return the text that is now certain (possibly empty)."""
        new = [t for t in token_ids if t not in self._skip_ids]
        if not new:
            return ""
        self._ids.extend(new)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            delta = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._text.append(delta)
            return delta
        return ""

    def flush(self) -> str:
        """Emit the held-back tail (at the end of generation), even if it is not valid UTF-8."""
        if self._read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        self._text.append(delta)
        return delta


class StopMatcher:
    """Finds the first stop string in streamed text; emits only text that cannot start one.

    ``feed(text)`` returns ``(emit, stopped)``: ``emit`` is safe to send; when ``stopped`` is
    true the stop string was found, ``emit`` ends right before it, and everything after it is
    dropped. Held-back text (a tail that is a prefix of some stop string) comes out with
    ``flush()`` when generation ends for another reason.
    """

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self.stops = [s for s in stops if s]
        self._buffer = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        self._buffer += text
        buf = self._buffer
        first: tuple[int, str] | None = None
        for stop in self.stops:
            i = buf.find(stop)
            if i >= 0 and (first is None or i < first[0]):
                first = (i, stop)
        if first is not None:
            self.stopped = True
            self.matched = first[1]
            self._buffer = ""
            return buf[: first[0]], True
        hold = 0
        for stop in self.stops:
            # longest proper prefix of `stop` that the buffer ends with
            for k in range(min(len(stop) - 1, len(buf)), hold, -1):
                if buf.endswith(stop[:k]):
                    hold = k
                    break
        emit = buf[: len(buf) - hold]
        self._buffer = buf[len(buf) - hold :]
        return emit, False

    def flush(self) -> str:
        out, self._buffer = self._buffer, ""
        return "" if self.stopped else out


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable stand-ins byte-level BPE uses."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1))
    bs += list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class TokenText:
    """Per-token text and raw bytes, for logprobs (``token`` and ``bytes`` of the OpenAI shape).

    A token that holds half a UTF-8 character decodes to U+FFFD on its own; its ``bytes`` are
    still exact for byte-level BPE tokenizers (mapped back through the byte alphabet), so a
    client can rebuild the text from the bytes.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel" or "ByteLevel" in repr(decoder)
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self._added = {int(i): str(getattr(t, "content", t)) for i, t in added.items()}

    @lru_cache(maxsize=65536)  # noqa: B019 - one instance per served tokenizer, lives forever
    def text(self, token_id: int) -> str:
        return self._tokenizer.decode(
            [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    @lru_cache(maxsize=65536)  # noqa: B019
    def bytes(self, token_id: int) -> list[int]:
        if token_id in self._added:
            return list(self._added[token_id].encode("utf-8"))
        if self._byte_level:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            table = _byte_decoder()
            if isinstance(piece, str) and all(ch in table for ch in piece):
                return [table[ch] for ch in piece]
        return list(self.text(token_id).encode("utf-8"))
