#!/usr/bin/env python
"""Train, export and check the embedded demo checkpoint ``models/qwen3.5-demo``.

A 9.9 M-parameter Qwen3.5-shaped text model (8 layers: 6 Gated DeltaNet + 2 gated full
attention) with Qwen's one-layer MTP head, trained jointly on
offline text only: the CPython standard library's sources (tests excluded), the reference prose in
``pydoc_data/topics.py`` and chat-formatted requests built from them (through
``configs/chat_template.jinja``). Loss = next-token CE + 0.5 x head CE for x_{t+2}. A second,
short stage (``finetune-head``) then trains the head alone, trunk frozen, to match the trunk's
distribution at draft depths 1-4, as mtpserve drafts with it.

Training runs in PyTorch on CPU (dev-only dependency: ``pip install torch``) with transformers'
own Qwen3.5 classes for the trunk; the export is checked against mlx-lm, an independent
implementation, which proves the checkpoint's layout, norm and conv conventions. See the model
card (``models/qwen3.5-demo/README.md``) for why torch and for the measured numbers.

One command runs everything, reproducibly (seeded, resumable: rerun the same command after an
interruption and it continues from the last checkpoint under ``runs/``)::

    python scripts/train_demo_model.py all

Steps (each can be run alone): ``prepare`` (corpus split, tokenizer, token streams,
``configs/bench_prompts.jsonl``), ``train``, ``finetune-head``, ``export``, ``evaluate``,
``verify`` (mlx-lm logits vs torch), ``accept`` (free-running greedy / sampled draft-vs-trunk
acceptance simulation in torch) and ``engine-accept`` (the same bench prompts through
``mtpserve generate`` at K=1).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import random
import re
import sys
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_STDLIB = Path("/root/.pyenv/versions/3.11.7/lib/python3.11")
RUN_DIR = ROOT / "runs" / "demo"
OUT_DIR = ROOT / "models" / "qwen3.5-demo"
BENCH_PROMPTS = ROOT / "configs" / "bench_prompts.jsonl"

SEED = 1234
VOCAB_SIZE = 8192
HELDOUT_PERCENT = 5  # files / topics whose hash falls below this go to the held-out split


# ------------------------------------------------------------------------------------------------
# Hyper-parameters
# ------------------------------------------------------------------------------------------------


@dataclass
class ModelShape:
    hidden_size: int = 256
    num_hidden_layers: int = 8
    intermediate_size: int = 768
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    linear_conv_kernel_dim: int = 4
    full_attention_interval: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 4096
    vocab_size: int = VOCAB_SIZE


@dataclass
class TrainConfig:
    seq_len: int = 512
    batch_size: int = 4
    steps: int = 1500
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_weight: float = 0.5
    ckpt_every: int = 100
    seed: int = SEED


@dataclass
class HeadTuneConfig:
    """Second stage: the MTP head alone, trunk frozen, distilled from the trunk over unrolled
    draft depths (``finetune-head``)."""

    depths: int = 4  # mtpserve drafts up to 4 tokens (engine/scheduling/autok.py MAX_AUTO_K)
    steps: int = 600
    batch_size: int = 4
    seq_len: int = 512
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    grad_clip: float = 1.0
    seed: int = SEED + 1  # another window order than the first stage


# ------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------

EXCLUDED_PARTS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


def _is_heldout(key: str) -> bool:
    return int(hashlib.sha1(key.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def list_sources(stdlib: Path) -> list[Path]:
    files = []
    for p in sorted(stdlib.rglob("*.py")):
        rel = p.relative_to(stdlib)
        if EXCLUDED_PARTS & set(rel.parts[:-1]) or rel.parts[0].startswith("config-"):
            continue
        if rel.name.startswith("test_") or rel.parts[0] == "pydoc_data":
            continue
        files.append(p)
    return files


def load_topics(stdlib: Path) -> dict[str, str]:
    ns: dict = {}
    exec(
        compile(
            (stdlib / "pydoc_data" / "topics.py").read_text(encoding="utf-8"), "topics", "exec"
        ),
        ns,
    )
    return {k: v.strip() + "\n" for k, v in sorted(ns["topics"].items())}


def _summary(doc: str, limit: int = 300) -> str:
    para = doc.strip().split("\n\n")[0]
    para = re.sub(r"\s+", " ", para).strip()
    if len(para) > limit:
        para = para[:limit].rsplit(" ", 1)[0] + " ..."
    return para


def _first_sentence(text: str) -> str:
    m = re.match(r"(.+?[.!?])(\s|$)", text)
    return m.group(1) if m else text


def extract_functions(text: str) -> list[dict]:
    """Functions and methods with a docstring: name, summary, dedented source, def+docstring."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        doc = ast.get_docstring(node)
        if not doc or node.name.startswith("__") or len(doc.strip()) < 10:
            continue
        src = textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno]))
        if not (80 <= len(src) <= 1800):
            continue
        body0 = node.body[0]
        head = textwrap.dedent("".join(lines[node.lineno - 1 : body0.end_lineno]))
        out.append(
            {"name": node.name, "summary": _summary(doc), "code": src.rstrip() + "\n", "head": head}
        )
    return out


def module_doc(text: str) -> str | None:
    try:
        doc = ast.get_docstring(ast.parse(text))
    except SyntaxError:
        return None
    if doc and len(doc) >= 80:
        return doc.strip()[:1500]
    return None


CODE_REQUESTS = [
    "Write the function {name}: {summary}",
    "Write a Python function `{name}`. {summary}",
    "Implement {name} in Python. It should do this: {summary}",
    "How would you write `{name}`? {summary}",
]
CODE_ANSWERS = [
    "```python\n{code}```",
    "Here is `{name}`:\n\n```python\n{code}```",
    "Here is an implementation of `{name}`:\n\n```python\n{code}```",
]
THOUGHTS = [
    "",
    "The user wants `{name}`. {first}",
    "I will write `{name}` in Python.",
    "{first} Let me write it.",
]
TOPIC_REQUESTS = [
    'Explain the Python topic "{key}".',
    "What does the Python reference say about {key}?",
    "Tell me about {key} in Python.",
]
MODULE_REQUESTS = [
    "What does the Python module {mod} do?",
    "Describe the {mod} module.",
]
SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a concise Python expert."]


