"""Write random-weight checkpoints with the exact shapes of real Qwen3.5 models.

    python scripts/make_shapes.py 0.8B            # -> runs/shapes/qwen3.5-0.8B
    python scripts/make_shapes.py 4B --out /tmp/qwen3.5-4B
    python scripts/make_shapes.py 35B-A3B --layers 4   # the MoE, fewer layers

Real Hugging Face layout and dtype: ``config.json`` as Qwen ships it (nested ``text_config``,
vocabulary 248,320, three Gated-DeltaNet layers then one full-attention layer, the MTP head's
15 ``mtp.*`` tensors), bf16 tensors named ``model.language_model.*`` with zero-centred norms and
conv1d weights as ``[C, 1, kernel]``, sharded with ``model.safetensors.index.json`` (the head in
the last shard, as Qwen's checkpoints do), ``generation_config.json`` with Qwen's sampler, and a
small byte-level BPE tokenizer with Qwen's special tokens (ids far below the vocabulary: the
checkpoint serves, the text means nothing). Sizes from Qwen's model cards.

Acceptance on random weights means nothing; costs, start-up and memory do. Tensors are made
and written one shard at a time (~1 GB), so writing needs about one shard of memory. Output
folders belong under a git-ignored folder (runs/ by default).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.blas import use_fast_blas  # noqa: E402

use_fast_blas()

import mlx.core as mx  # noqa: E402

from engine.model.tokenizer_build import build_tokenizer  # noqa: E402

VOCAB = 248320
#: per model: hidden, layers, attention heads / KV heads, GDN value / key heads, MLP width,
#: tied embeddings; MoE: experts, experts per token, expert and shared-expert widths
SHAPES: dict[str, dict] = {
    "0.8B": dict(hidden=1024, layers=24, heads=8, kv_heads=2, v_heads=16, k_heads=16,
                 intermediate=3584, tied=True),
    "2B": dict(hidden=2048, layers=24, heads=8, kv_heads=2, v_heads=16, k_heads=16,
               intermediate=6144, tied=True),
    "4B": dict(hidden=2560, layers=32, heads=16, kv_heads=4, v_heads=32, k_heads=16,
               intermediate=9216, tied=True),
    "9B": dict(hidden=4096, layers=32, heads=16, kv_heads=4, v_heads=32, k_heads=16,
               intermediate=12288, tied=False),
    "35B-A3B": dict(hidden=2048, layers=40, heads=16, kv_heads=2, v_heads=32, k_heads=16,
                    intermediate=512, tied=False, experts=256, experts_per_token=8,
                    shared_intermediate=512),
}  # fmt: skip
HEAD_DIM = 256
GDN_HEAD_DIM = 128
CONV_KERNEL = 4
SHARD_BYTES = 2**30
TOKENIZER_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. ",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "Write a haiku about speculative decoding. Explain how caches work in a server.",
] * 8


def text_config(s: dict, eos: list[int]) -> dict:
    cfg = {
        "model_type": "qwen3_5_moe_text" if "experts" in s else "qwen3_5_text",
        "hidden_size": s["hidden"],
        "num_hidden_layers": s["layers"],
        "intermediate_size": s["intermediate"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "head_dim": HEAD_DIM,
        "linear_num_key_heads": s["k_heads"],
        "linear_num_value_heads": s["v_heads"],
        "linear_key_head_dim": GDN_HEAD_DIM,
        "linear_value_head_dim": GDN_HEAD_DIM,
        "linear_conv_kernel_dim": CONV_KERNEL,
        "full_attention_interval": 4,
        "layer_types": [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(s["layers"])
        ],
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": s["tied"],
        "attn_output_gate": True,
        "mamba_ssm_dtype": "float32",
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "eos_token_id": eos[0],
        "dtype": "bfloat16",
    }
    if "experts" in s:
        cfg.update(
            num_experts=s["experts"],
            num_experts_per_tok=s["experts_per_token"],
            moe_intermediate_size=s["intermediate"],
            shared_expert_intermediate_size=s["shared_intermediate"],
            norm_topk_prob=True,
            decoder_sparse_step=1,
        )
    return cfg


def layer_shapes(prefix: str, s: dict, linear: bool) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of one decoder layer in Qwen's HF layout."""
    h = s["hidden"]
    t: dict[str, tuple[int, ...]] = {
        f"{prefix}.input_layernorm.weight": (h,),
        f"{prefix}.post_attention_layernorm.weight": (h,),
    }
    if linear:
        key_dim, value_dim = s["k_heads"] * GDN_HEAD_DIM, s["v_heads"] * GDN_HEAD_DIM
        conv_dim, a = 2 * key_dim + value_dim, f"{prefix}.linear_attn"
        t |= {
            f"{a}.in_proj_qkv.weight": (conv_dim, h),
            f"{a}.in_proj_z.weight": (value_dim, h),
            f"{a}.in_proj_b.weight": (s["v_heads"], h),
            f"{a}.in_proj_a.weight": (s["v_heads"], h),
            f"{a}.conv1d.weight": (conv_dim, 1, CONV_KERNEL),
            f"{a}.dt_bias": (s["v_heads"],),
            f"{a}.A_log": (s["v_heads"],),
            f"{a}.norm.weight": (GDN_HEAD_DIM,),
            f"{a}.out_proj.weight": (h, value_dim),
        }
    else:
        a = f"{prefix}.self_attn"
        t |= {
            f"{a}.q_proj.weight": (2 * s["heads"] * HEAD_DIM, h),
            f"{a}.k_proj.weight": (s["kv_heads"] * HEAD_DIM, h),
            f"{a}.v_proj.weight": (s["kv_heads"] * HEAD_DIM, h),
            f"{a}.o_proj.weight": (h, s["heads"] * HEAD_DIM),
            f"{a}.q_norm.weight": (HEAD_DIM,),
            f"{a}.k_norm.weight": (HEAD_DIM,),
        }
    m, i = f"{prefix}.mlp", s["intermediate"]
    if "experts" in s:
        e, si = s["experts"], s["shared_intermediate"]
        t |= {
            f"{m}.gate.weight": (e, h),
            f"{m}.experts.gate_up_proj": (e, 2 * i, h),
            f"{m}.experts.down_proj": (e, h, i),
            f"{m}.shared_expert.gate_proj.weight": (si, h),
            f"{m}.shared_expert.up_proj.weight": (si, h),
            f"{m}.shared_expert.down_proj.weight": (h, si),
            f"{m}.shared_expert_gate.weight": (1, h),
        }
    else:
        t |= {
            f"{m}.gate_proj.weight": (i, h),
            f"{m}.up_proj.weight": (i, h),
            f"{m}.down_proj.weight": (h, i),
        }
    return t


