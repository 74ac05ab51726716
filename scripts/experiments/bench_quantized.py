"""Quantized trunks x quantized heads: speed-up, greedy acceptance and memory in one table.

    .venv/bin/python scripts/experiments/bench_quantized.py --model models/qwen3.5-demo --out docs/QUANTIZED.md

For every trunk in (bf16, 8-bit, 4-bit) and head in (16, 8, 4 bits) the model is converted with
``mtpserve convert`` (engine.model.convert) into a scratch folder, loaded in a fresh process (so
peak memory is that configuration's alone) and run greedily, EOS ignored, over the first ``--limit``
bench prompts at K=0 and every K in ``--draft-tokens``, configurations interleaved prompt by
prompt. The bf16 trunk with the 16-bit head is the original model (a bf16 copy of it); the
acceptance ratio of every row is against that row's acceptance at the same K (K=1: a_1).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.blas import blas_in_use, use_fast_blas  # noqa: E402

use_fast_blas()  # before mlx is imported

TRUNKS = (16, 8, 4)
HEADS = (16, 8, 4)


def worker(args: argparse.Namespace) -> None:
    """Load one converted folder and run K=0 and each K; print one JSON object."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from engine.bench.prompts import load_prompts
    from engine.bench.speed import Row, run_ours
    from engine.runtime import Engine
    from sampling.params import SamplingOverrides, resolve

    mx.reset_peak_memory()
    t = time.perf_counter()
    draft_vocab = None if args.draft_vocab == "default" else int(args.draft_vocab)
    engine = Engine.load(args.worker, draft_tokens=0, draft_vocab=draft_vocab)
    load_s = time.perf_counter() - t
    assert engine.has_head, engine.loaded.head_missing_reason
    params = dict(tree_flatten(engine.trunk.parameters()))
    head_bytes = sum(a.nbytes for n, a in params.items() if n.startswith("mtp."))
    trunk_bytes = sum(a.nbytes for n, a in params.items() if not n.startswith("mtp."))
    greedy = resolve(engine.sampling_defaults, SamplingOverrides(temperature=0.0))
    prompts = load_prompts(Path(args.prompts), engine.tokenizer, args.limit)
    ks = [0] + [int(k) for k in args.draft_tokens.split(",")]
    rows = {k: Row("greedy", f"K={k}") for k in ks}
    for k in ks:  # warm-up: compile every K's blocks once
        run_ours(engine, prompts[0]["ids"], greedy, k, 8, Row("warm", "warm"))
    for prompt in prompts:
        for k in ks:
            run_ours(engine, prompt["ids"], greedy, k, args.max_tokens, rows[k])
    out = {
        "draft_vocab_size": engine.draft_vocab_size,
        "vocab_size": engine.vocab_size,
        "load_seconds": load_s,
        "trunk_bytes": trunk_bytes,
        "head_bytes": head_bytes,
        "peak_memory_bytes": int(mx.get_peak_memory()),
        "rows": {},
    }
    for k, row in rows.items():
        t = row.totals
        out["rows"][k] = {
            "tps": t.generation_tps,
            "acceptance": t.acceptance_rate if t.proposed else None,
            "a1": (t.accepted_per_position[0] / t.proposed_per_position[0])
            if k and t.proposed_per_position[0]
            else None,
            "tokens_per_cycle": t.tokens_per_cycle or None,
            "tokens": t.completion_tokens,
        }
    print("RESULT " + json.dumps(out))


