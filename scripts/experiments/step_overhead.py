"""Per-token cost of the decode loop, and what a cycle dispatches, for old-vs-new comparisons.

For each draft count K it reports the primitives mlx evaluates in one cycle (counted from the
cycle's graph, by kind), and the wall and process-CPU milliseconds per generated token through
``Engine.generate`` (greedy, or with ``--sampled`` Qwen's sampler seeded; EOS ignored, best of
``--repeats``), with a digest of the tokens so that two checkouts can be seen to produce the
same text. The weights load as ``--dtype`` says (float32 by default; ``auto`` keeps the
checkpoint's type, as the server does on the kernel). With K=0 it also times the
plain step's weight products alone (``weights_ms``): one ``[1, in]`` product by every float
linear layer of the trunk and by the vocabulary projection, evaluated together on mlx's one CPU
stream, alternating with the decoding runs — what reading the weights once costs one core on
this machine at the time, against the whole step's ``wall_ms``. On Linux ``busy`` is the share of
the decoding runs' wall time that the calling thread and the two busiest others (mlx's stream
thread, which runs the kernels, and the product pool's worker) spent on a CPU, and ``stolen`` the share of the machine's CPU
time the hypervisor gave to other guests meanwhile (``steal`` in ``/proc/stat``): a shared
machine's threads wait, runnable, for that share.

Where a cycle's time goes, by thread and function: run it long (``--tokens 3000``) and, while it
decodes, ``perf record -e cpu-clock -F 2000 -p PID -- sleep 8`` (an unstripped build of the
extension names the kernel's functions: ``cmake -DCMAKE_BUILD_TYPE=RelWithDebInfo``).

On a shared machine, compare two checkouts by running both *at the same time* (each sees the
same load) and repeating; e.g.::

    git archive OLD | tar -x -C /tmp/old
    for i in 1 2 3; do
      PYTHONPATH=/tmp/old python scripts/experiments/step_overhead.py --json > old.$i &
      PYTHONPATH=$PWD python scripts/experiments/step_overhead.py --json > new.$i; wait
    done
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import io
import json
import os
import re
import time
from typing import Any

# engine first: its __init__ preloads the fast BLAS before anything imports mlx
from engine.api import GenerationRequest
from engine.cycle.sequence import Sequence, start_sequence
from engine.cycle.speculative import launch_cycles
from engine.runtime import Engine
from sampling.params import SamplingOverrides, resolve

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
GREEDY = SamplingOverrides(temperature=0.0)
#: the checkpoint's generation_config.json sampler (Qwen's), seeded so that runs repeat
QWEN_SEEDED = SamplingOverrides(temperature=1.0, top_k=20, top_p=0.95, seed=1)


def primitives(
    ours: Engine, prompt: list[int], k: int, sampler: SamplingOverrides
) -> dict[str, int]:
    """The primitives of one cycle's graph."""
    import mlx.core as mx

    params = resolve(sampler)
    seq = start_sequence(ours.trunk, ours.loaded.head, prompt, params, use_head=True)
    mx.eval(seq.trunk_cache.arrays())
    return cycle_primitives(ours, [seq], k)


def cycle_primitives(ours: Engine, seqs: list[Sequence], k: int) -> dict[str, int]:
    """The primitives of the graph of one cycle of ``seqs`` (a batch when several), which is
    built and counted but not evaluated: the rows' caches are left mid-cycle."""
    import mlx.core as mx

    import engine.cycle.speculative as speculative

    async_eval = speculative.mx.async_eval
    speculative.mx.async_eval = lambda *arrays: None  # keep the graph unevaluated
    try:
        cycles = launch_cycles(ours.trunk, ours.loaded.head, seqs, k)
    finally:
        speculative.mx.async_eval = async_eval
    dot = io.StringIO()
    outputs = [a for c in cycles for a in (c.n_accepted, c.next_token, c.hidden, c.drafts)]
    mx.export_to_dot(dot, *outputs, *(a for seq in seqs for a in seq.trunk_cache.arrays()))
    kinds = collections.Counter(re.findall(r'label ="([A-Za-z]+)', dot.getvalue()))
    return {"total": sum(kinds.values()), **dict(kinds.most_common(12))}


