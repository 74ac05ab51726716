"""Incremental detokenization and stop strings (server/core/detokenizer.py).

The property that matters: streaming deltas concatenate to exactly the full decode, and no delta
ever contains U+FFFD when the full text does not (a multi-byte character split over tokens is
held back until it is complete).
"""

from __future__ import annotations

import random

import pytest
from fake_engine import load_tokenizer

from server.core.detokenizer import IncrementalDetokenizer, StopMatcher, TokenText


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


TEXTS = [
    "héllo → 世界 🙂 naïve café",
    "🙂🙂🙂 emoji only 👍🏽 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "def add(a, b):\n    return a + b\n",
    "<think>\nreasoning\n</think>\n\nanswer <tool_call>",
]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_rebuild_text_without_replacement_chars(tok, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 4  # the tiny vocabulary really splits characters
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    assert detok.text == text


def test_multibyte_char_split_over_tokens_is_held_back(tok) -> None:
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) >= 2, "the emoji should span several byte tokens in a 400-id vocabulary"
    detok = IncrementalDetokenizer(tok)
    assert [detok.add([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == "🙂"


def test_batches_of_tokens_match_single_steps(tok) -> None:
    text = TEXTS[0] + TEXTS[1]
    ids = tok.encode(text, add_special_tokens=False)
    rng = random.Random(0)
    detok = IncrementalDetokenizer(tok)
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        out.append(detok.add(ids[i : i + n]))
        i += n
    out.append(detok.flush())
    assert "".join(out) == text


def test_random_byte_tokens_equal_full_decode(tok) -> None:
    """Invalid UTF-8 (a random model's output) still comes out exactly as a full decode does."""
    rng = random.Random(1)
    ids = [rng.randrange(256) for _ in range(300)]
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.add([i]) for i in ids) + detok.flush()
    assert text == tok.decode(ids)


def test_skip_ids_are_not_rendered(tok) -> None:
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("hi", add_special_tokens=False) + [eos]
    detok = IncrementalDetokenizer(tok, skip_ids={eos})
    assert "".join(detok.add([i]) for i in ids) + detok.flush() == "hi"


def test_stop_string_split_across_feeds() -> None:
    m = StopMatcher(["STOP"])
    pieces = ["one S", "T", "O", "P tail"]
    out = []
    for p in pieces:
        emit, stopped = m.feed(p)
        out.append(emit)
        if stopped:
            break
    assert "".join(out) == "one "
    assert m.stopped and m.matched == "STOP"
    assert m.feed("more") == ("", True)


def test_stop_prefix_released_when_it_does_not_complete() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("ST") == ("", False)
    assert m.feed("ART") == ("START", False)
    assert m.feed("x ST") == ("x ", False)
    assert m.flush() == "ST"


def test_earliest_of_several_stops_wins() -> None:
    m = StopMatcher(["world", "lo w", "xyz"])
    emit, stopped = m.feed("hello world")
    assert stopped and emit == "hel" and m.matched == "lo w"


def test_no_stops_passes_text_through() -> None:
    m = StopMatcher([])
    assert m.feed("abc") == ("abc", False)
    assert m.flush() == ""


def test_stop_matcher_token_by_token(tok) -> None:
    text = "alpha beta <END> gamma"
    ids = tok.encode(text, add_special_tokens=False)
    detok, m = IncrementalDetokenizer(tok), StopMatcher(["<END>"])
    out = ""
    for i in ids:
        emit, stopped = m.feed(detok.add([i]))
        out += emit
        if stopped:
            break
    assert out == "alpha beta "


def test_token_text_bytes_rebuild_multibyte(tok) -> None:
    tt = TokenText(tok)
    ids = tok.encode("世界🙂", add_special_tokens=False)
    raw = b"".join(bytes(tt.bytes(i)) for i in ids)
    assert raw.decode("utf-8") == "世界🙂"
    think = tok.convert_tokens_to_ids("<think>")
    assert bytes(tt.bytes(think)) == b"<think>"
    assert tt.text(think) == "<think>"
