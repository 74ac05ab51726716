"""The native product kernel alone, at a real model's shapes, against this machine's memory
bandwidth and against mlx's own products (``make bench-kernel``).

    python scripts/bench_kernel.py                      # Qwen3.5-0.8B shapes, every dtype
    python scripts/bench_kernel.py --dtypes f32 --rows 1,5 --crossover

One "token" is every projection of a decoding step at the shape: the trunk's 24 layers (three
Gated-DeltaNet layers then one attention layer, each with its MLP) and the 248,320-row
vocabulary projection, each a weight of its own (random values: speed does not depend on them),
all evaluated together as one step evaluates them, each laid out as the engine lays it out for
the kernel (``laid_out``: 4- and 8-bit weights 16 outputs to a vector on AVX-512). For each
dtype and row count T it reports ms per token, the bytes of weights read per second (T=1)
against ``read`` — every byte of the same weight arrays read once on the kernel's threads (the
same memory: a fresh array's pages read slower than ones the kernel has been reading for a
while) — and the T-row time as a multiple of one row's; the read and every row count take turns,
repeat by repeat, best of each (this machine's bandwidth wanders by a third over minutes: timed
one after the other, a ratio measured the drift). mlx's own product of the same weights is timed
at T=1 and T=5 (BLIS for fp32, mlx's CPU kernels for bf16 and quantized weights).
``--crossover`` times fp32 products of many rows (prefill) on the kernel and on BLIS with every
core, to place ``engine.model.products.NATIVE_MAX_ROWS``. ``--bound`` adds the floors: the
weights' bytes at the read bandwidth, and each row count's arithmetic alone (a weight that stays
in cache), so that a ratio the kernel misses shows what bounds it.

Results: bench-results/bench_kernel.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.blas import all_cores, use_fast_blas  # noqa: E402

use_fast_blas()

import mlx.core as mx  # noqa: E402

from engine.bench.machine import cpu_name  # noqa: E402
from engine.model import products  # noqa: E402

#: [out, in] of each projection of one layer at the Qwen3.5-0.8B shape (hidden 1024, MLP
#: 3584; GDN 16 key/value heads of 128; attention 8 query heads of 256 with gates, 2 KV heads)
GDN = [(6144, 1024), (2048, 1024), (16, 1024), (16, 1024), (1024, 2048)]
ATTENTION = [(4096, 1024), (512, 1024), (512, 1024), (1024, 2048)]
MLP = [(3584, 1024), (3584, 1024), (1024, 3584)]
VOCAB = (248320, 1024)
LAYERS = 24
QUANTIZED = {"q8": 8, "q4": 4}
GROUP = 64


def shapes() -> list[tuple[int, int]]:
    per_layer = [GDN if (i + 1) % 4 else ATTENTION for i in range(LAYERS)]
    return [s for layer in per_layer for s in (*layer, *MLP)] + [VOCAB]


def make_weights(dtype: str) -> list[tuple[mx.array, ...]]:
    """One weight per projection: (w,) for a float type, (packed, scales, biases) quantized."""
    weights = []
    for i, (out, inner) in enumerate(shapes()):
        w = mx.random.uniform(-0.05, 0.05, (out, inner), key=mx.random.key(i))
        if dtype in QUANTIZED:
            parts = mx.quantize(w.astype(mx.bfloat16), group_size=GROUP, bits=QUANTIZED[dtype])
        else:
            parts = (w.astype({"f32": mx.float32, "bf16": mx.bfloat16}[dtype]),)
        mx.eval(*parts)
        weights.append(tuple(parts))
    return weights


def laid_out(parts: tuple[mx.array, ...], dtype: str) -> tuple[tuple[mx.array, ...], bool]:
    """A weight as the engine hands it to the kernel: 4- and 8-bit layers laid out 16 outputs to
    a vector where the kernel's instruction set takes them so (``products.interleave_layers``)."""
    if dtype not in QUANTIZED or not products.interleaves(QUANTIZED[dtype], GROUP, len(parts[0])):
        return parts, False
    laid = products.interleave(*parts)
    mx.eval(*laid)
    return laid, True


def nbytes(weights: list[tuple[mx.array, ...]]) -> int:
    return sum(a.nbytes for parts in weights for a in parts)


