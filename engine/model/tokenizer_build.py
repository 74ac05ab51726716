"""Train a small Qwen-style byte-level BPE tokenizer and save it in Hugging Face layout.

Used by ``scripts/train_demo_model.py`` (the embedded demo checkpoint, 8k vocabulary) and by test
fixtures that build random checkpoints (vocabularies of a few hundred ids, built in well under a
second).

The saved folder loads identically through ``transformers.AutoTokenizer`` and mlx-lm, both in a
tokenizer-only folder and next to a ``config.json`` whose ``model_type`` is ``qwen3_5`` (where
transformers 5.x substitutes its own ``Qwen3_5Tokenizer`` class and rebuilds the pre-tokenizer
from the class, ignoring the one in tokenizer.json). To make that substitution harmless the BPE is
trained with exactly the pre-tokenizer that ``Qwen3_5Tokenizer`` builds (the Qwen3.5 split regex,
which also keeps combining marks with their letters). ``tokenizer_config.json`` names
``Qwen2Tokenizer``, as Qwen's own Qwen3.5 checkpoints do (transformers lists qwen3_5 among the
models whose hub tokenizer_class it overrides). In a tokenizer-only folder, with no config.json,
transformers therefore re-splits with the Qwen2 regex, which differs from the Qwen3.5 one only on
Unicode combining marks (category M); text after NFC rarely has any.

Special tokens are appended AFTER the base vocabulary, as in Qwen's own tokenizers:
``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` (special) then ``<think>``, ``</think>``,
``<tool_call>``, ``</tool_call>``, ``<tool_response>``, ``</tool_response>`` (added but not special,
so they stay visible in decoded text).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import configs

#: The Qwen3.5 pre-tokenizer split regex (identical to transformers' ``Qwen3_5Tokenizer``).
QWEN35_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"""
    r""" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

#: Special (control) tokens, in id order after the base vocabulary.
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: Added, non-special tokens (visible in decoded text), in id order after SPECIAL_TOKENS.
MARKUP_TOKENS: tuple[str, ...] = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
ALL_ADDED_TOKENS: tuple[str, ...] = SPECIAL_TOKENS + MARKUP_TOKENS

EOS_TOKEN = "<|im_end|>"
TOKENIZER_CLASS = "Qwen2Tokenizer"
PAD_TOKEN = "<|endoftext|>"


#: 256 byte symbols + the added tokens: the smallest vocabulary that can be built.
MIN_VOCAB_SIZE = 256 + len(ALL_ADDED_TOKENS)


def _new_tokenizer():
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    tok = Tokenizer(
        models.BPE(
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN35_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    return tok


def build_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path) -> None:
    """Train a byte-level BPE on ``texts`` and save a Qwen-style tokenizer folder in ``out_dir``.

    ``vocab_size`` counts every id, the added tokens included: the base BPE gets
    ``vocab_size - 9`` ids (256 byte symbols + merges) and the 9 added tokens follow it, so
    ``len(tokenizer) == vocab_size`` always (a corpus too small to supply that many merges gets
    unreachable ``<|reserved_N|>`` placeholders at the end of the base vocabulary). Writes
    ``tokenizer.json``, ``vocab.json``, ``merges.txt``, ``tokenizer_config.json``,
    ``special_tokens_map.json`` and ``chat_template.jinja``.
    """
    from tokenizers import AddedToken, pre_tokenizers, trainers

    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE}, got {vocab_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = _new_tokenizer()
    base_size = vocab_size - len(ALL_ADDED_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=base_size,
        min_frequency=1,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        limit_alphabet=256,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    base = tok.get_vocab_size(with_added_tokens=False)
    if base < base_size:
        # A corpus too small for that many merges: pad the base vocabulary with unreachable
        # placeholder entries (no merge produces them), so that len(tokenizer) == vocab_size and
        # the added tokens keep their ids.
        from tokenizers import Tokenizer

        data = json.loads(tok.to_str())
        vocab = data["model"]["vocab"]
        for i in range(base_size - base):
            vocab[f"<|reserved_{i}|>"] = base + i
        tok = Tokenizer.from_str(json.dumps(data))
        base = tok.get_vocab_size(with_added_tokens=False)
    assert base == base_size, (base, base_size)

    tok.add_special_tokens(
        [
            AddedToken(
                t, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True
            )
            for t in SPECIAL_TOKENS
        ]
    )
    tok.add_tokens(
        [
            AddedToken(
                t, single_word=False, lstrip=False, rstrip=False, normalized=False, special=False
            )
            for t in MARKUP_TOKENS
        ]
    )
    ids = {t: tok.token_to_id(t) for t in ALL_ADDED_TOKENS}
    assert [ids[t] for t in ALL_ADDED_TOKENS] == list(range(base, base + len(ALL_ADDED_TOKENS))), (
        ids
    )

    # Serialise, then normalise two fields to what Qwen's own tokenizer.json holds (the Python
    # binding of decoders.ByteLevel does not serialise its flags; they do not affect decoding).
    data = json.loads(tok.to_str())
    data["decoder"] = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": False,
    }
    data["model"]["continuing_subword_prefix"] = ""
    data["model"]["end_of_word_suffix"] = ""
    (out / "tokenizer.json").write_text(
        json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )

    # vocab.json / merges.txt, as in Qwen's checkpoints (base vocabulary only).
    vocab = data["model"]["vocab"]
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merges = data["model"]["merges"]
    lines = ["#version: 0.2"] + [m if isinstance(m, str) else " ".join(m) for m in merges]
    (out / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")

    chat_template = configs.text(configs.CHAT_TEMPLATE)  # the shipped Qwen3.5-style ChatML
    (out / "chat_template.jinja").write_text(chat_template, encoding="utf-8")

    added_tokens_decoder = {
        str(ids[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
        for t in ALL_ADDED_TOKENS
    }
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": TOKENIZER_CLASS,
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    special_map = {
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "eos_token": {
            "content": EOS_TOKEN,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
        },
        "pad_token": {
            "content": PAD_TOKEN,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
        },
    }
    (out / "special_tokens_map.json").write_text(
        json.dumps(special_map, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
