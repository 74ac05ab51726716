"""``mtpserve bench-batch``: many requests at once — continuous batching against one at a time.

For each concurrency c (default 1, 2, 4, 8) the same c requests (the first c bench prompts,
EOS ignored, ``--max-tokens`` each; greedy, or ``--sampler`` as ``mtpserve bench`` takes it:
``preset:NAME`` seeded per prompt, ``unseeded:NAME``) run, in one sitting and in a rotating
order:

* one at a time through ``Engine.generate`` at the best fixed K of the single-request rows
  (what a server without batching gives: the c-th request waits for the c-1 before it);
* together as rows of one ``BatchDecoder`` at K = 0, each fixed K, and automatic K.

Reported per configuration: aggregate tokens/s (all tokens over the wall time of the whole
group), per-stream tokens/s (a row's tokens over its own time from joining to finishing),
time to first token p50/p95 (from the group's start), and the ratios the issue asks for:
batched over one at a time, and automatic K over the better of batched K=0 and the best
batched fixed K. The greedy outputs of every batched row are checked equal to the same
request alone (a sampled row's text depends on its K: the seeded guarantee has its own tests).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from engine.api import DEMO_MODEL, GenerationRequest
from engine.bench.speed import parse_samplers, request_params
from engine.runtime import Engine


def _requests(
    engine: Engine,
    prompts: list[dict[str, Any]],
    c: int,
    k: int | None,
    n: int,
    sampler: str = "greedy",
) -> list[GenerationRequest]:
    params = parse_samplers(sampler, engine)[sampler]
    return [
        GenerationRequest(
            prompt_ids=p["ids"],
            sampling=request_params(sampler, params, 1000 + i),
            max_tokens=n,
            ignore_eos=True,
            draft_tokens=k,
        )
        for i, p in enumerate(prompts[:c])
    ]


def run_serial(engine: Engine, reqs: list[GenerationRequest]) -> dict[str, Any]:
    t0 = time.perf_counter()
    first: list[float] = []
    streams: list[float] = []
    outputs: list[list[int]] = []
    for request in reqs:
        start, tokens, seen = time.perf_counter(), [], False
        for event in engine.generate(request):
            if not seen and event.token_ids:
                first.append(time.perf_counter() - t0)
                seen = True
            tokens += event.token_ids
        streams.append(len(tokens) / (time.perf_counter() - start))
        outputs.append(tokens)
    return _summary(time.perf_counter() - t0, outputs, first, streams)


def run_batched(engine: Engine, reqs: list[GenerationRequest]) -> dict[str, Any]:
    batch = engine.batch(len(reqs))
    t0 = time.perf_counter()
    for i, request in enumerate(reqs):
        batch.add(i, request)
    outputs: list[list[int]] = [[] for _ in reqs]
    first: list[float | None] = [None] * len(reqs)
    done: list[float] = [0.0] * len(reqs)
    while len(batch):
        for key, item in batch.step():
            if isinstance(item, BaseException):
                raise item
            if first[key] is None and item.token_ids:
                first[key] = time.perf_counter() - t0
            outputs[key] += item.token_ids
            if item.finish_reason is not None:
                done[key] = time.perf_counter() - t0
    streams = [len(out) / t for out, t in zip(outputs, done, strict=True)]
    return _summary(time.perf_counter() - t0, outputs, [f or 0.0 for f in first], streams)


def _summary(
    wall: float, outputs: list[list[int]], first: list[float], streams: list[float]
) -> dict[str, Any]:
    tokens = sum(len(o) for o in outputs)
    ordered = sorted(first)
    return {
        "wall_s": wall,
        "tokens": tokens,
        "aggregate_tps": tokens / wall,
        "stream_tps": statistics.mean(streams),
        "ttft_p50_ms": 1000 * ordered[len(ordered) // 2],
        "ttft_p95_ms": 1000 * ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))],
        "outputs": outputs,
    }


def cmd_bench_batch(args: argparse.Namespace) -> int:
    from engine.bench.prompts import DEFAULT_PROMPTS, load_prompts

    engine = Engine.load(args.model)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    fixed = [int(k) for k in args.draft_tokens.split(",")]
    # the newcomer measurement takes the second prompt
    prompts = load_prompts(
        Path(args.prompts or DEFAULT_PROMPTS), engine.tokenizer, max(2, *concurrency)
    )
    configs: list[tuple[str, int | None]] = [("serial", k) for k in fixed if k > 0]
    configs += [("serial", None)]
    configs += [("batched", k) for k in [0, *fixed]] + [("batched", None)]
    # warm-up: every batched configuration once at full length, so that the measured groups
    # neither compile blocks for the batch sizes the rows pass through as they leave, nor learn
    # automatic K's first prices (serial requests run one shape per K: 8 tokens compile it)
    for c in concurrency:
        for mode, k in configs:
            n = args.max_tokens if mode == "batched" else 8
            run_batched(engine, _requests(engine, prompts, c, k, n, args.sampler))
    results: dict[str, Any] = {"concurrency": {}, "max_tokens": args.max_tokens}
    alone = {
        i: [t for e in engine.generate(r) for t in e.token_ids]
        for i, r in enumerate(_requests(engine, prompts, max(concurrency), 0, args.max_tokens))
    }
    for c in concurrency:
        rows: dict[str, Any] = {}
        for repeat in range(args.repeats):
            for j in range(len(configs)):
                mode, k = configs[(j + repeat + c) % len(configs)]
                reqs = _requests(engine, prompts, c, k, args.max_tokens, args.sampler)
                run = run_serial if mode == "serial" else run_batched
                got = run(engine, reqs)
                outputs = got.pop("outputs")
                greedy = args.sampler == "greedy"
                if greedy and any(out != alone[i] for i, out in enumerate(outputs)):
                    raise SystemExit(f"{mode} K={k} at {c} rows differs from the request alone")
                name = f"{mode} K={'auto' if k is None else k}"
                rows.setdefault(name, []).append(got)
        merged = {
            name: {key: statistics.mean(r[key] for r in runs) for key in runs[0]}
            for name, runs in rows.items()
        }
        batched_fixed = {
            n: r for n, r in merged.items() if n.startswith("batched K=") and "auto" not in n
        }
        best_batched = max(batched_fixed.values(), key=lambda r: r["aggregate_tps"])
        best_serial = max(
            (r for n, r in merged.items() if n.startswith("serial")),
            key=lambda r: r["aggregate_tps"],
        )
        auto = merged["batched K=auto"]
        merged["ratios"] = {
            "batched_best_over_serial_best": best_batched["aggregate_tps"]
            / best_serial["aggregate_tps"],
            "auto_over_best_batched": auto["aggregate_tps"] / best_batched["aggregate_tps"],
            "auto_over_serial_best": auto["aggregate_tps"] / best_serial["aggregate_tps"],
        }
        results["concurrency"][c] = merged
        print(f"{c} rows: " + json.dumps(merged["ratios"]), flush=True)
    if args.newcomer_tokens > 0:
        results["newcomer"] = newcomer(engine, prompts, args.newcomer_tokens)
        print("newcomer: " + json.dumps(results["newcomer"]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_batch.json").write_text(json.dumps(results, indent=2))
    _plot(results, out / "bench_batch.png")
    table = _table(results)
    (out / "bench_batch.md").write_text(table)
    print(table)
    return 0


def newcomer(engine: Engine, prompts: list[dict[str, Any]], long_tokens: int) -> dict[str, Any]:
    """A short request arriving while a long generation runs: its time to first token, against
    its own prefill alone and the running row's cycle time (issue: at most its prefill plus two
    cycles)."""
    long_request = _requests(engine, prompts, 1, None, long_tokens)[0]
    short = _requests(engine, prompts[1:], 1, None, 8)[0]
    t0 = time.perf_counter()
    for event in engine.generate(short):
        if event.token_ids:
            break
    alone_ttft = time.perf_counter() - t0
    batch = engine.batch(2)
    batch.add("long", long_request)
    cycles: list[float] = []
    for _ in range(8):  # the long row decoding
        t = time.perf_counter()
        batch.step()
        cycles.append(time.perf_counter() - t)
    batch.add("short", short)
    t0, steps, first = time.perf_counter(), 0, None
    while first is None:
        steps += 1
        for key, item in batch.step():
            if key == "short" and item.token_ids:
                first = time.perf_counter() - t0
    while "short" in batch:
        batch.step()
    batch.drop("long")
    cycle = statistics.median(cycles)
    return {
        "ttft_ms": 1e3 * first,
        "steps_to_first_token": steps,
        "alone_ttft_ms": 1e3 * alone_ttft,
        "running_cycle_ms": 1e3 * cycle,
        "over_alone_in_cycles": (first - alone_ttft) / cycle,
    }


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(results["concurrency"])
    names = [n for n in results["concurrency"][rows[0]] if n != "ratios"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in sorted(names):
        ys = [results["concurrency"][c][name]["aggregate_tps"] for c in rows]
        ax.plot(rows, ys, marker="o", linestyle="-" if "batched" in name else "--", label=name)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_xticks(rows)
    ax.set_title("Continuous batching vs one request at a time (greedy)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _table(results: dict[str, Any]) -> str:
    lines = [
        "| rows | configuration | aggregate tok/s | per-stream tok/s | TTFT p50 ms | TTFT p95 ms |",
        "|---|---|---|---|---|---|",
    ]
    for c, merged in results["concurrency"].items():
        for name, r in merged.items():
            if name == "ratios":
                continue
            lines.append(
                f"| {c} | {name} | {r['aggregate_tps']:.1f} | {r['stream_tps']:.1f} | "
                f"{r['ttft_p50_ms']:.0f} | {r['ttft_p95_ms']:.0f} |"
            )
    lines += [
        "",
        "| rows | batched best / one at a time best | auto / best batched |",
        "|---|---|---|",
    ]
    for c, merged in results["concurrency"].items():
        ratio = merged["ratios"]
        lines.append(
            f"| {c} | {ratio['batched_best_over_serial_best']:.2f}x | "
            f"{ratio['auto_over_best_batched']:.3f}x |"
        )
    new = results.get("newcomer")
    if new:
        lines += [
            "",
            f"A newcomer beside a running generation: first token after {new['ttft_ms']:.0f} ms "
            f"({new['steps_to_first_token']} batch steps); alone {new['alone_ttft_ms']:.0f} ms; "
            f"the running row's cycle {new['running_cycle_ms']:.1f} ms, so "
            f"{new['over_alone_in_cycles']:.2f} cycles more than alone.",
        ]
    return "\n".join(lines) + "\n"


def register(sub: Any) -> None:

    p = sub.add_parser("bench-batch", help="continuous batching against one request at a time")
    p.add_argument("--model", default=str(DEMO_MODEL))
    p.add_argument("--concurrency", default="1,2,4,8")
    p.add_argument("--draft-tokens", default="2,3,4", help="fixed K to run beside 0 and auto")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--newcomer-tokens",
        type=int,
        default=1000,
        help="the long generation a newcomer joins (0: not measured)",
    )
    p.add_argument("--prompts", default=None)
    p.add_argument(
        "--sampler", default="greedy", help="greedy, preset:NAME (seeded) or unseeded:NAME"
    )
    p.add_argument("--out", default="bench-results")
    p.set_defaults(func=cmd_bench_batch)
