"""Qwen3.5 checkpoints whose next token depends only on the current one (a bigram model).

Every decoder layer's output projection (attention ``o_proj``, Gated DeltaNet ``out_proj``, MLP
``down_proj``) is zero, so the residual stream stays the token's embedding and the logits at a
position are ``lm_head @ rmsnorm(embed[x])``: a function of that position's token alone — yet the
engine runs its whole machinery (every layer, caches, verify, rollback) on it. The MTP head's
``fc`` passes the embedding half through, so the head predicts exactly what the trunk will: for
the pair (h_t, x_{t+1}) it returns the trunk's row for x_{t+1}, i.e. q_i == p_i up to float
rounding: scripted, every draft is accepted; flat, most are (measured 12 of 14 at top_k=3, for a
reason not pinned down here), so most drafting cycles end with a bonus draw.

Two uses:

* **scripted** (``transitions``): ``lm_head`` row ``b`` is aligned with ``rmsnorm(embed[a])`` for
  each pair a -> b, so greedy decoding from a prompt ending in ``a`` follows the chain — a real
  engine that writes exactly the text a test wants (reasoning, tool calls), as long as no token
  repeats in the chain (``distinct_tokens`` finds such a tokenization).
* **flat** (``flat_scale``): a random ``lm_head`` with small rows, so every row of logits is
  nearly uniform over the vocabulary: top-k keeps a tiny share of the mass, and a draw that
  skipped truncation lands outside it almost surely.

The tokenizer and chat template are the demo model's (its vocabulary has ``<think>``,
``<tool_call>`` and the other Qwen markers as single tokens).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from checkpoints import Variant, random_weights, text_config
from safetensors.numpy import save_file

DEMO_MODEL = Path(__file__).resolve().parent.parent / "models" / "qwen3.5-demo"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "chat_template.jinja",
)
VOCAB = 8192
HIDDEN = 64
#: ``<|im_end|>``, ``<|endoftext|>`` in the demo tokenizer
EOS = [8185, 8183]
#: a scripted row scores its intended next token SCRIPT_SCALE * HIDDEN (rmsnorm makes the squared
#: norm HIDDEN) and the other scripted tokens ~N(0, SCRIPT_SCALE**2 * HIDDEN): 64 against a
#: standard deviation of 8, so the chain is greedy's choice by a wide margin
SCRIPT_SCALE = 1.0


def bigram_weights(
    transitions: dict[int, int] | None, flat_scale: float, seed: int = 0
) -> dict[str, np.ndarray]:
    variant = Variant("bigram", tied=False, hidden=HIDDEN, vocab=VOCAB, seed=seed)
    weights = random_weights(variant)
    rng = np.random.default_rng(seed + 100)
    for name in list(weights):
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            weights[name] = np.zeros_like(weights[name])
        elif name.endswith(("norm.weight", "layernorm.weight")) and "linear_attn" not in name:
            weights[name] = np.zeros_like(weights[name])  # zero-centred: scale 1
    embed = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    weights["model.language_model.embed_tokens.weight"] = embed
    normed = embed / np.sqrt(np.mean(embed**2, axis=-1, keepdims=True) + 1e-6)
    if transitions is not None:
        head = np.zeros((VOCAB, HIDDEN), dtype=np.float32)
        for a, b in transitions.items():
            head[b] += normed[a] * SCRIPT_SCALE  # near-orthogonal: several a may lead to b
        weights["lm_head.weight"] = head
    else:
        weights["lm_head.weight"] = (
            rng.standard_normal((VOCAB, HIDDEN)) * flat_scale / np.sqrt(HIDDEN)
        ).astype(np.float32)
    fc = np.zeros((HIDDEN, 2 * HIDDEN), dtype=np.float32)
    fc[:, :HIDDEN] = np.eye(HIDDEN, dtype=np.float32)
    weights["mtp.fc.weight"] = fc
    return weights


def write_bigram_checkpoint(
    out_dir: Path,
    transitions: dict[int, int] | None = None,
    flat_scale: float = 0.5,
    seed: int = 0,
) -> Path:
    """A bigram checkpoint in HF layout (scripted with ``transitions``, else flat)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(DEMO_MODEL / name, out_dir / name)
    variant = Variant("bigram", tied=False, hidden=HIDDEN, vocab=VOCAB, seed=seed)
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text_config(variant, EOS),
        "tie_word_embeddings": False,
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"do_sample": True, "temperature": 1.0, "top_k": 20, "top_p": 0.95}
    (out_dir / "generation_config.json").write_text(
        json.dumps({**generation, "eos_token_id": EOS}, indent=2)
    )
    weights = bigram_weights(transitions, flat_scale, seed)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def distinct_tokens(tokenizer: Any, text: str, banned: set[int]) -> list[int]:
    """Token ids that decode to ``text``, no id twice and none in ``banned``.

    Depth-first over the vocabulary's tokens that match at each offset, longest first; raises
    when the text has no such tokenization (reword it: fewer repeated pieces)."""
    matches: list[list[tuple[int, int]]] = [[] for _ in text]  # offset -> (length, id)
    for i in range(len(tokenizer)):
        s = tokenizer.decode([i])
        if not s or "\ufffd" in s or i in banned:
            continue
        at = text.find(s)
        while at >= 0:
            matches[at].append((len(s), i))
            at = text.find(s, at + 1)
    for options in matches:
        options.sort(reverse=True)
    used: set[int] = set()
    out: list[int] = []
    budget = [100_000]

    def search(pos: int) -> bool:
        if pos == len(text):
            return True
        budget[0] -= 1
        if budget[0] < 0:
            return False
        for length, i in matches[pos]:
            if i in used:
                continue
            used.add(i)
            out.append(i)
            if search(pos + length):
                return True
            used.discard(i)
            out.pop()
        return False

    if not search(0):
        raise ValueError(f"no tokenization of {text!r} without repeated tokens")
    return out


def script_transitions(
    tokenizer: Any, scripts: dict[int, str], eos: int = EOS[0]
) -> tuple[dict[int, int], dict[int, list[int]]]:
    """The bigram map that writes ``scripts[last]`` (then ``eos``) after a prompt ending in token
    ``last``; also each script's token ids. Scripts share no token with each other or with the
    triggers."""
    banned = set(scripts) | set(EOS)
    transitions: dict[int, int] = {}
    ids: dict[int, list[int]] = {}
    for last, text in scripts.items():
        chain = distinct_tokens(tokenizer, text, banned)
        banned |= set(chain)
        ids[last] = chain
        for a, b in zip([last, *chain], [*chain, eos], strict=True):
            transitions[a] = b
    return transitions, ids