def _trim(text: str, limit: int = 1500) -> str:
    if len(text) <= limit:
        return text.strip()
    cut = text[:limit]
    para = cut.rfind("\n\n")
    return (cut[:para] if para > limit // 3 else cut.rsplit(" ", 1)[0]).strip()


class ChatRenderer:
    def __init__(self, tok_dir: Path):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(tok_dir))

    def render(self, rng: random.Random, user: str, answer: str, thought: str) -> tuple[str, str]:
        """(prompt, completion). They are tokenized separately, as at inference, where the
        prompt ends exactly at the generation prompt: otherwise e.g. "<think>\\n" + "\\n</think>"
        would merge into one "\\n\\n" token that a model never sees after a real prompt."""
        msgs = []
        if rng.random() < 0.2:
            msgs.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        msgs.append({"role": "user", "content": user})
        mode = rng.random()
        thinking = mode < 0.6
        prompt = self.tok.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
        )
        if thinking:
            reasoning = thought if mode < 0.35 else ""
            # the prompt ends in "<think>\n"; as in Qwen's own rendering, the reasoning (possibly
            # empty) is followed by "\n</think>\n\n"
            return prompt, reasoning + "\n</think>\n\n" + answer + "<|im_end|>\n"
        return prompt, answer + "<|im_end|>\n"


def build_documents(stdlib: Path, renderer: ChatRenderer | None, seed: int):
    """All documents, split into train / held-out. Each is (kind, segments): the segments of a
    document (one text, or a chat's prompt and completion) are tokenized separately."""
    rng = random.Random(seed)
    split: dict[str, list[tuple[str, tuple[str, ...]]]] = {"train": [], "heldout": []}
    heldout_funcs, heldout_topics, heldout_modules = [], [], []
    for path in list_sources(stdlib):
        rel = str(path.relative_to(stdlib))
        text = path.read_text(encoding="utf-8", errors="replace")
        part = "heldout" if _is_heldout(rel) else "train"
        split[part].append(("code", (text,)))
        funcs = extract_functions(text)
        mod = rel[:-3].replace("/", ".").removesuffix(".__init__")
        mdoc = module_doc(text)
        if part == "heldout":
            heldout_funcs += [dict(f, file=rel) for f in funcs]
            if mdoc:
                heldout_modules.append((mod, mdoc))
        if renderer is None:
            continue
        for f in funcs:
            fmt = dict(
                name=f["name"],
                summary=f["summary"],
                code=f["code"],
                first=_first_sentence(f["summary"]),
            )
            user = rng.choice(CODE_REQUESTS).format(**fmt)
            answer = rng.choice(CODE_ANSWERS).format(**fmt)
            thought = rng.choice(THOUGHTS).format(**fmt).strip()
            split[part].append(("chat", renderer.render(rng, user, answer, thought)))
        if mdoc:
            user = rng.choice(MODULE_REQUESTS).format(mod=mod)
            thought = f"The user asks about the {mod} module."
            split[part].append(("chat", renderer.render(rng, user, _trim(mdoc), thought)))
    for key, text in load_topics(stdlib).items():
        part = "heldout" if _is_heldout("topic:" + key) else "train"
        split[part].append(("prose", (text,)))
        if part == "heldout":
            heldout_topics.append((key, text))
        if renderer is None:
            continue
        user = rng.choice(TOPIC_REQUESTS).format(key=key)
        thought = f"The user asks about {key}."
        split[part].append(("chat", renderer.render(rng, user, _trim(text), thought)))
    return split, heldout_funcs, heldout_topics, heldout_modules


def write_bench_prompts(heldout_funcs, heldout_topics, heldout_modules, seed: int) -> list[dict]:
    rng = random.Random(seed + 1)
    funcs = sorted(heldout_funcs, key=lambda f: (f["file"], f["name"]))
    rng.shuffle(funcs)
    rows = []
    seen = set()
    for f in funcs:  # code completion: def line + docstring, the model writes the body
        if len([r for r in rows if r["category"] == "code"]) == 8:
            break
        if f["file"] in seen or len(f["head"]) > 600:
            continue
        seen.add(f["file"])
        rows.append(
            {
                "id": f"code-{len(seen):02d}",
                "category": "code",
                "prompt": f["head"],
                "chat": False,
                "source": f"{f['file']}:{f['name']}",
            }
        )
    topics = list(heldout_topics)
    rng.shuffle(topics)
    mods = sorted(heldout_modules)
    rng.shuffle(mods)
    # prose: the opening of held-out reference topics, then of held-out module docstrings
    prose = [(text, f"pydoc_data/topics.py:{key}") for key, text in topics[:6]]
    prose += [(doc, f"{mod} (module docstring)") for mod, doc in mods[: 8 - len(prose)]]
    for i, (text, source) in enumerate(prose):
        words = text.split(" ")
        prompt = " ".join(words[:40])
        if prompt.rfind(".") > 100:
            prompt = prompt[: prompt.rfind(".") + 1]
        rows.append(
            {
                "id": f"prose-{i + 1:02d}",
                "category": "prose",
                "prompt": prompt,
                "chat": False,
                "source": source,
            }
        )
    chat_funcs = [f for f in funcs if f["file"] not in seen][:5]
    n = 0
    for f in chat_funcs:
        n += 1
        rows.append(
            {
                "id": f"chat-{n:02d}",
                "category": "chat",
                "prompt": CODE_REQUESTS[0].format(name=f["name"], summary=f["summary"]),
                "chat": True,
                "source": f"{f['file']}:{f['name']}",
            }
        )
    for key, _ in topics[6:8]:
        n += 1
        rows.append(
            {
                "id": f"chat-{n:02d}",
                "category": "chat",
                "prompt": TOPIC_REQUESTS[0].format(key=key),
                "chat": True,
                "source": f"pydoc_data/topics.py:{key}",
            }
        )
    for mod, _ in mods[8 - len(topics[:6]) :][: max(1, 8 - n)]:
        n += 1
        rows.append(
            {
                "id": f"chat-{n:02d}",
                "category": "chat",
                "prompt": MODULE_REQUESTS[0].format(mod=mod),
                "chat": True,
                "source": f"{mod} (module docstring)",
            }
        )
    BENCH_PROMPTS.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return rows


