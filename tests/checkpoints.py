"""Tiny random Qwen3.5 checkpoints written in the real Hugging Face layout.

Raw HF conventions throughout: ``model.language_model.*`` names, zero-centred norms (stored w,
applied as 1+w), conv1d weights as ``[C, 1, kernel]``, q_proj emitting [query | gate] per head,
15 top-level ``mtp.*`` tensors, ``generation_config.json`` with two EOS ids, and a byte-level BPE
tokenizer with Qwen's special tokens.

``agreement`` steers how often the random head agrees with the random trunk: the trunk's layers
are scaled down so that (with tied-like output weights) it tends to predict tokens related to its
input, and the head's ``fc`` is biased towards the embedding half, so drafts are sometimes
accepted and sometimes rejected — both paths of the speculative loop get exercised.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from engine.model.tokenizer_build import build_tokenizer

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. ",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nimport sys\nprint(os.path.join('a', 'b'))\n",
    "Hello, world! héllo → 世界 🙂 naïve café",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n",
] * 4


@dataclass(frozen=True)
class Variant:
    name: str = "dense"
    moe: bool = False
    tied: bool = True
    shards: int = 1
    hidden: int = 64
    layers: int = 4
    intermediate: int = 128
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    vocab: int = 320
    agreement: float = 0.1
    dtype: str = "float32"
    with_mtp: bool = True
    seed: int = 0


# Agreement levels picked so that greedy outputs are varied and acceptance is partial (measured
# ~0.25 tied, ~0.55 untied): both the accept and the reject paths run in every test.
VARIANTS = {
    "dense-tied": Variant("dense-tied", agreement=0.1),
    "dense-untied-sharded": Variant(
        "dense-untied-sharded", tied=False, shards=3, agreement=0.25, seed=1
    ),
    "moe-tied": Variant("moe-tied", moe=True, agreement=0.1, seed=2),
    "moe-untied-sharded": Variant(
        "moe-untied-sharded", moe=True, tied=False, shards=2, agreement=0.25, seed=3
    ),
}


def text_config(v: Variant, eos: list[int]) -> dict:
    cfg = {
        "model_type": "qwen3_5_text",
        "hidden_size": v.hidden,
        "num_hidden_layers": v.layers,
        "intermediate_size": v.intermediate,
        "num_attention_heads": v.heads,
        "num_key_value_heads": v.kv_heads,
        "head_dim": v.head_dim,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "layer_types": [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(v.layers)
        ],
        "rms_norm_eps": 1e-6,
        "vocab_size": v.vocab,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": v.tied,
        "attn_output_gate": True,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "mtp_num_hidden_layers": 1 if v.with_mtp else 0,
        "mtp_use_dedicated_embeddings": False,
        "eos_token_id": eos[0],
    }
    if v.moe:
        cfg.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            norm_topk_prob=True,
            decoder_sparse_step=1,
        )
    return cfg


def _decoder_layer(
    rng: np.random.Generator, prefix: str, v: Variant, linear: bool, scale: float
) -> dict[str, np.ndarray]:
    h = v.hidden

    def w(*shape: int, s: float = scale) -> np.ndarray:
        return (rng.standard_normal(shape) * s / np.sqrt(shape[-1])).astype(np.float32)

    def norm(n: int) -> np.ndarray:  # zero-centred: applied as 1 + w
        return (rng.standard_normal(n) * 0.1).astype(np.float32)

    t: dict[str, np.ndarray] = {
        f"{prefix}.input_layernorm.weight": norm(h),
        f"{prefix}.post_attention_layernorm.weight": norm(h),
    }
    if linear:
        key_dim, value_dim, hv = 2 * 16, 4 * 16, 4
        conv_dim = 2 * key_dim + value_dim
        a = f"{prefix}.linear_attn"
        t.update(
            {
                f"{a}.in_proj_qkv.weight": w(conv_dim, h),
                f"{a}.in_proj_z.weight": w(value_dim, h),
                f"{a}.in_proj_b.weight": w(hv, h),
                f"{a}.in_proj_a.weight": w(hv, h),
                f"{a}.conv1d.weight": (rng.standard_normal((conv_dim, 1, 4)) * 0.5).astype(
                    np.float32
                ),
                f"{a}.dt_bias": np.ones(hv, dtype=np.float32),
                f"{a}.A_log": np.log(rng.uniform(1, 16, hv)).astype(np.float32),
                f"{a}.norm.weight": np.ones(16, dtype=np.float32),
                f"{a}.out_proj.weight": w(h, value_dim),
            }
        )
    else:
        a = f"{prefix}.self_attn"
        t.update(
            {
                f"{a}.q_proj.weight": w(2 * v.heads * v.head_dim, h),
                f"{a}.k_proj.weight": w(v.kv_heads * v.head_dim, h),
                f"{a}.v_proj.weight": w(v.kv_heads * v.head_dim, h),
                f"{a}.o_proj.weight": w(h, v.heads * v.head_dim),
                f"{a}.q_norm.weight": norm(v.head_dim),
                f"{a}.k_norm.weight": norm(v.head_dim),
            }
        )
    m = f"{prefix}.mlp"
    if v.moe:
        e, i = 4, 32
        t.update(
            {
                f"{m}.gate.weight": w(e, h, s=1.0),
                f"{m}.experts.gate_up_proj": w(e, 2 * i, h),
                f"{m}.experts.down_proj": w(e, h, i),
                f"{m}.shared_expert.gate_proj.weight": w(64, h),
                f"{m}.shared_expert.up_proj.weight": w(64, h),
                f"{m}.shared_expert.down_proj.weight": w(h, 64),
                f"{m}.shared_expert_gate.weight": w(1, h, s=1.0),
            }
        )
    else:
        t.update(
            {
                f"{m}.gate_proj.weight": w(v.intermediate, h),
                f"{m}.up_proj.weight": w(v.intermediate, h),
                f"{m}.down_proj.weight": w(h, v.intermediate),
            }
        )
    return t


def random_weights(v: Variant) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(v.seed)
    h = v.hidden
    scale = 1.0 - v.agreement
    # Tied: a small embedding so that context, not the last token, drives the output. Untied:
    # a dominant embedding and an lm_head that is a permuted copy of it, so the trunk mostly
    # predicts perm(last token) — a rule the head can learn from its embedding input — and
    # drafts are often accepted.
    embed = (rng.standard_normal((v.vocab, h)) * (0.3 if v.tied else 1.0)).astype(np.float32)
    p = "model.language_model"
    t: dict[str, np.ndarray] = {f"{p}.embed_tokens.weight": embed}
    for i in range(v.layers):
        t.update(_decoder_layer(rng, f"{p}.layers.{i}", v, (i + 1) % 4 != 0, scale))
    t[f"{p}.norm.weight"] = (rng.standard_normal(h) * 0.1).astype(np.float32)
    if not v.tied:
        noise = rng.standard_normal(embed.shape) * (1.0 - v.agreement)
        t["lm_head.weight"] = (embed[rng.permutation(v.vocab)] + noise).astype(np.float32)
    if v.with_mtp:
        fc = rng.standard_normal((h, 2 * h)).astype(np.float32) * scale / np.sqrt(2 * h)
        fc[:, :h] += np.eye(h, dtype=np.float32) * v.agreement * 2
        t["mtp.fc.weight"] = fc
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            t[f"mtp.{n}.weight"] = (rng.standard_normal(h) * 0.1).astype(np.float32)
        t.update(_decoder_layer(rng, "mtp.layers.0", v, False, scale))
    return {k: a.astype(np.float32) for k, a in t.items()}


def write_checkpoint(out_dir: Path, v: Variant) -> Path:
    """Write the variant's checkpoint (tokenizer, configs, safetensors) into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(CORPUS, v.vocab, out_dir)
    vocab = json.loads((out_dir / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in vocab["added_tokens"]}
    eos = [added["<|im_end|>"], added["<|endoftext|>"]]
    tc = text_config(v, eos)
    config = {
        "architectures": [
            "Qwen3_5MoeForConditionalGeneration" if v.moe else "Qwen3_5ForConditionalGeneration"
        ],
        "model_type": "qwen3_5_moe" if v.moe else "qwen3_5",
        "text_config": tc,
        "tie_word_embeddings": v.tied,
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "generation_config.json").write_text(
        json.dumps(
            {
                "do_sample": True,
                "temperature": 1.0,
                "top_k": 20,
                "top_p": 0.95,
                "eos_token_id": eos,
            },
            indent=2,
        )
    )
    weights = random_weights(v)
    names = sorted(weights)
    if v.shards == 1:
        _save(weights, out_dir / "model.safetensors", v.dtype)
    else:
        # Put mtp.* tensors in the last shard only, as Qwen's own checkpoints do.
        trunk = [n for n in names if not n.startswith("mtp.")]
        groups = [trunk[i :: v.shards - 1] for i in range(v.shards - 1)]
        groups.append([n for n in names if n.startswith("mtp.")])
        weight_map = {}
        for i, group in enumerate(groups):
            fname = f"model-{i + 1:05d}-of-{v.shards:05d}.safetensors"
            _save({n: weights[n] for n in group}, out_dir / fname, v.dtype)
            weight_map.update({n: fname for n in group})
        total = sum(a.nbytes for a in weights.values())
        (out_dir / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    return out_dir


def _save(weights: dict[str, np.ndarray], path: Path, dtype: str) -> None:
    """float32 through safetensors' numpy writer; other dtypes (bfloat16: what real checkpoints
    store) through mlx, which numpy cannot represent."""
    if dtype == "float32":
        save_file(weights, str(path), metadata={"format": "pt"})
        return
    import mlx.core as mx

    cast = {n: mx.array(a).astype(getattr(mx, dtype)) for n, a in weights.items()}
    mx.save_safetensors(str(path), cast, metadata={"format": "pt"})