def all_shapes(s: dict) -> dict[str, tuple[int, ...]]:
    p, h = "model.language_model", s["hidden"]
    shapes: dict[str, tuple[int, ...]] = {f"{p}.embed_tokens.weight": (VOCAB, h)}
    for i in range(s["layers"]):
        shapes |= layer_shapes(f"{p}.layers.{i}", s, linear=(i + 1) % 4 != 0)
    shapes[f"{p}.norm.weight"] = (h,)
    if not s["tied"]:
        shapes["lm_head.weight"] = (VOCAB, h)
    shapes["mtp.fc.weight"] = (h, 2 * h)
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        shapes[f"mtp.{n}.weight"] = (h,)
    shapes |= layer_shapes("mtp.layers.0", s, linear=False)
    return shapes


def random_tensor(name: str, shape: tuple[int, ...], key: mx.array) -> mx.array:
    """Random values of a plausible scale: norms zero-centred (raw HF), projections ~1/sqrt(in)."""
    if name.endswith("A_log"):
        return mx.log(mx.random.uniform(1, 16, shape, key=key)).astype(mx.bfloat16)
    if name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
        return mx.ones(shape, dtype=mx.bfloat16)
    if len(shape) == 1:  # zero-centred norms: stored w, applied as 1 + w
        return (0.1 * mx.random.normal(shape, key=key)).astype(mx.bfloat16)
    scale = 0.02 if "embed_tokens" in name or "lm_head" in name else 1 / math.sqrt(shape[-1])
    return mx.random.normal(shape, dtype=mx.bfloat16, key=key) * scale


def write(name: str, out: Path, layers: int | None, seed: int) -> Path:
    s = dict(SHAPES[name])
    if layers:
        s["layers"] = layers
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(TOKENIZER_CORPUS, 1000, out)
    added = {
        t["content"]: t["id"]
        for t in json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    }
    eos = [added["<|im_end|>"], added["<|endoftext|>"]]
    moe = "experts" in s
    config = {
        "architectures": [
            "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
        ],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": text_config(s, eos),
        "tie_word_embeddings": s["tied"],
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"do_sample": True, "temperature": 1.0, "top_k": 20, "top_p": 0.95,
                  "eos_token_id": eos}  # fmt: skip
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))

    shapes = all_shapes(s)
    trunk = [n for n in shapes if not n.startswith("mtp.")]
    head = [n for n in shapes if n.startswith("mtp.")]
    shards: list[list[str]] = [[]]
    size = 0
    for n in trunk:
        nbytes = 2 * math.prod(shapes[n])
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nbytes
    shards.append(head)
    key = mx.random.key(seed)
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for n in names:
            key, sub = mx.random.split(key)
            tensors[n] = random_tensor(n, shapes[n], sub)
        mx.eval(tensors)
        mx.save_safetensors(str(out / fname), tensors, metadata={"format": "pt"})
        total += sum(a.nbytes for a in tensors.values())
        weight_map |= {n: fname for n in names}
        del tensors
        print(f"wrote {fname} ({i + 1}/{len(shards)})", file=sys.stderr)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    params = sum(math.prod(v) for v in shapes.values())
    print(f"{out}: {params / 1e9:.2f} B parameters, {total / 1e9:.2f} GB bf16", file=sys.stderr)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--out", default=None, help="default: runs/shapes/qwen3.5-SHAPE")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (a multiple of 4)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.layers is not None and (args.layers < 4 or args.layers % 4):
        parser.error("--layers must be a positive multiple of 4 (the GDN/attention pattern)")
    out = Path(args.out or ROOT / "runs" / "shapes" / f"qwen3.5-{args.shape}")
    write(args.shape, out, args.layers, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