def prepare(args) -> None:
    import numpy as np

    from engine.model.tokenizer_build import build_tokenizer

    stdlib = Path(args.stdlib)
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    tok_dir = RUN_DIR / "tokenizer"
    t0 = time.time()
    plain, *_ = build_documents(stdlib, None, args.seed)
    train_texts = [t for _, segs in plain["train"] for t in segs]
    build_tokenizer(train_texts, VOCAB_SIZE, tok_dir)
    print(
        f"tokenizer: {VOCAB_SIZE} ids trained on {len(train_texts)} documents "
        f"({sum(map(len, train_texts)) / 1e6:.1f} MB) in {time.time() - t0:.1f}s"
    )

    renderer = ChatRenderer(tok_dir)
    split, hfuncs, htopics, hmods = build_documents(stdlib, renderer, args.seed)
    rows = write_bench_prompts(hfuncs, htopics, hmods, args.seed)
    print(f"bench prompts: {len(rows)} -> {BENCH_PROMPTS.relative_to(ROOT)}")

    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    eot = tk.token_to_id("<|endoftext|>")
    stats = {}
    for part, docs in split.items():
        rng = random.Random(args.seed + (part == "heldout"))
        docs = list(docs)
        rng.shuffle(docs)
        encoded = iter(
            tk.encode_batch([t for _, segs in docs for t in segs], add_special_tokens=False)
        )
        chunks, kinds = [], {}
        for kind, segs in docs:
            ids = [i for _ in segs for i in next(encoded).ids]
            chunks.append(np.asarray(ids + [eot], dtype=np.int32))
            k = kinds.setdefault(kind, [0, 0, 0])
            k[0] += 1
            k[1] += len(ids) + 1
            k[2] += sum(len(t.encode()) for t in segs)
        stream = np.concatenate(chunks)
        np.save(RUN_DIR / f"{part}.npy", stream)
        stats[part] = {
            "tokens": int(stream.size),
            "kinds": {k: {"docs": v[0], "tokens": v[1], "bytes": v[2]} for k, v in kinds.items()},
        }
        print(
            f"{part}: {stream.size / 1e6:.2f} M tokens; "
            + ", ".join(
                f"{k} {v[0]} docs {v[1] / 1e6:.2f} M tok ({v[2] / max(v[1], 1):.2f} B/tok)"
                for k, v in kinds.items()
            )
        )
    (RUN_DIR / "data_stats.json").write_text(json.dumps(stats, indent=2))


# ------------------------------------------------------------------------------------------------
# Model (PyTorch, transformers' Qwen3.5 classes for the trunk)
# ------------------------------------------------------------------------------------------------


def rope_parameters(shape: ModelShape) -> dict:
    return {
        "rope_type": "default",
        "rope_theta": shape.rope_theta,
        "partial_rotary_factor": shape.partial_rotary_factor,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    }


def layer_types(shape: ModelShape) -> list[str]:
    return [
        "full_attention" if (i + 1) % shape.full_attention_interval == 0 else "linear_attention"
        for i in range(shape.num_hidden_layers)
    ]


def hf_text_config(shape: ModelShape, eos_id: int, pad_id: int):
    from transformers import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_hidden_layers,
        intermediate_size=shape.intermediate_size,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        linear_num_key_heads=shape.linear_num_key_heads,
        linear_num_value_heads=shape.linear_num_value_heads,
        linear_key_head_dim=shape.linear_key_head_dim,
        linear_value_head_dim=shape.linear_value_head_dim,
        linear_conv_kernel_dim=shape.linear_conv_kernel_dim,
        full_attention_interval=shape.full_attention_interval,
        layer_types=layer_types(shape),
        rms_norm_eps=shape.rms_norm_eps,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=True,
        rope_parameters=rope_parameters(shape),
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        hidden_act="silu",
        attention_bias=False,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def build_model(shape: ModelShape, eos_id: int, pad_id: int):
    import copy

    import torch
    from torch import nn
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        Qwen3_5DecoderLayer,
        Qwen3_5RMSNorm,
        Qwen3_5TextModel,
    )

    cfg = hf_text_config(shape, eos_id, pad_id)

    class MTPHead(nn.Module):
        def __init__(self):
            super().__init__()
            H = shape.hidden_size
            self.fc = nn.Linear(2 * H, H, bias=False)
            self.pre_fc_norm_embedding = Qwen3_5RMSNorm(H, eps=shape.rms_norm_eps)
            self.pre_fc_norm_hidden = Qwen3_5RMSNorm(H, eps=shape.rms_norm_eps)
            head_cfg = copy.deepcopy(cfg)
            head_cfg.layer_types = ["full_attention"]
            head_cfg.num_hidden_layers = 1
            self.layers = nn.ModuleList([Qwen3_5DecoderLayer(head_cfg, 0)])
            self.norm = Qwen3_5RMSNorm(H, eps=shape.rms_norm_eps)

    class DemoModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = cfg
            self.model = Qwen3_5TextModel(cfg)
            self.mtp = MTPHead()
            std = cfg.initializer_range
            for m in self.mtp.modules():
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=std)
                elif isinstance(m, Qwen3_5RMSNorm):
                    nn.init.zeros_(m.weight)

        def lm_head(self, x):
            return x @ self.model.embed_tokens.weight.T

        def trunk(self, ids, **kw):
            """Post-final-norm hidden states [B, T, H]."""
            return self.model(input_ids=ids, **kw).last_hidden_state

        def head(self, h, next_ids, start: int = 0):
            """MTP head over pairs (h_t, x_{t+1}) at positions start.. -> logits for x_{t+2}."""
            e = self.mtp.pre_fc_norm_embedding(self.model.embed_tokens(next_ids))
            z = self.mtp.fc(torch.cat([e, self.mtp.pre_fc_norm_hidden(h)], dim=-1))
            pos = torch.arange(start, start + z.shape[1])[None]
            pe = self.model.rotary_emb(z, pos)
            z = self.mtp.layers[0](z, position_embeddings=pe, attention_mask=None)
            return self.lm_head(self.mtp.norm(z))

        def forward(self, ids):
            h = self.trunk(ids)
            logits = self.lm_head(h)
            mtp_logits = self.head(h[:, :-1], ids[:, 1:])
            return logits, mtp_logits

    return DemoModel()


def losses(model, ids):
    import torch.nn.functional as F

    logits, mtp_logits = model(ids)
    V = logits.shape[-1]
    main = F.cross_entropy(logits[:, :-1].reshape(-1, V).float(), ids[:, 1:].reshape(-1))
    head = F.cross_entropy(mtp_logits[:, :-1].reshape(-1, V).float(), ids[:, 2:].reshape(-1))
    return main, head, logits, mtp_logits


class _ChainCache:
    """KV store for one head layer across unrolled depths: each pass appends its keys/values."""

    def __init__(self):
        self.keys = self.values = None

    def update(self, keys, values, layer_idx, **_):
        import torch

        self.keys = keys if self.keys is None else torch.cat([self.keys, keys], dim=2)
        self.values = values if self.values is None else torch.cat([self.values, values], dim=2)
        return self.keys, self.values


def _chain_mask(length: int, depth: int):
    """What a depth-``depth`` draft at origin t attends to, exactly as in the engine: the head's
    committed entries (depth 1, from trunk states) at origins <= t, then its own chain's entries
    at depths 2..depth (same origin). Shape [1, 1, length, depth * length], True = attend."""
    import torch

    t = torch.arange(length)
    blocks = [t[None, :] <= t[:, None]] + [torch.eye(length, dtype=torch.bool)] * (depth - 1)
    return torch.cat(blocks, dim=1)[None, None]