def run_worker(folder: Path, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        str(folder),
        "--prompts",
        args.prompts,
        "--limit",
        str(args.limit),
        "--max-tokens",
        str(args.max_tokens),
        "--draft-tokens",
        args.draft_tokens,
        "--draft-vocab",
        args.draft_vocab,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise SystemExit(f"worker for {folder} failed:\n{proc.stdout}\n{proc.stderr}")


def disk_bytes(folder: Path) -> tuple[int, int]:
    trunk = sum(f.stat().st_size for f in folder.glob("model*.safetensors"))
    head = (folder / "mtp.safetensors").stat().st_size
    return trunk, head


def name(bits: int) -> str:
    return "bf16" if bits == 16 else f"{bits}-bit"


def format_table(results: dict, ks: list[int]) -> str:
    ref = results[(16, 16)]["rows"]
    lines = [
        "| trunk | head | trunk / head on disk (MiB) | resident weights (MiB) | peak memory (MiB) "
        "| K=0 tok/s | best K | tok/s at best K | speed-up | acceptance a1 (K=1) "
        "| a1 vs bf16 | acceptance at best K | vs bf16 at that K | tokens/cycle at best K |",
        "|" + "---|" * 14,
    ]
    for trunk in TRUNKS:
        for head in HEADS:
            r = results[(trunk, head)]
            rows = r["rows"]
            best = max(ks, key=lambda k: rows[str(k)]["tps"])
            b = rows[str(best)]
            a1 = rows["1"]["a1"]
            lines.append(
                f"| {name(trunk)} | {name(head)} "
                f"| {r['disk_trunk'] / 2**20:.2f} / {r['disk_head'] / 2**20:.2f} "
                f"| {(r['trunk_bytes'] + r['head_bytes']) / 2**20:.1f} "
                f"| {r['peak_memory_bytes'] / 2**20:.1f} "
                f"| {rows['0']['tps']:.1f} | {best} | {b['tps']:.1f} "
                f"| {b['tps'] / rows['0']['tps']:.2f}x "
                f"| {a1:.3f} | {a1 / ref['1']['a1']:.1%} "
                f"| {b['acceptance']:.3f} | {b['acceptance'] / ref[str(best)]['acceptance']:.1%} "
                f"| {b['tokens_per_cycle']:.2f} |"
            )
    return "\n".join(lines)


def summary(results: dict) -> str:
    ref = results[(16, 16)]["rows"]["1"]["a1"]
    target = results[(4, 8)]["rows"]["1"]["a1"]
    lines = [
        f"4-bit trunk with 8-bit head: greedy acceptance a1 {target:.3f} = {target / ref:.1%} of "
        f"the bf16 model's {ref:.3f}; peak memory "
        f"{results[(4, 8)]['peak_memory_bytes'] / results[(16, 16)]['peak_memory_bytes']:.0%} "
        "of the bf16 model's here."
    ]
    for trunk in TRUNKS:
        k0 = [results[(trunk, h)]["rows"]["0"]["tps"] for h in HEADS]
        lines.append(
            f"K=0 of the {name(trunk)} trunk (identical in its three rows) measured "
            f"{min(k0):.0f}-{max(k0):.0f} tok/s, {(max(k0) - min(k0)) / min(k0):.1%} apart: "
            "the same weights, so that much of a difference between rows is this shared "
            "machine's noise."
        )
    return "\n".join(f"- {line}" for line in lines)


def per_k_table(results: dict, ks: list[int]) -> str:
    head = "| trunk | head | K=0 tok/s | " + " | ".join(f"K={k} tok/s (acc.)" for k in ks) + " |"
    lines = [head, "|" + "---|" * (3 + len(ks))]
    for trunk in TRUNKS:
        for h in HEADS:
            rows = results[(trunk, h)]["rows"]
            cells = " | ".join(
                f"{rows[str(k)]['tps']:.1f} ({rows[str(k)]['acceptance']:.3f})" for k in ks
            )
            lines.append(f"| {name(trunk)} | {name(h)} | {rows['0']['tps']:.1f} | {cells} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models" / "qwen3.5-demo"))
    p.add_argument("--out", default=str(ROOT / "docs" / "QUANTIZED.md"))
    p.add_argument("--prompts", default=str(ROOT / "configs" / "bench_prompts.jsonl"))
    p.add_argument("--limit", type=int, default=24, help="first N bench prompts")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--draft-tokens", default="1,2,3")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument(
        "--draft-vocab",
        default="default",
        help="tokens the head drafts over: 'default' (the checkpoint's draft_vocab.json) or N "
        "(0: the full vocabulary)",
    )
    p.add_argument("--work", default=None, help="scratch folder for the converted models")
    p.add_argument("--json", default=None, help="also write the raw results here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0

    from engine.model.convert import convert

    ks = [int(k) for k in args.draft_tokens.split(",")]
    work = Path(args.work or tempfile.mkdtemp(prefix="mtpserve-quant-"))
    results: dict = {}
    t0 = time.perf_counter()
    for trunk in TRUNKS:
        for head in HEADS:
            folder = work / f"trunk{trunk}-head{head}"
            if folder.exists():
                shutil.rmtree(folder)
            convert(args.model, folder, bits=trunk, group_size=args.group_size, head_bits=head)
            r = run_worker(folder, args)
            r["disk_trunk"], r["disk_head"] = disk_bytes(folder)
            results[(trunk, head)] = r
            rows = r["rows"]
            print(
                f"trunk {name(trunk)} head {name(head)}: K=0 {rows['0']['tps']:.1f} tok/s; "
                + ", ".join(
                    f"K={k} {rows[str(k)]['tps']:.1f} tok/s acc {rows[str(k)]['acceptance']:.3f}"
                    for k in ks
                ),
                flush=True,
            )
    wall = time.perf_counter() - t0
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)

    import mlx.core as mx

    from engine.model import products

    on_kernel = mx.default_device() == mx.cpu and products.on_native()
    if on_kernel:
        loading_note = (
            "On CPU the weights load as stored (bf16 stays bf16, packed quantized weights stay"
            " packed) and the engine carries float32 activations."
        )
    else:
        loading_note = (
            "On CPU the engine computes in float32 (`--dtype auto`): bf16 parts are widened when"
            " loaded, packed quantized weights stay packed (their scales and biases become float32)."
        )
    command = (
        f".venv/bin/python scripts/experiments/bench_quantized.py --model {args.model} --limit {args.limit} "
        f"--max-tokens {args.max_tokens} --draft-tokens {args.draft_tokens}"
        + (f" --draft-vocab {args.draft_vocab}" if args.draft_vocab != "default" else "")
    )
    drafted = results[(16, 16)]
    if drafted["draft_vocab_size"] < drafted["vocab_size"]:
        vocab_note = (
            f"the head drafts over the checkpoint's draft vocabulary ({drafted['draft_vocab_size']}"
            f" of {drafted['vocab_size']} tokens, `draft_vocab.json`; `--draft-vocab 0` for all)"
        )
    else:
        vocab_note = f"the head drafts over the full vocabulary ({drafted['vocab_size']} tokens)"
    command = command.replace(str(ROOT) + "/", "")
    doc = f"""# Quantized trunks and heads

One command (about {wall / 60:.0f} minutes here):

    {command}

Model `{Path(args.model).name}`; greedy, EOS ignored, {args.max_tokens} tokens for each of the
first {args.limit} prompts of `configs/bench_prompts.jsonl`; every row converted with
`mtpserve convert --bits T --head-bits H --group-size {args.group_size}` (fc, norms and
everything not quantized stored in bfloat16) and measured in its own process. Machine:
{platform.machine()}, {os.cpu_count()} cores, mlx {mx.__version__} on
{mx.default_device()}, BLAS `{blas_in_use() or "bundled reference BLAS"}`; {products.description()}.
{loading_note}

- In every row {vocab_note}.
- *acceptance a1*: greedy acceptance of the first draft at K=1; *vs bf16*: that divided by the
  bf16-trunk/16-bit-head row's (the original model's) at the same K.
- *speed-up*: decode tok/s at the best K over K=0 of the same row.
- *resident weights*: bytes of the loaded parameters; *peak memory*: mlx's peak over load and
  all generation in that process.

{format_table(results, ks)}

{summary(results)}

Per K (decode tok/s, overall acceptance):

{per_k_table(results, ks)}
"""
    if on_kernel:
        doc += """
**Speed on this machine.** Every product runs on mtpserve's native kernel: 4- and 8-bit weights
multiply their codes as integers by activations quantized to 8 bits (a scale per 32), bf16
weights are widened in registers. On this small model a step is mostly mlx dispatching small
ops rather than reading weights, so the trunks decode at about the same speed whatever their
bits; at full size the bytes read per token set it (docs/BENCHMARKS.md, "The native product
kernel"). Acceptance and memory are what these rows show.
"""
    elif mx.default_device() == mx.cpu:
        doc += """
**Speed on this machine.** mlx's CPU quantized matmul is several times slower than a float32
BLAS matmul here and its cost grows linearly with the number of rows, so the quantized
trunks decode *slower* than the float32-widened bf16 trunk, and a verify over K+1 rows costs
proportionally more: the speed-up columns describe this CPU, not Apple GPUs where 4/8-bit
weights cut the bytes each step reads. Acceptance and memory are what these rows show.
"""
    doc += """
**Making such folders.** `mtpserve convert --model SRC --out DIR --bits 4 --head-bits 8` writes
a normal mlx-lm folder plus `mtp.safetensors` (named in DIR's `config.json`);
`mtpserve extract-head --model ORIGINAL --into DIR --head-bits 8` adds the head to a folder
converted without one (e.g. an mlx-community model; a repo id downloads only the shards that
hold `mtp.*`); `--mtp-weights FILE` points any load at a sidecar explicitly.
"""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(doc)
    if args.json:
        Path(args.json).write_text(
            json.dumps({f"{t}-{h}": r for (t, h), r in results.items()}, indent=2)
        )
    print(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