def native_token(
    weights: list[tuple[tuple[mx.array, ...], bool]], x: dict[int, mx.array], dtype: str
) -> list:
    """The token's products on the kernel, each weight ``laid_out``."""
    native = products.native()
    if dtype in QUANTIZED:
        bits = QUANTIZED[dtype]
        return [
            native.product(
                x[w.shape[1] * 32 // bits],
                w,
                s,
                b,
                bits=bits,
                group_size=GROUP,
                interleaved=interleaved,
            )
            for (w, s, b), interleaved in weights
        ]
    return [native.product(x[parts[0].shape[1]], parts[0]) for parts, _ in weights]


def mlx_token(weights: list[tuple[mx.array, ...]], x: dict[int, mx.array], dtype: str) -> list:
    if dtype in QUANTIZED:
        bits = QUANTIZED[dtype]
        return [
            mx.quantized_matmul(x[w.shape[1] * 32 // bits], w, s, b, group_size=GROUP, bits=bits)
            for w, s, b in weights
        ]
    return [x[parts[0].shape[1]] @ parts[0].T for parts in weights]


def seconds(run, repeats: int) -> float:
    mx.eval(run())  # warm: first-call allocations
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(run())
        best = min(best, time.perf_counter() - start)
    return best


def inputs(rows: int, dtype: str) -> dict[int, mx.array]:
    act = mx.bfloat16 if dtype != "f32" else mx.float32
    x = {
        n: mx.random.normal((rows, n), key=mx.random.key(n)).astype(act) for n in (1024, 2048, 3584)
    }
    mx.eval(*x.values())
    return x


def read_gbps(weights: list[tuple[mx.array, ...]], repeats: int) -> float:
    """Bytes per second reading every weight array once, array by array (best of repeats)."""
    native = products.native()
    arrays = [a for parts in weights for a in parts]
    best = min(sum(native.read_seconds(a) for a in arrays) for _ in range(repeats))
    return nbytes(weights) / best / 1e9


def crossover(repeats: int) -> list[dict]:
    """fp32 products of many rows: the kernel against BLIS on every core (prefill's way)."""
    rows_out = []
    for out, inner in ((3584, 1024), (1024, 3584)):
        w = mx.random.normal((out, inner))
        wt = w.T
        mx.eval(w, wt)
        for rows in (16, 32, 64, 96, 128, 256):
            x = mx.random.normal((rows, inner))
            mx.eval(x)
            native = seconds(
                lambda x=x, w=w: [products.native().product(x, w) for _ in range(8)], repeats
            )
            with all_cores():
                blas = seconds(lambda x=x, wt=wt: [x @ wt for _ in range(8)], repeats)
            rows_out.append(
                {
                    "shape": [out, inner],
                    "rows": rows,
                    "native_ms": native / 8 * 1e3,
                    "blas_ms": blas / 8 * 1e3,
                }
            )
            print(
                f"crossover {out}x{inner} T={rows}: kernel {native / 8 * 1e3:.3f} ms, "
                f"BLIS all cores {blas / 8 * 1e3:.3f} ms",
                flush=True,
            )
    return rows_out


#: The in-cache weight of ``compute_bound``: [out, in] small enough to stay in L2/L3.
BOUND_SHAPE = (2048, 1024)


def compute_bound(dtype: str, rows: list[int], repeats: int) -> dict[int, float]:
    """ms per token if reading the weights cost nothing: one weight that stays in cache,
    multiplied 16 times per evaluation, its time per weight element scaled to the token's
    elements. What the kernel's arithmetic alone allows at each row count (the lower bound of
    the measured ms, and of their ratio to T=1 when T=1 is bound by memory)."""
    native = products.native()
    out, inner = BOUND_SHAPE
    w = mx.random.uniform(-0.05, 0.05, (out, inner), key=mx.random.key(7))
    if dtype in QUANTIZED:
        parts = mx.quantize(w.astype(mx.bfloat16), group_size=GROUP, bits=QUANTIZED[dtype])
    else:
        parts = (w.astype({"f32": mx.float32, "bf16": mx.bfloat16}[dtype]),)
    mx.eval(*parts)
    parts, interleaved = laid_out(tuple(parts), dtype)
    token_elements = sum(o * i for o, i in shapes())
    bound = {}
    for t in rows:
        x = inputs(t, dtype)[inner]
        if dtype in QUANTIZED:
            bits = QUANTIZED[dtype]

            def run(x=x, bits=bits) -> list:
                return [
                    native.product(x, *parts, bits=bits, group_size=GROUP, interleaved=interleaved)
                    for _ in range(16)
                ]
        else:

            def run(x=x) -> list:
                return [native.product(x, parts[0]) for _ in range(16)]

        per_element = seconds(run, repeats) / 16 / (out * inner)
        bound[t] = per_element * token_elements * 1e3
    return bound


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtypes", default="f32,bf16,q8,q4")
    p.add_argument("--rows", default="1,2,3,5,9,24")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--mlx-rows", default="1,5", help="row counts at which mlx's products run too")
    p.add_argument("--crossover", action="store_true")
    p.add_argument(
        "--bound", action="store_true", help="also the in-cache (compute-bound) ms per token"
    )
    p.add_argument("--out", type=Path, default=ROOT / "bench-results")
    args = p.parse_args()
    native = products.native()
    if native is None or not products.on_native():
        print(products.description(), file=sys.stderr)
        return 1
    rows = [int(r) for r in args.rows.split(",")]
    mlx_rows = [int(r) for r in args.mlx_rows.split(",") if r]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    result: dict = {
        "commit": commit,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {cpu_name()}",
        "kernel": products.description(),
        "dtypes": {},
    }
    print(result["kernel"], flush=True)
    for dtype in args.dtypes.split(","):
        weights = make_weights(dtype)
        size = nbytes(weights)
        entry: dict = {"bytes": size, "native_ms": {}, "mlx_ms": {}}
        # every row count and the read measurement take turns, repeat by repeat (best of
        # each), so that the machine's drift (its bandwidth wanders by a third over minutes)
        # hits them alike and their ratios mean something
        xs = {t: inputs(t, dtype) for t in rows}
        kernel_weights = [laid_out(parts, dtype) for parts in weights]
        runs = {t: (lambda x=xs[t], w=kernel_weights, d=dtype: native_token(w, x, d)) for t in rows}
        for run in runs.values():
            mx.eval(run())  # warm: first-call allocations
        best = dict.fromkeys(rows, float("inf"))
        read = 0.0
        for _ in range(args.repeats):
            read = max(read, read_gbps(weights, 1))
            for t, run in runs.items():
                start = time.perf_counter()
                mx.eval(run())
                best[t] = min(best[t], time.perf_counter() - start)
        for t in rows:
            entry["native_ms"][t] = best[t] * 1e3
            if t in mlx_rows:
                n = args.repeats if dtype == "f32" else 1
                entry["mlx_ms"][t] = (
                    seconds(lambda x=xs[t], w=weights, d=dtype: mlx_token(w, x, d), n) * 1e3
                )
            print(
                f"{dtype} T={t}: kernel {entry['native_ms'][t]:.2f} ms"
                + (f", mlx {entry['mlx_ms'][t]:.2f} ms" if t in entry["mlx_ms"] else ""),
                flush=True,
            )
        one = entry["native_ms"][rows[0]]
        entry["read_gbps"] = read
        entry["gbps_t1"] = size / (one / 1e3) / 1e9
        entry["of_read"] = entry["gbps_t1"] / entry["read_gbps"]
        print(f"{dtype}: read {entry['read_gbps']:.1f} GB/s", flush=True)
        entry["ratio"] = {t: ms / one for t, ms in entry["native_ms"].items()}
        if args.bound:
            entry["bound_ms"] = compute_bound(dtype, rows, args.repeats)
            print(f"{dtype}: compute bound {entry['bound_ms']}", flush=True)
        entry["interleaved"] = any(interleaved for _, interleaved in kernel_weights)
        result["dtypes"][dtype] = entry
        del weights, kernel_weights
    if args.crossover:
        result["crossover"] = crossover(args.repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_kernel.json").write_text(json.dumps(result, indent=1))
    (args.out / "bench_kernel.md").write_text(table(result, rows))
    print(table(result, rows))
    return 0


def table(result: dict, rows: list[int]) -> str:
    head = "| dtype | MB / token | " + " | ".join(f"T={t} ms" for t in rows)
    head += " | GB/s T=1 | read GB/s | of read | " + " | ".join(f"T={t}/T=1" for t in rows[1:])
    head += " | mlx T=1 ms | mlx T=5 ms |"
    lines = [
        f"Kernel alone at Qwen3.5-0.8B shapes — commit {result['commit']}, {result['machine']}; "
        f"{result['kernel']}",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for dtype, e in result["dtypes"].items():
        cells = [dtype, f"{e['bytes'] / 1e6:.0f}"]
        cells += [f"{e['native_ms'][t]:.2f}" for t in rows]
        cells += [f"{e['gbps_t1']:.1f}", f"{e['read_gbps']:.1f}", f"{e['of_read']:.2f}"]
        cells += [f"{e['ratio'][t]:.2f}" for t in rows[1:]]
        cells += [f"{e['mlx_ms'].get(t, float('nan')):.1f}" for t in (1, 5)]
        lines.append("| " + " | ".join(cells) + " |")
    bounded = {d: e for d, e in result["dtypes"].items() if "bound_ms" in e}
    if bounded:
        head = "| dtype | read ms (bytes / read GB/s) | " + " | ".join(
            f"T={t} compute ms" for t in rows
        )
        head += " | " + " | ".join(f"best T={t}/T=1" for t in rows[1:]) + " |"
        lines += [
            "",
            "Bounds: reading the weights once (T=1's floor) and the kernel's arithmetic with the "
            "weights in cache (each T's floor); best T/T=1 = max(read, compute T) / max(read, "
            "compute T=1)",
            "",
            head,
            "|" + "---|" * (head.count("|") - 1),
        ]
        for dtype, e in bounded.items():
            read_ms = e["bytes"] / e["read_gbps"] / 1e6
            floor = {t: max(read_ms, e["bound_ms"][t]) for t in rows}
            cells = [dtype, f"{read_ms:.1f}"] + [f"{e['bound_ms'][t]:.1f}" for t in rows]
            cells += [f"{floor[t] / floor[rows[0]]:.2f}" for t in rows[1:]]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    from engine.allocator import reexec_under_jemalloc

    reexec_under_jemalloc()  # the weights in the memory the server gives them (huge pages)
    raise SystemExit(main())
