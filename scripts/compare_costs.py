"""Both tools' measured costs on one checkpoint and the MTP speed each predicts at published
acceptance — the side by side for shapes whose random weights make measured acceptance
meaningless (``scripts/make_shapes.py``).

    python scripts/compare_llamacpp.py --model runs/shapes/qwen3.5-0.8B --steps fetch,build,convert
    python scripts/compare_costs.py runs/shapes/qwen3.5-0.8B

llama.cpp (the build and GGUFs ``compare_llamacpp.py`` leaves in ``--work``), per dtype and
thread count (1 and every core): ``llama-bench`` times a batch of T = 1..K+1 prompt tokens (the
verify of K drafts) and plain generation; ``llama-server`` with MTP forced to draft K every
cycle generates ``--tokens`` tokens, and a K-cycle's time is its generation time over its cycles
(drafts made / K). mtpserve (fp32, this process): ``estimate_costs`` in wall time — a K-cycle
as the decode loop runs it, the verify of T tokens, a head step. Then for the per-position
acceptance vLLM publishes for Qwen3.5's MTP heads, each tool's tokens/s at its best K:
E(K) / (K-cycle seconds), E(K) = 1 + a + ... + a^K (mtpserve's cost model adds the head's
catch-up over what a cycle commits). A head step is (K-cycle - verify(K+1)) / K for llama.cpp.
Writes ``--out``/compare_costs.{json,md}. Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

#: per-position acceptance vLLM publishes for Qwen3.5's MTP heads
ACCEPTANCE = (0.92, 0.84, 0.65, 0.54)
MAX_K = 4


def expected(a: float, k: int) -> float:
    return sum(a**i for i in range(k + 1))


def llama_bench(binary: Path, gguf: Path, threads: int, reps: int) -> dict[str, float]:
    """Seconds of a T-token batch (T = 1..MAX_K+1) and of one generated token."""
    sizes = ",".join(str(t) for t in range(1, MAX_K + 2))
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", sizes, "-n", "16"]
    cmd += ["-r", str(reps), "-o", "json"]
    print("+", " ".join(cmd), flush=True)
    runs = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    out: dict[str, float] = {}
    for r in runs:
        if r["n_gen"]:
            out["token"] = 1 / r["avg_ts"]
        else:
            out[f"batch{r['n_prompt']}"] = r["n_prompt"] / r["avg_ts"]
    return out


def llama_cycles(
    binary: Path, gguf: Path, threads: int, tokens: int, work: Path
) -> dict[int, float]:
    """Seconds per K-cycle for K = 0..MAX_K (K = 0: a plain step) through llama-server."""
    from compare_llamacpp import LlamaServer

    prompt = [(i * 7919) % 1000 + 10 for i in range(32)]
    greedy = {"temperature": 0.0, "top_k": 1}
    out: dict[int, float] = {}
    for k in range(MAX_K + 1):
        server = LlamaServer(
            binary, gguf, threads, k, work / f"costs-{gguf.stem}-t{threads}-k{k}.log"
        )
        try:
            server.complete(prompt, 4, greedy)  # warm-up
            best = float("inf")
            for _ in range(2):
                got = server.complete(prompt, tokens, greedy)
                seconds = len(got["tokens"]) / got["tps"]
                cycles = got["proposed"] / k if k else len(got["tokens"])
                best = min(best, seconds / cycles)
            out[k] = best
        finally:
            server.close()
    return out


def llama_row(name: str, bench: dict[str, float], cycles: dict[int, float]) -> dict[str, Any]:
    plain = cycles[0]
    verify = {t: bench[f"batch{t}"] / bench["batch1"] for t in range(1, MAX_K + 2)}
    head = {k: (cycles[k] - verify[k + 1] * plain) / k for k in range(1, MAX_K + 1)}
    return {
        "tool": name,
        "plain_tps": 1 / plain,
        "bench_tps": 1 / bench["token"],
        "verify_ratio": verify,
        "head_share": {k: h / plain for k, h in head.items()},
        "cycle_ratio": {k: c / plain for k, c in cycles.items()},
        "predicted": {
            a: max(((expected(a, k) / cycles[k], k) for k in cycles), key=lambda x: x[0])
            for a in ACCEPTANCE
        },
    }


def mtpserve_row(model: str, reps: int) -> dict[str, Any]:
    from engine import blas

    blas.use_fast_blas()
    from engine.runtime import Engine
    from engine.scheduling.costs import estimate_costs

    engine = Engine.load(model, draft_tokens=0, dtype="float32")
    costs = estimate_costs(engine, reps=reps, thorough=True, clock=time.perf_counter)
    plain = costs.cycle[0]
    predicted = {}
    for a in ACCEPTANCE:
        rates = costs.rates([a] * MAX_K)
        k = max(range(len(rates)), key=rates.__getitem__)
        predicted[a] = (rates[k], k)
    return {
        "tool": "mtpserve f32",
        "plain_tps": 1 / plain,
        "verify_ratio": {t + 1: v / costs.trunk[0] for t, v in enumerate(costs.trunk)},
        "head_share": {k: costs.head_step / plain for k in range(1, MAX_K + 1)},
        "cycle_ratio": {k: c / plain for k, c in enumerate(costs.cycle)},
        "predicted": predicted,
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| tool | plain tok/s | verify T=2 / 3 / 4 / 5 vs 1 | head step / plain | "
        + " | ".join(f"predicted tok/s at {a} (K)" for a in ACCEPTANCE)
        + " |",
        "|---" * (4 + len(ACCEPTANCE)) + "|",
    ]
    for r in rows:
        verify = " / ".join(f"{r['verify_ratio'][t]:.2f}" for t in range(2, MAX_K + 2))
        heads = sorted(r["head_share"].values())
        head = f"{100 * heads[len(heads) // 2]:.0f}%"
        cells = [f"{tps:.2f} ({k})" for tps, k in (r["predicted"][a] for a in ACCEPTANCE)]
        lines.append(
            f"| {r['tool']} | {r['plain_tps']:.2f} | {verify} | {head} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model")
    p.add_argument("--work", type=Path, default=ROOT / ".llamacpp")
    p.add_argument("--dtypes", default="f32,bf16")
    p.add_argument("--tokens", type=int, default=24, help="generated per llama-server run")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "bench-results")
    args = p.parse_args()
    model = Path(args.model)
    bin_dir = args.work / "build" / "bin"
    rows = [mtpserve_row(str(model), args.reps)]
    print(table(rows), flush=True)
    for dtype in args.dtypes.split(","):
        gguf = args.work / f"{model.name}-{dtype}.gguf"
        for threads in sorted({1, os.cpu_count() or 1}):
            bench = llama_bench(bin_dir / "llama-bench", gguf, threads, args.reps)
            cycles = llama_cycles(bin_dir / "llama-server", gguf, threads, args.tokens, args.work)
            rows.append(llama_row(f"llama.cpp {dtype}, {threads} thread(s)", bench, cycles))
            print(table(rows[-1:]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compare_costs.json").write_text(json.dumps(rows, indent=2, default=str))
    (args.out / "compare_costs.md").write_text(table(rows) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    from engine.allocator import reexec_under_jemalloc

    reexec_under_jemalloc()  # timed as the mtpserve command runs (MTPSERVE_MALLOC=system: glibc)
    raise SystemExit(main())
