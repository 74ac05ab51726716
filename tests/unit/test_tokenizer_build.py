"""What engine.model.tokenizer_build saves is what transformers and mlx-lm load.

Checked in two folders: the tokenizer alone, and the tokenizer next to a config.json whose
model_type is qwen3_5 (where transformers 5.x substitutes its own Qwen3_5Tokenizer class and
rebuilds the pre-tokenizer from the class).
"""

from __future__ import annotations

import json
import shutil
import unicodedata
from pathlib import Path

import pytest

import configs
from engine.model.tokenizer_build import (
    ALL_ADDED_TOKENS,
    MARKUP_TOKENS,
    MIN_VOCAB_SIZE,
    build_tokenizer,
)

VOCAB = 512

CORPUS = [
    'def add(a, b):\n    """Return the sum of a and b."""\n    return a + b\n',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
    "        self.items.append(x)\n",
    "The quick brown fox jumps over the lazy dog. Le cœur a ses raisons. 世界你好。",
    "import os\nimport sys\n\nfor name in sorted(os.listdir('.')):\n    print(name)\n",
    "Héllo wörld, naïve café — ünïcödé text; Ελληνικά, русский, 日本語, 🙂🚀.",
] * 20

SAMPLES = [
    "hello world",
    "def f(x):\n    return x * 2  # double\n\n\tindented\r\nwindows line",
    "héllo → 世界 🙂",
    "Ελληνικά русский 日本語 한국어 עברית",
    "  leading and trailing spaces  ",
    "emoji family 👨‍👩‍👧 and flags 🇫🇷",
    "q\u0303 and \u00e0\u0301 combining marks",  # NFC keeps these combining sequences
    "",
]

QWEN35_CONFIG = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "qwen3_5_text",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "tie_word_embeddings": True,
        "attn_output_gate": True,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
        },
    },
}


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("tok")
    plain = base / "plain"
    build_tokenizer(iter(CORPUS), VOCAB, plain)
    model = base / "model"
    shutil.copytree(plain, model)
    (model / "config.json").write_text(json.dumps(QWEN35_CONFIG))
    return {"plain": plain, "model": model}