def unrolled_head_logits(model, hidden, ids, depths: int):
    """The head run as mtpserve drafts with it, teacher-forced, for every origin t < T - depths.

    Depth 1 is the ordinary pair (h_t, x_{t+1}) at position t. Depth k > 1 feeds the head's own
    post-norm output of depth k-1 with the token x_{t+k} at position t+k-1 (the engine feeds its
    draft token there; when that draft is accepted it is the token the trunk emitted). Returns
    a list of [B, L, V] logits, depth k predicting x_{t+k+1}; the trunk's distribution for that
    token sits at trunk position t+k.
    """
    import torch

    length = ids.shape[1] - depths
    mtp, cache, state, logits = model.mtp, _ChainCache(), hidden[:, :length], []
    for k in range(1, depths + 1):
        e = mtp.pre_fc_norm_embedding(model.model.embed_tokens(ids[:, k : k + length]))
        z = mtp.fc(torch.cat([e, mtp.pre_fc_norm_hidden(state)], dim=-1))
        pe = model.model.rotary_emb(z, torch.arange(k - 1, k - 1 + length)[None])
        z = mtp.layers[0](
            z, position_embeddings=pe, attention_mask=_chain_mask(length, k), cache=cache
        )
        state = mtp.norm(z)
        logits.append(model.lm_head(state))
    return logits


def depth_acceptance(head_logits, trunk_logits) -> list[tuple[float, float]]:
    """Per draft depth, teacher-forced: (greedy agreement argmax q == argmax p, expected
    sampled acceptance sum_x min(p, q) under Qwen's sampler)."""
    length = head_logits[0].shape[1]
    out = []
    for k, q in enumerate(head_logits, start=1):
        p = trunk_logits[:, k : k + length]
        greedy = (q.argmax(-1) == p.argmax(-1)).float().mean().item()
        overlap = truncated_probs(q).minimum(truncated_probs(p)).sum(-1).mean().item()
        out.append((greedy, overlap))
    return out


def special_ids(tok_dir: Path) -> dict[str, int]:
    vocab = json.loads((tok_dir / "tokenizer.json").read_text())
    return {t["content"]: t["id"] for t in vocab["added_tokens"]}


def load_stream(part: str):
    import numpy as np

    return np.load(RUN_DIR / f"{part}.npy")


def window_batch(stream, windows, seq_len: int):
    """Windows number ``windows`` of a token stream, each ``seq_len + 1`` tokens (inputs plus
    the last target), as an int64 tensor ``[len(windows), seq_len + 1]``."""
    import numpy as np
    import torch

    batch = np.stack([stream[i * seq_len : (i + 1) * seq_len + 1] for i in windows])
    return torch.from_numpy(batch.astype(np.int64))


