"""``mtpserve bench`` under ``mlx.launch`` (or ``--sharding`` for the 1-rank row): tokens/s with
K=0 and automatic K over the bench prompts, memory per rank, and with several ranks the share of
a cycle spent in the tensor-parallel collectives (engine.distributed), priced by timing the
same collectives alone."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from engine.api import GenerationRequest
from engine.bench.prompts import load_prompts
from engine.distributed import engine_class
from engine.distributed.group import world
from engine.distributed.measure import time_send
from engine.distributed.protocol import MESSAGE_SIZE, OP_PING


def bench_sharding(args: Any) -> dict[str, Any]:
    """Tokens/s with K=0 and auto K over the bench prompts (greedy, EOS ignored), memory per
    rank, and — with several ranks — the share of a cycle spent in the tensor-parallel
    collectives, priced by timing the same collectives alone."""
    from sampling.params import SamplingParams

    t_load = time.perf_counter()
    engine = engine_class().load(
        args.model, draft_tokens=None, mtp_weights=args.mtp_weights, draft_vocab=args.draft_vocab
    )
    load_seconds = time.perf_counter() - t_load
    group, leader = world(), getattr(engine, "leader", None)

    def memory() -> list[dict[str, Any]]:
        if leader is not None:
            return leader.memory_per_rank()
        return [{"peak_bytes": mx.get_peak_memory(), "active_bytes": mx.get_active_memory()}]

    after_load = memory()
    prompts = load_prompts(Path(args.prompts), engine.tokenizer, args.limit)
    greedy = SamplingParams(temperature=0.0)
    configs: list[tuple[str, int | None]] = [("K=0", 0), ("auto", None)]
    for _, k in configs:  # warm-up: compile every block once
        list(engine.generate(GenerationRequest(prompts[0]["ids"], greedy, 8, draft_tokens=k)))
    rows: dict[str, dict[str, float]] = {}
    for name, k in configs:
        tokens = cycles = positions = 0
        seconds = 0.0
        before = memory()
        for _ in range(args.repeats):
            for prompt in prompts:
                request = GenerationRequest(
                    prompt["ids"], greedy, args.max_tokens, draft_tokens=k, ignore_eos=True
                )
                for event in engine.generate(request):
                    pass
                s = event.stats
                tokens += s.completion_tokens
                cycles += s.cycles
                positions += s.cycles + s.proposed  # verified positions: K+1 per cycle
                seconds += s.generation_seconds
        rows[name] = {
            "tokens": tokens,
            "cycles": cycles,
            "tokens_per_second": tokens / seconds,
            "ms_per_cycle": 1e3 * seconds / cycles,
            "verified_positions_per_cycle": positions / cycles,
        }
        if leader is not None:  # rank 1's clock over these generations
            after = memory()
            waiting = after[1]["waiting_s"] - before[1]["waiting_s"]
            steps = after[1]["steps_s"] - before[1]["steps_s"]
            rows[name]["follower_waiting_share"] = waiting / max(waiting + steps, 1e-9)
    result: dict[str, Any] = {
        "model": str(engine.loaded.model_dir),
        "ranks": group.size() if group is not None else 1,
        "layers": len(engine.trunk.layers),
        "load_seconds": load_seconds,
        "memory_after_load": after_load,
        "memory_peak": memory(),
        "rows": rows,
    }
    if leader is not None:
        hidden = engine.trunk.args.hidden_size
        dtype = engine.trunk.model.norm.weight.dtype
        shard = engine.trunk.args.vocab_size // group.size()
        layers = len(engine.trunk.layers)
        message = leader.probe_collectives(MESSAGE_SIZE, 1, mx.int32, 200)
        for row in rows.values():
            # A verify pass: its message, the embedded input, mixer out + MLP down per layer;
            # then the logits: a message, the states, the gather of every rank's logits. A draft
            # step (the head over the vocabulary tables): a message and the embedded token, a
            # message, the head's state and the gather.
            positions = max(1, round(row["verified_positions_per_cycle"]))
            drafts = row["verified_positions_per_cycle"] - 1
            latency = leader.probe_collectives(positions, hidden, dtype, reps=200)
            gather = leader.probe_collectives(positions, shard, dtype, 50, gather=True)
            verify = 2 * message + (2 * layers + 2) * latency + gather
            if drafts > 0:
                one = leader.probe_collectives(1, hidden, dtype, 200)
                one_gather = leader.probe_collectives(1, shard, dtype, 50, gather=True)
                verify += drafts * (2 * message + 2 * one + one_gather)
            row["all_sum_ms"] = 1e3 * latency
            row["collective_ms_per_cycle"] = 1e3 * verify
            row["collective_share"] = row["collective_ms_per_cycle"] / row["ms_per_cycle"]
        leader.flush((OP_PING, 0, 1, 200))
        result["send_ms"] = 1e3 * time_send(group, 1, hidden, dtype, 200)
        engine.shutdown()
    return result


def format_report(result: dict[str, Any]) -> str:
    mib = 1 << 20
    lines = [f"{result['model']}: {result['ranks']} rank(s), {result['layers']} layers"]
    for r, (load, peak) in enumerate(
        zip(result["memory_after_load"], result["memory_peak"], strict=True)
    ):
        lines.append(
            f"  rank {r}: {load['active_bytes'] / mib:.1f} MiB after load, "
            f"peak {peak['peak_bytes'] / mib:.1f} MiB"
        )
    for name, row in result["rows"].items():
        line = (
            f"  {name:5s} {row['tokens_per_second']:7.1f} tok/s"
            f"  {row['ms_per_cycle']:6.1f} ms/cycle"
            f"  {row['verified_positions_per_cycle']:.2f} positions/cycle"
        )
        if "collective_share" in row:
            line += (
                f"  collectives {row['collective_ms_per_cycle']:.1f} ms/cycle"
                f" ({100 * row['collective_share']:.0f}%; all_sum {row['all_sum_ms']:.2f} ms)"
                f"  rank 1 waiting {100 * row['follower_waiting_share']:.0f}%"
            )
        lines.append(line)
    if "send_ms" in result:
        lines.append(f"  one-way send of one position's hidden state: {result['send_ms']:.2f} ms")
    return "\n".join(lines)


def cmd_bench(args: Any) -> int:
    result = bench_sharding(args)
    print(json.dumps(result) if args.json else format_report(result))
    return 0