def _hf(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _raw(path: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json"))


def test_samples_are_nfc():
    assert all(unicodedata.normalize("NFC", s) == s for s in SAMPLES)


def test_files_and_config(tok_dirs):
    d = tok_dirs["plain"]
    for name in (
        "vocab.json",
        "merges.txt",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ):
        assert (d / name).is_file(), name
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] in ("Qwen2Tokenizer", "Qwen2TokenizerFast")
    assert cfg["eos_token"] == "<|im_end|>"
    assert cfg["pad_token"] == "<|endoftext|>"
    template = configs.text(configs.CHAT_TEMPLATE)
    assert cfg["chat_template"] == template
    assert (d / "chat_template.jinja").read_text() == template
    vocab = json.loads((d / "vocab.json").read_text())
    assert len(vocab) == VOCAB - len(ALL_ADDED_TOKENS)
    merges = (d / "merges.txt").read_text().splitlines()
    assert merges[0].startswith("#version")
    assert 0 < len(merges) - 1 <= len(vocab) - 256


def test_rejects_too_small_vocab(tmp_path):
    with pytest.raises(ValueError):
        build_tokenizer(CORPUS, MIN_VOCAB_SIZE - 1, tmp_path)


def test_tiny_vocab_builds(tmp_path):
    build_tokenizer(["abc abd abe " * 50], 300, tmp_path)
    tok = _hf(tmp_path)
    assert tok.decode(tok.encode("abc → 世界")) == "abc → 世界"
    assert tok.convert_tokens_to_ids("<|im_end|>") == len(tok) - len(MARKUP_TOKENS) - 1


@pytest.mark.parametrize("folder", ["plain", "model"])
def test_added_token_ids(tok_dirs, folder):
    tok = _hf(tok_dirs[folder])
    assert len(tok) == VOCAB
    base = VOCAB - len(ALL_ADDED_TOKENS)
    for i, t in enumerate(ALL_ADDED_TOKENS):
        assert tok.convert_tokens_to_ids(t) == base + i
        assert tok.encode(t, add_special_tokens=False) == [base + i]
    assert tok.eos_token_id == base + 2
    assert tok.pad_token_id == base
    assert tok.bos_token is None
    # special tokens embedded in text are single ids, also without surrounding spaces
    ids = tok.encode(
        "<|im_start|>user\nhi<|im_end|>\n<think>\nx\n</think>\n\n<tool_call>",
        add_special_tokens=False,
    )
    for t in ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>"):
        assert ids.count(tok.convert_tokens_to_ids(t)) == 1


def test_model_folder_uses_qwen35_class_and_matches_tokenizer_json(tok_dirs):
    tok = _hf(tok_dirs["model"])
    assert type(tok).__name__ == "Qwen3_5Tokenizer"
    raw = _raw(tok_dirs["model"])
    for s in SAMPLES + CORPUS[:5]:
        assert tok.encode(s, add_special_tokens=False) == raw.encode(s).ids, s


@pytest.mark.parametrize("folder", ["plain", "model"])
def test_hf_round_trip(tok_dirs, folder):
    tok = _hf(tok_dirs[folder])
    raw = _raw(tok_dirs[folder])
    for s in SAMPLES:
        ids = tok.encode(s, add_special_tokens=False)
        assert tok.decode(ids) == s
        if "\u0303" not in s:  # Qwen2 regex (tokenizer-only folder) differs only on marks
            assert ids == raw.encode(s).ids, s
    # markup tokens stay visible when special tokens are skipped; control tokens do not
    ids = tok.encode(
        "<|im_start|>a<think>b</think><tool_call>c</tool_call><|im_end|>", add_special_tokens=False
    )
    assert tok.decode(ids, skip_special_tokens=True) == "a<think>b</think><tool_call>c</tool_call>"


@pytest.mark.parametrize("folder", ["plain", "model"])
def test_mlx_lm_load(tok_dirs, folder):
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(tok_dirs[folder])
    hf = _hf(tok_dirs[folder])
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    assert im_end in tok.eos_token_ids
    assert tok.has_thinking
    assert tok.think_start == "<think>"
    assert tok.think_end == "</think>"
    assert isinstance(tok._detokenizer, BPEStreamingDetokenizer)
    for s in SAMPLES:
        ids = tok.encode(s, add_special_tokens=False)
        assert ids == hf.encode(s, add_special_tokens=False)
        assert tok.decode(ids) == s
        # token-by-token streaming never splits a multi-byte character
        det = tok.detokenizer
        pieces = []
        for t in ids:
            det.add_token(t)
            pieces.append(det.last_segment)
        det.finalize()
        pieces.append(det.last_segment)
        # (mlx-lm's BPE streaming detokenizer drops one leading space of the whole text)
        assert "".join(pieces) == (s[1:] if s.startswith(" ") else s)
        assert all("\ufffd" not in p for p in pieces)


# --- chat template ---------------------------------------------------------------------------

USER = [{"role": "user", "content": "Write hello."}]


@pytest.mark.parametrize("folder", ["plain", "model"])
def test_chat_generation_prompt_thinking_on_off(tok_dirs, folder):
    tok = _hf(tok_dirs[folder])
    on = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    assert on == "<|im_start|>user\nWrite hello.<|im_end|>\n<|im_start|>assistant\n<think>\n"
    off = tok.apply_chat_template(
        USER, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert off == (
        "<|im_start|>user\nWrite hello.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    # the mlx-lm wrapper thinks by default and forwards enable_thinking
    from mlx_lm.utils import load_tokenizer

    mtok = load_tokenizer(tok_dirs[folder])
    assert mtok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True) == on
    assert (
        mtok.apply_chat_template(
            USER, tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        == off
    )
    ids = mtok.apply_chat_template(USER, add_generation_prompt=True)
    assert ids == tok.encode(on, add_special_tokens=False)


def test_chat_system_list_content_and_history(tok_dirs):
    tok = _hf(tok_dirs["model"])
    msgs = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}],
        },
        {"role": "assistant", "content": "Hello.", "reasoning_content": "greet back"},
        {"role": "user", "content": "Again"},
    ]
    out = tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert out == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"  # historical reasoning dropped
        "<|im_start|>user\nAgain<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    # the last assistant turn (after the last user query) keeps its reasoning
    full = tok.apply_chat_template(
        msgs[:2] + [{"role": "assistant", "content": "Hello.", "reasoning_content": "greet"}],
        tokenize=False,
    )
    assert full.endswith("<|im_start|>assistant\n<think>\ngreet\n</think>\n\nHello.<|im_end|>\n")


def test_chat_tools(tok_dirs):
    tok = _hf(tok_dirs["model"])
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather for a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ]
    msgs = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
                },
            ],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "22C"},
    ]
    out = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert out.startswith(
        "<|im_start|>system\n# Tools\n\nYou have access to the following "
        "functions:\n\n<tools>\n" + json.dumps(tools[0], ensure_ascii=False)
    )
    assert "<tool_call>\n<function=example_function_name>\n" in out
    assert "</IMPORTANT>\n\nYou are helpful.<|im_end|>\n" in out
    assert out.endswith(
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\n22C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )
    # tool markup tokenizes to single ids
    ids = tok.encode(out, add_special_tokens=False)
    for t in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"):
        assert tok.convert_tokens_to_ids(t) in ids
    assert tok.decode(ids) == out


def test_chat_tool_call_with_content(tok_dirs):
    tok = _hf(tok_dirs["plain"])
    msgs = [
        {"role": "user", "content": "Q"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {"function": {"name": "f", "arguments": {"x": [1, 2]}}},
                {"function": {"name": "g", "arguments": {}}},
            ],
        },
    ]
    out = tok.apply_chat_template(msgs, tokenize=False)
    assert out.endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\nLet me check.\n\n"
        "<tool_call>\n<function=f>\n<parameter=x>\n[1, 2]\n</parameter>\n</function>\n</tool_call>"
        "\n<tool_call>\n<function=g>\n</function>\n</tool_call><|im_end|>\n"
    )