def weights_ms(ours: Engine) -> float:
    """Milliseconds to evaluate one ``[1, in]`` product by each float linear layer of the
    trunk (by its prepared transposed weight, as the step multiplies it) and the vocabulary
    projection: every weight a plain step of a dense model reads, read once. The inputs are
    made and evaluated before the clock starts."""
    import mlx.core as mx
    import mlx.nn as nn

    from engine.model.mtp import project_to_vocab
    from engine.model.products import linear

    trunk = ours.trunk
    dtype = trunk.model.embed_tokens.weight.dtype
    linears = [m for layer in trunk.model.layers for m in layer.modules() if type(m) is nn.Linear]
    inputs = [mx.random.normal((1, m.weight.shape[1])).astype(dtype) for m in linears]
    hidden = mx.random.normal((1, trunk.args.hidden_size)).astype(dtype)
    mx.eval(inputs, hidden)
    start = time.perf_counter()
    outs = [linear(m, x) for m, x in zip(linears, inputs, strict=True)]
    mx.eval(outs, project_to_vocab(trunk, hidden))
    return (time.perf_counter() - start) * 1e3


def thread_ticks() -> dict[int, int]:
    """CPU clock ticks (user + system) of each of this process's threads (Linux; else none)."""
    ticks = {}
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks[int(tid)] = int(fields[11]) + int(fields[12])
    return ticks


def cpu_times() -> tuple[int, int]:
    """(steal, all) clock ticks of the whole machine since boot (Linux; else zeros)."""
    if not os.path.exists("/proc/stat"):
        return 0, 0
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def per_token(
    ours: Engine,
    prompt: list[int],
    k: int | None,
    tokens: int,
    repeats: int,
    sampler: SamplingOverrides,
) -> dict[str, Any]:
    params = resolve(sampler)
    wall = cpu = weights = float("inf")
    digest = ""
    ticks: collections.Counter[int] = collections.Counter()
    seconds = 0.0
    steal = total = 0
    for _ in range(repeats):
        if k == 0:
            weights = min(weights, *(weights_ms(ours) for _ in range(5)))
        request = GenerationRequest(prompt, params, tokens, draft_tokens=k, ignore_eos=True)
        out: list[int] = []
        c0, t0, before = time.process_time(), time.perf_counter(), thread_ticks()
        steal_before, all_before = cpu_times()
        for event in ours.generate(request):
            out += event.token_ids
        seconds += time.perf_counter() - t0
        steal_after, all_after = cpu_times()
        steal, total = steal + steal_after - steal_before, total + all_after - all_before
        ticks.update({tid: n - before.get(tid, 0) for tid, n in thread_ticks().items()})
        cpu = min(cpu, (time.process_time() - c0) / len(out))
        wall = min(wall, event.stats.generation_seconds / len(out))
        digest = hashlib.sha1(json.dumps(out).encode()).hexdigest()[:10]
    row = {"wall_ms": round(wall * 1e3, 3), "cpu_ms": round(cpu * 1e3, 3), "tokens": digest}
    if k == 0:
        row["weights_ms"] = round(weights, 3)
    if ticks:
        row["stolen"] = round(steal / total, 2) if total else 0.0
        share = {tid: n / os.sysconf("SC_CLK_TCK") / seconds for tid, n in ticks.items()}
        # the busiest other threads: mlx's stream thread, then the product pool's worker
        others = sorted((v for tid, v in share.items() if tid != os.getpid()), reverse=True)
        others += [0.0, 0.0]
        row["busy"] = {
            "calling": round(share.get(os.getpid(), 0.0), 2),
            "stream": round(others[0], 2),
            "worker": round(others[1], 2),
        }
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="models/qwen3.5-demo")
    p.add_argument("--draft-tokens", default="0,4")
    p.add_argument("--tokens", type=int, default=192)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--sampled", action="store_true", help="Qwen's sampler, seeded")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    sampler = QWEN_SEEDED if args.sampled else GREEDY
    kinds = args.draft_tokens.split(",")
    # auto K measures its cost table at load (cached per engine code)
    default = None if "auto" in kinds else 0
    ours = Engine.load(args.model, draft_tokens=default, dtype=args.dtype)
    prompt = list(ours.tokenizer.encode(PROMPT))
    result: dict[str, Any] = {}
    for k in kinds:
        fixed = None if k == "auto" else int(k)
        row = per_token(ours, prompt, fixed, args.tokens, args.repeats, sampler)
        if fixed is not None:
            row["primitives"] = primitives(ours, prompt, fixed, sampler)
        result[f"K={k}"] = row
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    from engine.allocator import reexec_under_jemalloc

    reexec_under_jemalloc()  # timed as the mtpserve command runs (MTPSERVE_MALLOC=system: glibc)
    raise SystemExit(main())
