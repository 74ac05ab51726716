"""``mtpserve bench``: speed-up, acceptance and memory side by side, in one run.

For every sampler and every K (plus ``auto`` and mlx-lm's own ``stream_generate`` as the outside
baseline) the benchmark generates ``--max-tokens`` tokens (EOS ignored, so every configuration
does the same work) for each prompt of a fixed set, interleaving configurations prompt by prompt
so that machine noise hits them alike, and rotating their order from one prompt to the next so
that none always runs in the same place (with a fixed order, auto — always right after K=4 — ran
at 0.97x of K=4 while drafting K=4 in 1,876 of its 1,877 cycles; alternating the two, 1.01x).
Speed-ups are ratios against K=0 *of the same run*.

The default samplers are greedy decoding, Qwen's sampler seeded per prompt (``preset:qwen``) and
the same sampler unseeded (``unseeded:qwen``). Both sampled rows are needed because automatic K
treats them differently: a seeded sampled request chooses from a plan measured once per build
and machine and from its own draws alone (``EngineAutoK.seeded_plan``, so that its seed repeats
its text), an unseeded one follows the live chooser and timings, so the two ``auto`` rows
measure different policies.

A second, profiled pass per (sampler, K) syncs after each cycle stage to split cycle time into
draft / verify / accept / rollback (commit) / overhead; the timed pass never does. The cost
model (engine.scheduling.autok: measured cycle costs x measured per-position acceptance)
predicts each K's speed-up; the table prints prediction and measurement side by side and names
the stage that accounts for a gap.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from engine.allocator import malloc_in_use
from engine.api import DEMO_MODEL, DRAFT_VOCAB_HELP, GenerationStats, parse_draft_tokens
from engine.bench.prompts import DEFAULT_PROMPTS, load_prompts
from engine.bench.speed_report import format_table, plot
from engine.blas import blas_in_use
from engine.scheduling.autok import representative_sampler
from engine.scheduling.costs import decoding_kind, head_bytes_ratio, measure_costs


@dataclass
class Row:
    """One (sampler, config) cell: the summed generation statistics and what is derived."""

    sampler: str
    config: str  # "K=0", "K=2", "auto", "mlx_lm"
    totals: GenerationStats = field(default_factory=GenerationStats)
    peak_memory_bytes: int = 0
    # profiled pass, seconds per cycle
    split: dict[str, float] = field(default_factory=dict)
    speedup: float = 0.0
    predicted_speedup: float | None = None
    #: the speed-up were every step to cost only its weights' read (a verify of K+1 positions
    #: as cheap as one, no per-op cost): tokens a cycle over 1 + (head steps a cycle) x a head
    #: step's bytes / a plain step's, at the acceptance this row measured. Where steps are bound
    #: by reading weights speculation cannot beat it: it sets a measured speed-up against what
    #: this checkpoint's head could give.
    bytes_bound: float | None = None
    bandwidth_gbps: float = 0.0
    gap_note: str = ""
    #: each timed generation's seconds, in run order (every configuration of a sampler runs
    #: the same prompts in the same order, so rows pair up prompt by prompt)
    seconds: list[float] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        """Flat: the statistics' fields next to the derived figures (results.json's rows)."""
        t = self.totals
        out = {"sampler": self.sampler, "config": self.config, **asdict(t)}
        out.update(
            decode_tps=t.generation_tps,
            prefill_tps=t.prompt_tps,
            acceptance=t.acceptance_rate,
            tokens_per_cycle=t.tokens_per_cycle or 1.0,
            peak_memory_bytes=self.peak_memory_bytes,
            split=self.split,
            speedup=self.speedup,
            predicted_speedup=self.predicted_speedup,
            bytes_bound=self.bytes_bound,
            bandwidth_gbps=self.bandwidth_gbps,
            gap_note=self.gap_note,
        )
        return out


#: the sampler spec of a preset whose requests carry no seed (``preset:NAME`` rows are seeded
#: per prompt); a spec of its own because automatic K drafts differently for the two
UNSEEDED = "unseeded:"


def parse_samplers(text: str, engine: Any) -> dict[str, Any]:
    """``greedy``, ``preset:NAME`` or ``unseeded:NAME``, comma-separated, to resolved params."""
    from dataclasses import replace

    from sampling.params import SamplingOverrides, preset, resolve

    samplers = {}
    for name in text.split(","):
        name = name.strip()
        if name == "greedy":
            samplers[name] = resolve(engine.sampling_defaults, SamplingOverrides(temperature=0.0))
        elif name.startswith(("preset:", UNSEEDED)):
            params = resolve(engine.sampling_defaults, preset(name.split(":", 1)[1]))
            # a seed from the checkpoint's defaults or the preset would make the row seeded
            samplers[name] = replace(params, seed=None) if name.startswith(UNSEEDED) else params
        else:
            raise SystemExit(f"unknown sampler {name!r} (use greedy, preset:NAME or unseeded:NAME)")
    return samplers


def request_params(name: str, params: Any, seed: int) -> Any:
    """The sampler a request of sampler ``name`` sends: sampled ``preset:`` rows seeded per
    prompt (their text repeats from run to run, and under automatic K they draft the seeded
    fixed K), greedy and ``unseeded:`` rows as parsed (the engine draws an unseeded request's
    seed at random, and automatic K chooses live)."""
    if params.greedy or name.startswith(UNSEEDED):
        return params
    return with_seed(params, seed)


def mlx_lm_sampler(params: Any) -> Any:
    from mlx_lm.sample_utils import make_sampler

    if params.greedy:
        return make_sampler(temp=0.0)
    return make_sampler(
        temp=params.temperature,
        top_p=params.top_p if params.top_p < 1 else 0.0,
        min_p=params.min_p,
        top_k=params.top_k,
    )


def run_mlx_lm(engine: Any, prompt_ids: list[int], params: Any, max_tokens: int, row: Row) -> None:
    from mlx_lm import stream_generate
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    tokenizer = TokenizerWrapper(engine.tokenizer)
    tokenizer._eos_token_ids = set()  # same work as ours: no early stop
    if params.seed is not None:  # an unseeded row draws from mlx's generator as it stands
        mx.random.seed(params.seed)
    last = None
    for last in stream_generate(
        engine.loaded.model,
        tokenizer,
        mx.array(prompt_ids),
        max_tokens=max_tokens,
        sampler=mlx_lm_sampler(params),
    ):
        pass
    assert last is not None
    stats = GenerationStats(
        prompt_tokens=last.prompt_tokens,
        completion_tokens=last.generation_tokens,
        prompt_seconds=last.prompt_tokens / max(last.prompt_tps, 1e-9),
        generation_seconds=last.generation_tokens / max(last.generation_tps, 1e-9),
    )
    row.totals.add(stats)
    row.seconds.append(stats.generation_seconds)


def run_ours(
    engine: Any, prompt_ids: list[int], params: Any, k: int | None, max_tokens: int, row: Row
) -> None:
    from engine.api import GenerationRequest

    request = GenerationRequest(prompt_ids, params, max_tokens, draft_tokens=k, ignore_eos=True)
    event = None
    for event in engine.generate(request):
        pass
    row.totals.add(event.stats)
    row.seconds.append(event.stats.generation_seconds)


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from engine.runtime import Engine

    engine = Engine.load(
        args.model, draft_tokens=None, mtp_weights=args.mtp_weights, draft_vocab=args.draft_vocab
    )
    samplers = parse_samplers(args.sampler, engine)
    ks: list[int | None] = [parse_draft_tokens(k) for k in args.draft_tokens.split(",")]
    if not engine.has_head:
        ks = [0]
    prompts = load_prompts(Path(args.prompts), engine.tokenizer, args.limit)
    params_all = tree_flatten(engine.trunk.parameters())
    head_bytes = sum(a.nbytes for n, a in params_all if n.startswith("mtp."))
    trunk_bytes = sum(a.nbytes for n, a in params_all if not n.startswith("mtp.")) - (
        engine.trunk.model.embed_tokens.weight.nbytes
        if not engine.trunk.args.tie_word_embeddings
        else 0
    )  # an untied embedding is gathered, not streamed: only lm_head counts as read per step
    head_ratio = head_bytes_ratio(engine) if engine.has_head else 0.0
    # The bench always measures afresh, one table per decoding kind (truncation and sampling
    # add work per cycle that greedy decoding does not have), and installs it in the engine's
    # auto K: the prediction and the `auto` rows decide from the same figures. Samplers of one
    # kind (seeded and unseeded) share its table: measuring it twice would only install the
    # second reading over the first.
    # (A checkpoint without a head only decodes plainly: nothing to model.)
    kind_costs: dict[str, Any] = {}
    sampler_costs = {}
    for name, params in samplers.items() if engine.has_head else ():
        kind = decoding_kind(params)
        if kind not in kind_costs:
            kind_costs[kind] = engine.autok.costs(params, refresh=True)
        sampler_costs[name] = kind_costs[kind]

    configs: list[tuple[str, Any, float | None]] = [("mlx_lm", "mlx_lm", None)]
    configs += [(f"K={k}" if k is not None else "auto", k, None) for k in ks]
    if args.confidence is not None and engine.has_head:
        k_cut = max(k for k in ks if k is not None)
        configs.append((f"K={k_cut},p>={args.confidence:g}", k_cut, args.confidence))
    rows = {(s, c): Row(s, c) for s in samplers for c, _, _ in configs}

    # Warm-up: compile every K's blocks and mlx-lm's graph once.
    for sname, params in samplers.items():
        for cname, k, confidence in configs:
            warm = Row(sname, cname)
            engine.draft_confidence = confidence
            if k == "mlx_lm":
                run_mlx_lm(engine, prompts[0]["ids"], params, 8, warm)
            else:
                run_ours(engine, prompts[0]["ids"], params, k, 8, warm)

    total = len(prompts) * args.repeats * len(samplers) * len(configs)
    with tqdm(total=total, desc="bench", unit="gen", disable=args.json) as bar:
        for repeat in range(args.repeats):
            for i, prompt in enumerate(prompts):
                for sname, base in samplers.items():
                    params = request_params(sname, base, 1000 * repeat + i)
                    turn = (repeat * len(prompts) + i) % len(configs)
                    for cname, k, confidence in configs[turn:] + configs[:turn]:
                        row = rows[(sname, cname)]
                        engine.draft_confidence = confidence
                        mx.reset_peak_memory()
                        if k == "mlx_lm":
                            run_mlx_lm(engine, prompt["ids"], params, args.max_tokens, row)
                        else:
                            run_ours(engine, prompt["ids"], params, k, args.max_tokens, row)
                        row.peak_memory_bytes = max(row.peak_memory_bytes, mx.get_peak_memory())
                        bar.update()

    # What auto K's in-run calibration made of the start-up table (AutoK.calibrate)
    calibration = {}
    for name, params in samplers.items() if engine.has_head else ():
        kind = engine.autok.kinds[decoding_kind(params)]
        calibration[name] = {
            "kind": decoding_kind(params),
            "plain": kind.calibration[0],
            "drafting": kind.calibration[1],
            "tilt": kind.tilt[1:],
        }

    # The cost tables once more, now that every configuration has run, and the prediction from
    # each entry's lower reading: on this shared 2-core machine a slow moment during the
    # start-up measurement once timed a greedy plain step at 3.25 ms against 2.4 ms in the run
    # (K=3 and K=4 cycles alike), and the predictions came out 30-38% high.
    late_by_kind: dict[str, Any] = {}
    late_costs = {}
    for name, params in samplers.items():
        if name not in sampler_costs:
            continue
        kind = decoding_kind(params)
        if kind not in late_by_kind:
            late_by_kind[kind] = measure_costs(
                engine, params=representative_sampler(engine, params)
            )
        late_costs[name] = late_by_kind[kind]
    tables = {name: sampler_costs[name].lowest(late) for name, late in late_costs.items()}

    # Profiled pass: split cycle time per stage (a few prompts suffice).
    engine.profile = True
    for sname, base in samplers.items():
        for cname, k, confidence in configs:
            if k == "mlx_lm":
                continue
            engine.draft_confidence = confidence
            profiled = Row(sname, cname)
            for i, prompt in enumerate(prompts[: args.profile_prompts]):
                params = request_params(sname, base, i)
                run_ours(engine, prompt["ids"], params, k, args.max_tokens, profiled)
            t = profiled.totals
            cycles = max(t.cycles, 1)
            rows[(sname, cname)].split = {
                "draft": t.draft_seconds / cycles,
                "verify": t.verify_seconds / cycles,
                "accept": t.accept_seconds / cycles,
                "rollback": t.commit_seconds / cycles,
                "overhead": (
                    t.generation_seconds
                    - t.draft_seconds
                    - t.verify_seconds
                    - t.accept_seconds
                    - t.commit_seconds
                )
                / cycles,
            }
    engine.profile = False
    engine.draft_confidence = None

    for (sname, cname), row in rows.items():
        t = row.totals
        plain = rows.get((sname, "K=0"))
        if plain and plain.totals.generation_tps:
            row.speedup = t.generation_tps / plain.totals.generation_tps
        if not t.generation_seconds:
            continue
        if cname == "mlx_lm":
            row.bandwidth_gbps = trunk_bytes * t.completion_tokens / t.generation_seconds / 1e9
            continue
        head_steps = sum(k * n for k, n in enumerate(t.k_histogram))
        row.bandwidth_gbps = (trunk_bytes * t.cycles + head_bytes * head_steps) / (
            t.generation_seconds * 1e9
        )
        if t.cycles:
            row.bytes_bound = t.tokens_per_cycle / (1 + head_steps / t.cycles * head_ratio)
        table = tables.get(sname)
        if table and cname.startswith("K=") and "," not in cname and t.cycles:
            k = int(cname[2:])
            per_position = conditional_acceptance(t)
            if k < len(table.cycle):
                row.predicted_speedup = table.predicted_speedup(per_position, k)
                if abs(row.speedup / row.predicted_speedup - 1) > 0.10:
                    row.gap_note = _gap_note(
                        t.generation_seconds / t.cycles, table, k, row, plain, per_position
                    )

    auto_priced = {
        sname: priced
        for sname in samplers
        if (priced := price_auto_choices(rows, sname, args.repeats)) is not None
    }

    # Peak memory with and without the head, each in a fresh process (peaks must not mix).
    memory = None
    if engine.has_head and not args.mtp_weights:
        from engine.bench.memory import measure

        model_dir = engine.loaded.model_dir
        memory = {"trunk_only": measure(model_dir, False), "with_head": measure(model_dir, True)}

    return {
        "model": str(engine.loaded.model_dir),
        "memory": memory,
        "machine": platform.platform(),
        "blas": blas_in_use(),
        "malloc": malloc_in_use(),
        "draft_vocab_size": engine.draft_vocab_size,
        "draft_vocab_bytes": engine.draft_vocab_bytes,
        "max_tokens": args.max_tokens,
        "prompts": len(prompts),
        "repeats": args.repeats,
        "trunk_bytes": trunk_bytes,
        "head_bytes": head_bytes,
        "head_bytes_ratio": head_ratio,
        "costs": {name: asdict(table) for name, table in tables.items()},
        "costs_at_start": {name: asdict(table) for name, table in sampler_costs.items()},
        "costs_at_end": {name: asdict(table) for name, table in late_costs.items()},
        "auto_calibration": calibration,
        "auto_priced": auto_priced,
        "rows": [r.as_json() for r in rows.values()],
    }


def price_auto_choices(
    rows: dict[tuple[str, str], Row], sampler: str, passes: int = 1
) -> dict[str, Any] | None:
    """Auto K's choices priced at the fixed-K rows of the same run: its cycles at K (its K
    histogram), each taking the seconds and yielding the tokens of an average cycle of the
    fixed K=k row. Separates the quality of auto's choices from what a run adds on top —
    sampled text (and so acceptance) differs between configurations, and on this 2-core machine
    the same work moves by a few percent between configurations of one run (a sampled auto that
    ran K=3 in 1,644 of 2,094 cycles, with the same 2.93 tokens per cycle as fixed K=3, measured
    0.96x of it). With several passes over the prompts, also auto against a fixed K picked on
    the other passes (``held_out_ratio``). None when auto or a fixed K it used did not run."""
    auto = rows.get((sampler, "auto"))
    if auto is None or not auto.totals.cycles:
        return None
    seconds = tokens = 0.0
    for k, n in enumerate(auto.totals.k_histogram):
        if not n:
            continue
        fixed = rows.get((sampler, f"K={k}"))
        if fixed is None or not fixed.totals.cycles:
            return None
        seconds += n * fixed.totals.generation_seconds / fixed.totals.cycles
        tokens += n * fixed.totals.completion_tokens / fixed.totals.cycles
    fixed_rows = [
        r
        for (s, c), r in rows.items()
        if s == sampler and c.startswith("K=") and "," not in c and r.totals.cycles
    ]
    best = max(fixed_rows, key=lambda r: r.totals.generation_tps)
    return {
        "tps": tokens / seconds,
        "best_fixed": best.config,
        "of_best_fixed": tokens / seconds / best.totals.generation_tps,
        "measured_of_best_fixed": auto.totals.generation_tps / best.totals.generation_tps,
        "measured_interval": paired_interval(best.seconds, auto.seconds),
        "held_out": held_out_ratio({r.config: r.seconds for r in fixed_rows}, auto.seconds, passes),
    }


def held_out_ratio(
    fixed: dict[str, list[float]], auto: list[float], passes: int
) -> dict[str, Any] | None:
    """Auto's speed over a fixed K picked as a user tuning K would pick it: on runs other than
    the ones it is compared on. Each pass over the prompts in turn is held out; the fixed K
    fastest over the other passes is compared with auto on the held-out one, and the held-out
    seconds add up over the passes (every generation the same tokens: sum of the picks' seconds
    over auto's). Unlike the best row of the same run, the pick's own lucky draws do not favour
    it: the largest of five rows that each move by a few percent reads high by itself. Returns
    the ratio and each pass's pick; None with one pass or unpaired rows."""
    n = len(auto)
    if passes < 2 or n % passes or any(len(seconds) != n for seconds in fixed.values()):
        return None
    per = n // passes
    picks: list[str] = []
    baseline = 0.0
    for held in range(passes):
        inside = slice(held * per, (held + 1) * per)
        pick = min(fixed, key=lambda c: sum(fixed[c]) - sum(fixed[c][inside]))
        picks.append(pick)
        baseline += sum(fixed[pick][inside])
    return {"of": baseline / sum(auto), "picks": picks}


def paired_interval(
    baseline: list[float], other: list[float], draws: int = 2000, level: float = 0.9
) -> list[float] | None:
    """How precisely one run measures ``other``'s speed over ``baseline``'s (the same prompts,
    one generation each, the same tokens): the ``level`` interval of sum(baseline) / sum(other)
    over the prompts resampled with replacement. It holds the spread of prompts and of the
    machine's noise; not that ``baseline`` was picked as the largest of several noisy rows,
    which favours it further. None without pairs."""
    if len(baseline) != len(other) or len(baseline) < 2:
        return None
    rng = random.Random(0)
    n = len(baseline)
    ratios = []
    for _ in range(draws):
        picks = [rng.randrange(n) for _ in range(n)]
        ratios.append(sum(baseline[i] for i in picks) / sum(other[i] for i in picks))
    ratios.sort()
    tail = (1 - level) / 2
    return [ratios[int(tail * draws)], ratios[int((1 - tail) * draws) - 1]]


def conditional_acceptance(stats: GenerationStats) -> list[float]:
    """a_i = P(draft i accepted | drafts 1..i-1 accepted), what the cost model multiplies.

    The statistics count, per position, the cycles that proposed it and those that accepted it,
    so accepted/proposed is the *unconditional* P(draft i accepted) (what the table shows); the
    conditional rate divides by the cycles that accepted the position before instead.
    """
    rates: list[float] = []
    reached = stats.proposed_per_position[0] if stats.proposed_per_position else 0
    for accepted in stats.accepted_per_position:
        rates.append(accepted / reached if reached else 0.0)
        reached = accepted
    return rates


def with_seed(params: Any, seed: int) -> Any:
    from dataclasses import replace

    return replace(params, seed=seed)


def _gap_note(
    run_cycle: float, costs: Any, k: int, row: Row, plain: Row | None, acceptance: list[float]
) -> str:
    """Where a prediction gap comes from. The prediction is the measured cost ratio of a
    K-cycle to a plain step (times the run's acceptance), so compare each side with the run,
    then the profiled split with the table's parts: draft = the head's expected catch-up plus
    K-1 draft steps, verify = a (K+1)-token trunk forward."""
    from engine.scheduling.costs import committed_distribution

    def versus(name: str, run: float, table: float) -> str:
        return f"{name} {run * 1e3:.1f} ms in run vs {table * 1e3:.1f} ms measured"

    notes = [versus(f"K={k} cycle", run_cycle, costs.cycle_cost(acceptance, k))]
    if plain and plain.totals.cycles:
        step = plain.totals.generation_seconds / plain.totals.cycles
        notes.append(versus("K=0 step", step, costs.cycle[0]))
    if row.split and k > 0:
        catch_up = costs.catch_up(committed_distribution(acceptance, k))
        expected = {"draft": catch_up + (k - 1) * costs.head_step, "verify": costs.trunk[k]}
        gaps = {stage: row.split[stage] - expected[stage] for stage in expected}
        stage = max(gaps, key=lambda n: abs(gaps[n]))
        notes.append(
            ", ".join(versus(n, row.split[n], expected[n]) for n in expected)
            + f" (profiled): mostly {stage}, {gaps[stage] * 1e3:+.1f} ms"
        )
    return "; ".join(notes)


def cmd_bench(args: argparse.Namespace) -> int:
    from engine.bench import sharding
    from engine.distributed.group import world

    if args.sharding or world() is not None:
        return sharding.cmd_bench(args)
    t = time.perf_counter()
    result = bench(args)
    result["wall_seconds"] = time.perf_counter() - t
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "speedup.png")
    table = format_table(result)
    (out / "table.txt").write_text(table + "\n")
    if args.json:
        print(json.dumps(result))
    else:
        print(table)
        print(
            f"\nwrote {out}/results.json, {out}/table.txt, {out}/speedup.png "
            f"({result['wall_seconds']:.0f}s)"
        )
    return 0


