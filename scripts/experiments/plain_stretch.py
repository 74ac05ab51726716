"""What a stretch of plain cycles does to the drafting around it (auto K; docs/BENCHMARKS.md,
"Speed-up and acceptance against mlx-lm").

Auto K decodes plainly where drafting does not pay and probes now and then. Three measurements
behind the engine's handling of that, on the bench prompts:

    .venv/bin/python scripts/experiments/plain_stretch.py acceptance   # drafts accepted after a plain stretch
    .venv/bin/python scripts/experiments/plain_stretch.py catch-up     # the head's catch-up cost by length
    .venv/bin/python scripts/experiments/plain_stretch.py timing --k 3 --drafting 64 --plain 64

``acceptance``: greedy text is the same for every K, so a K=4 cycle run after ``gap`` plain
cycles (keeping one token) can be compared with the recorded steady-drafting acceptance at the
same position (tests/data/acceptance_demo.json), with the head catching up on at most ``cap``
pending positions. ``catch-up``: the head over n pending positions at once (keys and values
only for all but the last). ``timing``: the time between a decode loop's events for a fixed
pattern of ``--drafting`` K=``--k`` cycles and ``--plain`` plain ones (8, 4, 8), by place in
its stretch (auto K's ``SETTLE_CYCLES``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import engine.cycle.sequence as sequence  # (the engine package binds the fast BLAS first)
import engine.cycle.speculative as speculative
from engine.api import GenerationRequest
from engine.bench.prompts import load_prompts
from engine.bench.speed import parse_samplers
from engine.runtime import DraftPolicy, Engine
from engine.scheduling.autok import PatternChooser

ROOT = Path(__file__).resolve().parents[2]


def acceptance(engine: Engine, prompts: list[dict], gaps: list[int], caps: list[int]) -> None:
    record = json.loads((ROOT / "tests" / "data" / "acceptance_demo.json").read_text())
    steady = {row["id"]: row["accepted"] for row in record["samplers"]["greedy"]}
    params = parse_samplers("greedy", engine)["greedy"]
    default_cap = sequence.MAX_CATCH_UP
    for gap in gaps:
        for cap in caps:
            sequence.MAX_CATCH_UP = cap
            got = ref = n = 0
            for prompt in prompts:
                request = GenerationRequest(prompt["ids"], params, 256)
                seq = engine.new_sequence(request.prompt_ids, params, draft=True)
                for t in range(256):
                    k = 4 if t % (gap + 1) == gap else 0
                    result = speculative.run_cycle(engine.trunk, engine.loaded.head, seq, k)
                    speculative.commit(seq, result, 1)
                    if k:
                        got, ref, n = got + result.n_accepted, ref + steady[prompt["id"]][t], n + 1
            print(
                f"after {gap} plain cycles, catch-up cap {cap}: {got / n:.3f} of 4 drafts "
                f"accepted; steady drafting at the same positions {ref / n:.3f} ({n} cycles)",
                flush=True,
            )
    sequence.MAX_CATCH_UP = default_cap


def catch_up(engine: Engine, lengths: list[int], reps: int = 30) -> None:
    import mlx.core as mx

    trunk, head = engine.trunk, engine.loaded.head
    ids = [(i * 7919) % (engine.vocab_size - 1) for i in range(300)]
    params = parse_samplers("greedy", engine)["greedy"]
    seq = engine.new_sequence(ids, params, draft=True)
    for n in lengths:
        hidden = mx.random.normal((1, n, trunk.args.hidden_size))
        tokens = mx.array([ids[:n]])
        mx.eval(hidden)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            _, logits = head(trunk, tokens, hidden, seq.head_cache)
            mx.eval(mx.argmax(logits, axis=-1))
            times.append(time.perf_counter() - t)
            seq.head_cache.trim(n)
        median = statistics.median(times)
        each = median / n * 1e3
        print(f"catch-up over {n:3d} positions: {median * 1e3:6.2f} ms ({each:.3f} ms each)")


def timing(engine: Engine, prompts: list[dict], k: int, drafting: int, plain: int) -> None:
    params = parse_samplers("greedy", engine)["greedy"]
    by_place: dict[tuple[int, int], list[float]] = {}
    for prompt in prompts:
        chooser = PatternChooser([k] * drafting + [0] * plain)
        request = GenerationRequest(prompt["ids"], params, 256, ignore_eos=True)
        seq = engine.new_sequence(request.prompt_ids, params, draft=True)
        cycles: list[dict] = []
        stamps: list[float] = []
        # the pattern decides K in place of auto K (the engine asks ``policy`` for it)
        pattern = DraftPolicy(fixed=None, chooser=chooser)
        engine.policy = lambda *_, pattern=pattern: pattern  # type: ignore[method-assign]
        for _ in engine.decode(seq, request, trace=cycles.append):
            stamps.append(time.perf_counter())
        ks = [len(cycle["draft"]) for cycle in cycles]
        run = 0
        for j in range(1, len(ks)):
            run = run + 1 if ks[j] == ks[j - 1] else 0
            by_place.setdefault((ks[j], run), []).append(stamps[j] - stamps[j - 1])
    for (kk, place), gaps in sorted(by_place.items(), key=lambda item: (-item[0][0], item[0][1])):
        # (other K: the last cycles, capped at max_tokens)
        if kk in (0, k) and (place < 8 or place + 1 in (16, 32, 64)) and len(gaps) > 4:
            print(
                f"K={kk} cycle {place + 1} of its stretch: {statistics.median(gaps) * 1e3:5.2f} ms"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["acceptance", "catch-up", "timing"])
    parser.add_argument("--model", default=str(ROOT / "models" / "qwen3.5-demo"))
    parser.add_argument("--gaps", default="16,64")
    parser.add_argument("--caps", default=f"9,{sequence.MAX_CATCH_UP}")
    parser.add_argument("--k", type=int, default=4, help="timing: the drafting stretches' K")
    parser.add_argument("--drafting", type=int, default=8, help="timing: drafting cycles a stretch")
    parser.add_argument("--plain", type=int, default=8, help="timing: plain cycles a stretch")
    args = parser.parse_args()
    engine = Engine.load(args.model, draft_tokens=4)
    prompts = load_prompts(ROOT / "configs" / "bench_prompts.jsonl", engine.tokenizer, None)
    if args.what == "acceptance":
        gaps = [int(g) for g in args.gaps.split(",")]
        acceptance(engine, prompts, gaps, [int(c) for c in args.caps.split(",")])
    elif args.what == "catch-up":
        catch_up(engine, [1, 5, 9, 16, 32, 64, 128])
    else:
        timing(engine, prompts[:12], args.k, args.drafting, args.plain)


if __name__ == "__main__":
    main()