def heldout_batches(n_windows: int, seq_len: int, batch_size: int = 4):
    """The first ``n_windows`` held-out windows (fewer if the split is shorter), in batches."""
    stream = load_stream("heldout")
    n = min(n_windows, (stream.size - 1) // seq_len)
    for i in range(0, n, batch_size):
        yield window_batch(stream, range(i, min(n, i + batch_size)), seq_len)


def window_order(n_windows: int, seed: int):
    import numpy as np

    return np.random.default_rng(seed).permutation(n_windows)


def lr_at(step: int, tc: TrainConfig | HeadTuneConfig) -> float:
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    p = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def _save_atomic(obj, path: Path) -> None:
    import torch

    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def train(args) -> None:
    import numpy as np
    import torch
    from tqdm import tqdm

    tc = TrainConfig(steps=args.steps) if args.steps else TrainConfig()
    shape = ModelShape()
    torch.set_num_threads(args.threads)
    torch.manual_seed(tc.seed)
    ids_map = special_ids(RUN_DIR / "tokenizer")
    model = build_model(shape, ids_map["<|im_end|>"], ids_map["<|endoftext|>"])
    n_params = sum(p.numel() for p in model.parameters())
    n_head = sum(p.numel() for p in model.mtp.parameters())
    print(
        f"parameters: {n_params / 1e6:.2f} M (trunk {(n_params - n_head) / 1e6:.2f} M, "
        f"MTP head {n_head / 1e6:.2f} M)"
    )

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "conv1d" not in name else no_decay).append(p)
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": tc.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=tc.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    stream = load_stream("train")
    n_windows = (stream.size - 1) // tc.seq_len
    order = window_order(n_windows, tc.seed)
    need = tc.steps * tc.batch_size
    print(
        f"train stream {stream.size / 1e6:.2f} M tokens = {n_windows} windows of {tc.seq_len}; "
        f"{tc.steps} steps x {tc.batch_size} = {need} windows ({need / n_windows:.2f} epochs)"
    )

    ckpt_path = RUN_DIR / "ckpt.pt"
    log_path = RUN_DIR / "train_log.jsonl"
    step, elapsed = 0, 0.0
    if ckpt_path.exists():
        ck = torch.load(ckpt_path, weights_only=False)
        same = {k: v for k, v in ck["train_config"].items() if k != "threads"} == asdict(tc)
        if not same or ck["shape"] != asdict(shape):
            raise SystemExit(f"{ckpt_path} was made with other settings; delete it to start over")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, elapsed = ck["step"], ck["elapsed"]
        print(f"resumed at step {step} ({elapsed / 60:.1f} min already trained)")
    if step >= tc.steps:
        print("training already complete")
        return

    model.train()
    bar = tqdm(total=tc.steps, initial=step, desc="train", dynamic_ncols=True)
    ema = None
    t_last = time.time()
    # The machine is shared: when another process takes a core, two torch threads can be several
    # times slower than one. Every 50 steps, probe the other thread count for a few steps and keep
    # whichever ran faster recently (numerics do not depend on it beyond summation order).
    options = sorted({args.threads, 1}, reverse=True)
    recent: dict[int, list[float]] = {n: [] for n in options}
    current, probe_left = args.threads, 0
    with log_path.open("a") as log:
        while step < tc.steps:
            if len(options) > 1 and step % 50 == 25 and probe_left == 0:
                probe_left = 4
            threads = next(n for n in options if n != current) if probe_left > 0 else current
            torch.set_num_threads(threads)
            idx = order[(np.arange(step * tc.batch_size, (step + 1) * tc.batch_size)) % n_windows]
            ids = window_batch(stream, idx, tc.seq_len)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, tc)
            main, head, _, _ = losses(model, ids)
            loss = main + tc.mtp_weight * head
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
            opt.step()
            step += 1
            now = time.time()
            elapsed += now - t_last
            if probe_left != 4:  # the first step after a switch pays the thread-pool change
                recent[threads] = (recent[threads] + [now - t_last])[-6:]
            t_last = now
            if probe_left > 0:
                probe_left -= 1
                if probe_left == 0 and recent[threads]:
                    other = recent[current] or [float("inf")]
                    if (
                        sorted(recent[threads])[len(recent[threads]) // 2]
                        < sorted(other)[len(other) // 2]
                    ):
                        current = threads
            m, h = main.item(), head.item()
            ema = (m, h) if ema is None else (0.95 * ema[0] + 0.05 * m, 0.95 * ema[1] + 0.05 * h)
            tps = step * tc.batch_size * tc.seq_len / max(elapsed, 1e-9)
            bar.set_postfix(
                loss=f"{ema[0]:.3f}", head=f"{ema[1]:.3f}", tok_s=f"{tps:.0f}", thr=threads
            )
            bar.update(1)
            log.write(
                json.dumps(
                    {
                        "step": step,
                        "main": m,
                        "head": h,
                        "lr": lr_at(step - 1, tc),
                        "gnorm": float(gnorm),
                        "elapsed": elapsed,
                    }
                )
                + "\n"
            )
            if step % tc.ckpt_every == 0 or step == tc.steps:
                log.flush()
                _save_atomic(
                    {
                        "model": model.state_dict(),
                        "opt": opt.state_dict(),
                        "step": step,
                        "elapsed": elapsed,
                        "train_config": asdict(tc),
                        "shape": asdict(shape),
                    },
                    ckpt_path,
                )
    bar.close()
    tokens = tc.steps * tc.batch_size * tc.seq_len
    summary = {
        "steps": tc.steps,
        "tokens": tokens,
        "train_seconds": elapsed,
        "tokens_per_second": tokens / elapsed,
        "final_main_loss_ema": ema[0],
        "final_head_loss_ema": ema[1],
        "parameters": n_params,
        "head_parameters": n_head,
    }
    (RUN_DIR / "train_summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


def finetune_head(args) -> None:
    """Second stage: distil the trunk into the MTP head over unrolled draft depths.

    Joint training teaches the head one step, from trunk states and data tokens. mtpserve drafts
    K tokens by feeding the head its own output, and a draft is accepted when it matches the
    trunk's choice (greedy) or by the overlap of the two distributions (sampled). So here the
    trunk is frozen and the head learns, at every depth 1..4 (``unrolled_head_logits``), the
    trunk's distribution: loss = sum over depths of KL(p_trunk || q_head). The trunk and so
    every output of mtpserve are unchanged; only acceptance moves. EAGLE-3's training-time test
    and Medusa-2's self-distillation are the published forms of both ideas.
    """
    import numpy as np
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    hc = HeadTuneConfig(steps=args.steps) if args.steps else HeadTuneConfig()
    done = RUN_DIR / "head.pt"
    if done.exists() and torch.load(done, weights_only=False)["config"] == asdict(hc):
        print(f"{done} already made with these settings")
        return
    torch.set_num_threads(args.threads)
    torch.manual_seed(hc.seed)
    model = load_trained(tuned_head=False)
    model.requires_grad_(False)
    model.mtp.requires_grad_(True)
    params = list(model.mtp.parameters())
    opt = torch.optim.AdamW(params, lr=hc.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    stream = load_stream("train")
    n_windows = (stream.size - 1) // hc.seq_len
    order = window_order(n_windows, hc.seed)

    def stats(tag: str) -> list[tuple[float, float]]:
        res = evaluate_depths(model, hc.depths)
        print(f"{tag}: " + ", ".join(f"d{k} {g:.3f}/{o:.3f}" for k, (g, o) in enumerate(res, 1)))
        return res

    report = {"config": asdict(hc), "before": stats("held-out greedy/sampled before")}
    t0 = time.time()
    bar = tqdm(total=hc.steps, desc="finetune-head", dynamic_ncols=True)
    with (RUN_DIR / "head_log.jsonl").open("w") as log:
        for step in range(hc.steps):
            idx = order[np.arange(step * hc.batch_size, (step + 1) * hc.batch_size) % n_windows]
            ids = window_batch(stream, idx, hc.seq_len)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, hc)
            with torch.no_grad():
                hidden = model.trunk(ids)
                target = F.log_softmax(model.lm_head(hidden).float(), dim=-1)
            heads = unrolled_head_logits(model, hidden, ids, hc.depths)
            length = heads[0].shape[1]
            per_depth = [
                F.kl_div(
                    F.log_softmax(q.float(), dim=-1),
                    target[:, k : k + length],
                    log_target=True,
                    reduction="none",
                )
                .sum(-1)
                .mean()
                for k, q in enumerate(heads, start=1)
            ]
            loss = sum(per_depth)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, hc.grad_clip)
            opt.step()
            kl = [round(x.item(), 4) for x in per_depth]
            log.write(json.dumps({"step": step + 1, "kl": kl, "lr": lr_at(step, hc)}) + "\n")
            bar.set_postfix(kl=",".join(f"{x:.2f}" for x in kl))
            bar.update(1)
    bar.close()
    report["after"] = stats("held-out greedy/sampled after")
    report["seconds"] = time.time() - t0
    _save_atomic({"mtp": model.mtp.state_dict(), "config": asdict(hc)}, RUN_DIR / "head.pt")
    (RUN_DIR / "head_summary.json").write_text(json.dumps(report, indent=2))


def evaluate_depths(model, depths: int, n_windows: int = 16, seq_len: int = 512):
    """``depth_acceptance`` averaged over held-out windows."""
    import numpy as np
    import torch

    total = np.zeros((depths, 2))
    batches = 0
    with torch.no_grad():
        for ids in heldout_batches(n_windows, seq_len):
            hidden = model.trunk(ids)
            heads = unrolled_head_logits(model, hidden, ids, depths)
            total += np.array(depth_acceptance(heads, model.lm_head(hidden)))
            batches += 1
    return [tuple(float(x) for x in row) for row in total / batches]


def load_trained(exported: bool = False, tuned_head: bool = True):
    """The trained model (fp32). ``exported``: with the bf16-rounded weights actually shipped.
    ``tuned_head``: with the head from ``finetune-head`` when that stage has run."""
    import torch

    ids_map = special_ids(RUN_DIR / "tokenizer")
    model = build_model(ModelShape(), ids_map["<|im_end|>"], ids_map["<|endoftext|>"])
    if exported:
        from safetensors.torch import load_file

        sd = load_file(str(OUT_DIR / "model.safetensors"))
        ours = {}
        for k, v in sd.items():
            k = k.replace("model.language_model.", "model.")
            ours[k] = v.float()
        missing, unexpected = model.load_state_dict(ours, strict=False)
        assert not unexpected, unexpected
        assert all("rotary" in k for k in missing), missing
    else:
        ck = torch.load(RUN_DIR / "ckpt.pt", weights_only=False)
        model.load_state_dict(ck["model"])
        if tuned_head and (RUN_DIR / "head.pt").exists():
            model.mtp.load_state_dict(torch.load(RUN_DIR / "head.pt", weights_only=False)["mtp"])
    model.eval()
    return model


@dataclass
class EvalResult:
    tokens: int
    main_loss: float
    head_loss: float
    trunk_top1: float
    head_top1: float
    head_vs_trunk_greedy: float


def evaluate_model(model, n_windows: int = 48, seq_len: int = 512) -> EvalResult:
    import torch

    tot = {
        "main": 0.0,
        "head": 0.0,
        "trunk_ok": 0,
        "head_ok": 0,
        "agree": 0,
        "n_main": 0,
        "n_head": 0,
    }
    with torch.no_grad():
        for ids in heldout_batches(n_windows, seq_len):
            main, head, logits, mtp_logits = losses(model, ids)
            nm = ids[:, 1:].numel()
            nh = ids[:, 2:].numel()
            tot["main"] += main.item() * nm
            tot["head"] += head.item() * nh
            tot["n_main"] += nm
            tot["n_head"] += nh
            trunk_pred = logits.argmax(-1)  # [B, T]: prediction for x_{t+1}
            head_pred = mtp_logits.argmax(-1)  # [B, T-1]: prediction for x_{t+2}
            tot["trunk_ok"] += (trunk_pred[:, :-1] == ids[:, 1:]).sum().item()
            tot["head_ok"] += (head_pred[:, :-1] == ids[:, 2:]).sum().item()
            # the head at t vs the trunk's greedy choice at t+1 (both see the true x_{t+1})
            tot["agree"] += (head_pred[:, :-1] == trunk_pred[:, 1:-1]).sum().item()
    return EvalResult(
        tokens=tot["n_main"],
        main_loss=tot["main"] / tot["n_main"],
        head_loss=tot["head"] / tot["n_head"],
        trunk_top1=tot["trunk_ok"] / tot["n_main"],
        head_top1=tot["head_ok"] / tot["n_head"],
        head_vs_trunk_greedy=tot["agree"] / tot["n_head"],
    )


def evaluate(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    res = {"fp32_checkpoint": asdict(evaluate_model(load_trained()))}
    if (OUT_DIR / "model.safetensors").exists():
        shipped = load_trained(exported=True)
        res["exported_bf16"] = asdict(evaluate_model(shipped))
        depths = evaluate_depths(shipped, HeadTuneConfig().depths)
        res["exported_bf16_depths"] = [{"greedy": g, "sampled": o} for g, o in depths]
    (RUN_DIR / "eval.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


# ------------------------------------------------------------------------------------------------
# Export (Hugging Face Qwen3.5 layout)
# ------------------------------------------------------------------------------------------------


def is_zero_centred_norm(name: str) -> bool:
    """Every RMSNorm weight except the GDN gated output norm (``linear_attn.norm``)."""
    parts = name.split(".")
    return parts[-1] == "weight" and "norm" in parts[-2] and "linear_attn.norm" not in name


def export(args) -> None:
    import shutil

    import torch
    from safetensors.torch import save_file

    shape = ModelShape()
    tok_dir = RUN_DIR / "tokenizer"
    ids_map = special_ids(tok_dir)
    eos, eot = ids_map["<|im_end|>"], ids_map["<|endoftext|>"]
    model = load_trained()
    OUT_DIR.mkdir(parents=True, exist_ok=True)

    tensors = {}
    inexact = 0
    for k, v in model.state_dict().items():
        if "rotary_emb" in k:
            continue
        name = k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k
        v = v.detach().float()
        if k.endswith("A_log"):
            tensors[name] = v.contiguous()
            continue
        if is_zero_centred_norm(k):
            # Store w such that 1 + w is exact in bf16: a loader that adds the 1 in bf16 (mlx-lm's
            # sanitize does) and one that adds it in fp32 then see the same scale, 1 + w rounded
            # once to bf16.
            scale = (1.0 + v).to(torch.bfloat16).float()
            w = (scale - 1.0).to(torch.bfloat16)
            inexact += int(((w.float() + 1.0) != scale).sum())
            tensors[name] = w.contiguous()
            continue
        tensors[name] = v.to(torch.bfloat16).contiguous()
    if inexact:
        print(f"warning: {inexact} norm weights whose 1 + w is not exact in bf16")
    n_mtp = sum(k.startswith("mtp.") for k in tensors)
    assert n_mtp == 15, n_mtp
    save_file(tensors, str(OUT_DIR / "model.safetensors"), metadata={"format": "pt"})

    text_config = {
        "model_type": "qwen3_5_text",
        "architectures": ["Qwen3_5ForCausalLM"],
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "intermediate_size": shape.intermediate_size,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "linear_num_key_heads": shape.linear_num_key_heads,
        "linear_num_value_heads": shape.linear_num_value_heads,
        "linear_key_head_dim": shape.linear_key_head_dim,
        "linear_value_head_dim": shape.linear_value_head_dim,
        "linear_conv_kernel_dim": shape.linear_conv_kernel_dim,
        "full_attention_interval": shape.full_attention_interval,
        "layer_types": layer_types(shape),
        "rms_norm_eps": shape.rms_norm_eps,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "tie_word_embeddings": True,
        "attn_output_gate": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "rope_parameters": rope_parameters(shape),
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "mamba_ssm_dtype": "float32",
        "dtype": "bfloat16",
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": eos,
        "pad_token_id": eot,
    }
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text_config,
        "tie_word_embeddings": True,
        "eos_token_id": eos,
        "pad_token_id": eot,
        "dtype": "bfloat16",
        "transformers_version": _version("transformers"),
    }
    (OUT_DIR / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {
        "bos_token_id": eot,
        "do_sample": True,
        "eos_token_id": [eos, eot],
        "pad_token_id": eot,
        "temperature": 1.0,
        "top_k": 20,
        "top_p": 0.95,
        "transformers_version": _version("transformers"),
    }
    (OUT_DIR / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
        "merges.txt",
        "chat_template.jinja",
        "special_tokens_map.json",
    ):
        shutil.copy(tok_dir / name, OUT_DIR / name)
    size = sum(p.stat().st_size for p in OUT_DIR.iterdir() if p.is_file())
    print(
        f"exported {len(tensors)} tensors ({n_mtp} mtp.*) to {OUT_DIR.relative_to(ROOT)}, "
        f"{size / 1e6:.1f} MB in all"
    )


def _version(pkg: str) -> str:
    from importlib.metadata import version

    return version(pkg)


# ------------------------------------------------------------------------------------------------
# Verification against mlx-lm
# ------------------------------------------------------------------------------------------------


def _use_fast_blas() -> None:
    try:
        from engine.blas import use_fast_blas  # the project's helper, once it exists

        use_fast_blas()
        return
    except ImportError:
        pass
    import ctypes

    path = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
    if os.path.exists(path):
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


def verify(args) -> None:
    """mlx_lm.load(models/qwen3.5-demo) gives the same next-token logits as the torch model
    holding the same (bf16-rounded) weights; an independent mlx MTP head from the raw mtp.*
    tensors gives the same draft logits."""
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    _use_fast_blas()
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models import qwen3_next

    tmodel = load_trained(exported=True)
    mmodel, mtok = mlx_lm.load(str(OUT_DIR))
    mmodel.set_dtype(mx.float32)
    rows = [json.loads(line) for line in BENCH_PROMPTS.read_text().splitlines()]
    texts = [r["prompt"] for r in rows[:: max(1, len(rows) // 6)]]
    texts.append('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n')
    texts.append(
        mtok.apply_chat_template(
            [{"role": "user", "content": "Write the function add: Return a + b."}],
            tokenize=False,
            add_generation_prompt=True,
        )
    )

    # an independent MTP head in mlx, built from the raw checkpoint tensors (+1 on norms once)
    cfg = json.loads((OUT_DIR / "config.json").read_text())["text_config"]
    raw = mx.load(str(OUT_DIR / "model.safetensors"))
    mtp = {k[4:]: v.astype(mx.float32) for k, v in raw.items() if k.startswith("mtp.")}
    from mlx_lm.models.qwen3_5 import TextModelArgs

    targs = TextModelArgs.from_dict(cfg)
    attn = qwen3_next.Qwen3NextAttention(targs)
    mlp = qwen3_next.Qwen3NextMLP(targs.hidden_size, targs.intermediate_size)
    attn.load_weights(
        [
            (k[len("layers.0.self_attn.") :], v + (1.0 if k.endswith("norm.weight") else 0))
            for k, v in mtp.items()
            if k.startswith("layers.0.self_attn.")
        ]
    )
    mlp.load_weights(
        [(k[len("layers.0.mlp.") :], v) for k, v in mtp.items() if k.startswith("layers.0.mlp.")]
    )
    eps = targs.rms_norm_eps

    def rms(x, w):
        return mx.fast.rms_norm(x, 1.0 + w, eps)

    def mlx_head(h, next_ids):
        emb = mmodel.language_model.model.embed_tokens
        e = rms(emb(next_ids), mtp["pre_fc_norm_embedding.weight"])
        z = (
            mx.concatenate([e, rms(h, mtp["pre_fc_norm_hidden.weight"])], axis=-1)
            @ mtp["fc.weight"].T
        )
        from mlx_lm.models.base import create_attention_mask

        mask = create_attention_mask(z, None)
        r = attn(rms(z, mtp["layers.0.input_layernorm.weight"]), mask=mask, cache=None)
        z = z + r
        z = z + mlp(rms(z, mtp["layers.0.post_attention_layernorm.weight"]))
        return emb.as_linear(rms(z, mtp["norm.weight"]))

    worst = {"trunk": 0.0, "head": 0.0}
    results = []
    for text in texts:
        ids = mtok.encode(text, add_special_tokens=False)[:200]
        with torch.no_grad():
            t_ids = torch.tensor([ids])
            h = tmodel.trunk(t_ids)
            t_logits = tmodel.lm_head(h)[0].numpy()
            t_head = tmodel.head(h[:, :-1], t_ids[:, 1:])[0].numpy()
        m_ids = mx.array([ids])
        m_logits = mmodel(m_ids)[0]
        m_h = mmodel.language_model.model(m_ids)
        m_head = mlx_head(m_h[:, :-1], m_ids[:, 1:])[0]
        mx.eval(m_logits, m_head)
        d_trunk = float(np.abs(np.asarray(m_logits) - t_logits).max())
        d_head = float(np.abs(np.asarray(m_head) - t_head).max())
        same = float((np.asarray(m_logits).argmax(-1) == t_logits.argmax(-1)).mean())
        worst["trunk"] = max(worst["trunk"], d_trunk)
        worst["head"] = max(worst["head"], d_head)
        results.append(
            {
                "tokens": len(ids),
                "max_abs_diff_trunk": d_trunk,
                "max_abs_diff_head": d_head,
                "argmax_agreement": same,
                "logit_scale": float(np.abs(t_logits).max()),
            }
        )
        print(
            f"{len(ids):4d} tokens: trunk max|diff| {d_trunk:.2e}, head max|diff| {d_head:.2e}, "
            f"argmax agree {same:.3f}"
        )
    out = {"sequences": results, "worst": worst, "eos_token_ids": sorted(mtok.eos_token_ids)}
    (RUN_DIR / "verify.json").write_text(json.dumps(out, indent=2))
    assert worst["trunk"] < 2e-3 and worst["head"] < 2e-3, worst
    print(
        f"OK: mlx-lm matches torch (worst trunk {worst['trunk']:.1e}, head {worst['head']:.1e}); "
        f"eos ids {sorted(mtok.eos_token_ids)}"
    )


# ------------------------------------------------------------------------------------------------
# Free-running acceptance simulation (K = 1)
# ------------------------------------------------------------------------------------------------


def truncated_probs(logits, temperature=1.0, top_k=20, top_p=0.95):
    """temperature -> top-k -> top-p -> softmax (fp32), vLLM's and Hugging Face's order."""
    import torch

    x = logits.float() / temperature
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if top_p < 1.0:
        sp, si = torch.sort(p, dim=-1, descending=True)
        cum = sp.cumsum(-1)
        drop = (cum - sp) >= top_p  # keep the smallest prefix reaching top_p
        sp = sp.masked_fill(drop, 0.0)
        p = torch.zeros_like(p).scatter(-1, si, sp)
        p = p / p.sum(-1, keepdim=True)
    return p


def accept(args) -> None:
    """Generate with the trunk alone (greedy, then Qwen's sampler), then measure for every
    generated position how often the MTP head's draft would be accepted at K=1: greedy
    indicator argmax q == argmax p; sampled: the speculative-sampling acceptance probability
    sum_x min(p(x), q(x)) of the identically truncated distributions. The trunk's output
    distribution does not depend on drafting, so this is the exact expected acceptance."""
    import torch
    from transformers import AutoTokenizer, DynamicCache

    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    model = load_trained(exported=True)
    tok = AutoTokenizer.from_pretrained(str(OUT_DIR))
    gen = json.loads((OUT_DIR / "generation_config.json").read_text())
    stops = set(gen["eos_token_id"])
    rows = [json.loads(line) for line in BENCH_PROMPTS.read_text().splitlines()]
    max_new = args.max_new_tokens
    report = {"max_new_tokens": max_new, "modes": {}}
    for mode in ("greedy", "sampled"):
        per_cat: dict[str, list[float]] = {}
        samples = []
        for r in rows:
            text = (
                tok.apply_chat_template(
                    [{"role": "user", "content": r["prompt"]}],
                    tokenize=False,
                    add_generation_prompt=True,
                )
                if r["chat"]
                else r["prompt"]
            )
            prompt = tok.encode(text, add_special_tokens=False)
            ids = list(prompt)
            with torch.no_grad():
                cache = DynamicCache(config=model.config)
                h = model.trunk(torch.tensor([ids]), cache=cache, use_cache=True)
                for _ in range(max_new):
                    logits = model.lm_head(h[:, -1])[0]
                    if mode == "greedy":
                        nxt = int(logits.argmax())
                    else:
                        nxt = int(torch.multinomial(truncated_probs(logits), 1))
                    ids.append(nxt)
                    if nxt in stops:
                        break
                    h = model.trunk(torch.tensor([[nxt]]), cache=cache, use_cache=True)
                full = torch.tensor([ids])
                H = model.trunk(full)
                p_logits = model.lm_head(H)[0]
                q_logits = model.head(H[:, :-1], full[:, 1:])[0]
            L = len(prompt)
            # draft for x_{t+2} made at t (from h_t, x_{t+1}); target p at t+1; x_{t+1} generated
            ts = range(L - 1, len(ids) - 2)
            if mode == "greedy":
                acc = [float(q_logits[t].argmax() == p_logits[t + 1].argmax()) for t in ts]
            else:
                acc = [
                    float(
                        torch.minimum(
                            truncated_probs(q_logits[t]), truncated_probs(p_logits[t + 1])
                        ).sum()
                    )
                    for t in ts
                ]
            per_cat.setdefault(r["category"], []).extend(acc)
            samples.append(
                {
                    "id": r["id"],
                    "generated": len(ids) - L,
                    "acceptance": sum(acc) / max(len(acc), 1),
                    "text": tok.decode(ids[L:])[:300],
                }
            )
        allv = [a for v in per_cat.values() for a in v]
        report["modes"][mode] = {
            "acceptance": sum(allv) / len(allv),
            "positions": len(allv),
            "per_category": {k: sum(v) / len(v) for k, v in sorted(per_cat.items())},
            "samples": samples,
        }
        print(
            f"{mode}: acceptance {report['modes'][mode]['acceptance']:.3f} over {len(allv)} "
            f"positions; "
            + ", ".join(f"{k} {v:.3f}" for k, v in report["modes"][mode]["per_category"].items())
        )
    (RUN_DIR / "accept.json").write_text(json.dumps(report, indent=2, ensure_ascii=False))


def engine_accept(args) -> None:
    """Acceptance measured by the project's own engine (``mtpserve generate --json``) over the
    bench prompts at K=1: greedy (temperature 0) and the checkpoint's sampler (temperature 1,
    top_k 20, top_p 0.95, from generation_config.json)."""
    import subprocess

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(OUT_DIR))
    rows = [json.loads(line) for line in BENCH_PROMPTS.read_text().splitlines()]
    exe = [sys.executable, "-m", "mtpserve.cli"]
    report = {"max_new_tokens": args.max_new_tokens, "draft_tokens": 1, "modes": {}}
    for mode, extra in (("greedy", ["--temperature", "0"]), ("sampled", ["--seed", str(SEED)])):
        per_cat: dict[str, list[int]] = {}
        tps = []
        for r in rows:
            # chat prompts are templated here (thinking on, the default) and passed as text, whose
            # special tokens encode to the same ids
            prompt = r["prompt"]
            if r["chat"]:
                msgs = [{"role": "user", "content": prompt}]
                prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            cmd = exe + ["generate", "--model", str(OUT_DIR), "--json", "--draft-tokens", "1"]
            cmd += ["--max-tokens", str(args.max_new_tokens), "--prompt", prompt]
            out = subprocess.run(cmd + extra, capture_output=True, text=True, cwd=ROOT)
            if out.returncode != 0:
                raise SystemExit(f"mtpserve generate failed on {r['id']}:\n{out.stderr[-2000:]}")
            st = json.loads(out.stdout.strip().splitlines()[-1])["stats"]
            c = per_cat.setdefault(r["category"], [0, 0])
            c[0] += st["accepted"]
            c[1] += st["proposed"]
            tps.append(st["generation_tps"])
        acc = sum(v[0] for v in per_cat.values()) / max(1, sum(v[1] for v in per_cat.values()))
        report["modes"][mode] = {
            "acceptance": acc,
            "proposed": sum(v[1] for v in per_cat.values()),
            "per_category": {k: v[0] / max(1, v[1]) for k, v in sorted(per_cat.items())},
            "mean_generation_tps": sum(tps) / len(tps),
        }
        print(
            f"engine {mode}: acceptance {acc:.3f}; "
            + ", ".join(f"{k} {v:.3f}" for k, v in report["modes"][mode]["per_category"].items())
        )
    (RUN_DIR / "engine_accept.json").write_text(json.dumps(report, indent=2))


# ------------------------------------------------------------------------------------------------


def main(argv=None) -> None:
    global RUN_DIR, OUT_DIR, BENCH_PROMPTS
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "step",
        choices=[
            "prepare",
            "train",
            "finetune-head",
            "evaluate",
            "export",
            "verify",
            "accept",
            "engine-accept",
            "all",
        ],
    )
    ap.add_argument("--stdlib", default=str(DEFAULT_STDLIB), help="CPython 3.11 Lib/ folder")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument(
        "--steps",
        type=int,
        default=0,
        help="override the number of steps of `train` and `finetune-head`",
    )
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument(
        "--threads", type=int, default=2, help="torch threads (results do not depend on it)"
    )
    ap.add_argument(
        "--run-dir",
        default=str(RUN_DIR),
        help="working folder (tokenizer, token streams, checkpoint, reports)",
    )
    ap.add_argument("--out", default=str(OUT_DIR), help="where the checkpoint is exported")
    ap.add_argument(
        "--bench-prompts",
        default=str(BENCH_PROMPTS),
        help="where `prepare` writes, and the evaluations read, the held-out prompts",
    )
    args = ap.parse_args(argv)
    # A retrain into other folders (to check that it reproduces the committed model) must not
    # overwrite the committed one; every step reads these module-level paths.
    RUN_DIR = Path(args.run_dir).resolve()
    OUT_DIR = Path(args.out).resolve()
    BENCH_PROMPTS = Path(args.bench_prompts).resolve()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    # the machine is shared: sleeping (not spinning) OpenMP workers degrade far less when
    # another process takes a core
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    steps = {
        "prepare": prepare,
        "train": train,
        "finetune-head": finetune_head,
        "evaluate": evaluate,
        "export": export,
        "verify": verify,
        "accept": accept,
        "engine-accept": engine_accept,
    }
    if args.step == "all":
        if not (RUN_DIR / "train.npy").exists():
            prepare(args)
        for name in ("train", "finetune-head", "export", "evaluate", "verify", "accept"):
            steps[name](args)
        if (ROOT / "engine" / "runtime.py").exists():
            engine_accept(args)
    else:
        steps[args.step](args)


if __name__ == "__main__":
    main()