def _draft_token_list(value: str) -> str:
    """Check every K of a comma-separated list at parse time (a CLI error naming the range)."""
    try:
        for k in value.split(","):
            parse_draft_tokens(k)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return value


def register(sub: Any) -> None:

    p = sub.add_parser("bench", help="speed-up, acceptance and memory vs plain decoding and mlx-lm")
    p.add_argument("--model", default=str(DEMO_MODEL))
    p.add_argument("--mtp-weights", default=None)
    p.add_argument("--draft-vocab", type=int, default=None, help=DRAFT_VOCAB_HELP)
    p.add_argument("--draft-tokens", default="0,1,2,3,4,auto", type=_draft_token_list)
    p.add_argument(
        "--sampler",
        default="greedy,preset:qwen,unseeded:qwen",
        help="greedy, preset:NAME (seeded per prompt), unseeded:NAME (no seed), comma-separated",
    )
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="passes over the prompts, each seeded anew (two: on a 2-core machine one pass "
        "moves a row by ~2%%, the size of the gaps auto K is judged by)",
    )
    p.add_argument("--profile-prompts", type=int, default=2)
    p.add_argument(
        "--confidence",
        type=float,
        default=None,
        help="also run the largest K with a draft-confidence cut at this head probability",
    )
    p.add_argument(
        "--sharding",
        action="store_true",
        help="the sharding report (K=0 and auto: tokens/s, memory per rank, collectives); "
        "what `bench` runs under mlx.launch, here for the 1-rank row",
    )
    p.add_argument("--out", default="bench-results")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench)
