"""What decoding costs on this machine: the cost table auto K prices cycles with.

A whole cycle (K head steps, one verify over K+1 positions, acceptance, the one sync) is
*measured* for K = 0..max instead of modelled, plus the one part of a cycle that depends on
acceptance: the head's first step catches up on every position the previous cycle committed
(1..K+1), timed for each count, so C(K) = cycle[K] + E[catch-up]. The trunk's T-token forward
and the head-step costs are kept beside it for the benchmark's table. Tables are cached per
model, machine, mlx version and engine code under ``~/.cache/mtpserve`` (``MTPSERVE_CACHE``).
Auto K (``engine.scheduling.autok``) reads costs only through this module.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
from mlx.utils import tree_flatten

from engine.allocator import malloc_in_use
from engine.api import GenerationEvent, GenerationRequest
from engine.blas import blas_in_use
from engine.cycle.sequence import MAX_CATCH_UP, Sequence, absorb_pending
from engine.model.mtp import MTPHead, project_to_vocab
from engine.model.trunk import trunk_hidden
from sampling.distribution import argmax_ids
from sampling.params import SamplingOverrides, SamplingParams

log = logging.getLogger("mtpserve.costs")

#: The longest draft auto K considers.
MAX_AUTO_K = 4
#: cycles of one K run back to back when measuring (the first one is not counted)
CYCLES_IN_A_ROW = 8
#: plain cycles run this many in a row and only the last CYCLES_IN_A_ROW count: after the drafting
#: rows, the first plain cycles measured 7-9% slower than plain decoding's steady state (the bias
#: made every predicted speed-up come out high)
PLAIN_ROW = 32


class CostProbe(Protocol):
    """What pricing cycles needs from the engine it prices (``engine.runtime.Engine`` is one):
    the model to time forwards on, where its tables are cached, fresh sequences, and the
    request loop itself, so that cycles are timed as requests run them."""

    draft_vocab_size: int
    draft_vocab_bytes: int
    sampling_defaults: SamplingOverrides
    #: encodes the text auto K measures acceptance on (``autok.probe_acceptance``)
    tokenizer: Any

    @property
    def trunk(self) -> Any: ...

    @property
    def head(self) -> MTPHead | None: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def model_dir(self) -> Path: ...

    def new_sequence(
        self, prompt_ids: list[int], params: SamplingParams, draft: bool
    ) -> Sequence: ...

    def decode(self, seq: Sequence, request: GenerationRequest) -> Iterator[GenerationEvent]: ...


def decoding_kind(params: Any) -> str:
    return "greedy" if params.greedy else "sampled"


CACHE_DIR = Path(os.environ.get("MTPSERVE_CACHE", Path.home() / ".cache" / "mtpserve"))


@dataclass(frozen=True)
class CostTable:
    """Measured seconds: ``cycle[K]`` for a K-cycle whose head catches up on one committed
    position (K = 1..max), ``cycle[0]`` for a plain cycle as the decode loop runs them (one
    launched ahead of the other, see engine.cycle.speculative); ``absorb[n-1]`` for the head's
    catch-up over n positions at once; ``trunk[T-1]`` for a T-token verify forward (with the
    vocabulary projection);
    ``head_step`` for one draft step; ``absorb_far`` for a catch-up over ``MAX_CATCH_UP``
    positions (a probe after a long plain stretch; counts in between are interpolated).

    Why ``absorb``: a cycle's first draft step runs the head over every position the previous
    cycle committed (1..K+1 of them), so a K-cycle costs more the more the last one accepted.
    """

    cycle: list[float]
    trunk: list[float]
    head_step: float
    absorb: list[float] = field(default_factory=list)
    absorb_far: float = 0.0
    machine: str = ""

    def catch_up(self, committed: list[float]) -> float:
        """Expected seconds of the head's catch-up after a cycle whose committed-token counts
        have distribution ``committed`` (``committed_distribution``). Without a measured
        ``absorb`` a catch-up over one position is taken to cost one head step."""
        return sum(p * self.absorb_seconds(n) for n, p in enumerate(committed, 1))

    @cached_property
    def _catch_ups(self) -> list[float]:
        """``absorb_seconds(n)`` for the counts a cycle of the table commits, n = 1..len(cycle)
        (``rates`` reads them every cycle)."""
        return [self.absorb_seconds(n) for n in range(1, len(self.cycle) + 1)]

    def absorb_seconds(self, n: int) -> float:
        """The head's catch-up over ``n`` positions."""
        return catch_up_seconds(self.absorb or [self.head_step], n, self.absorb_far)

    def cycle_cost(self, acceptance: list[float], k: int) -> float:
        """Expected seconds of a K-cycle in steady state (the previous cycle also drafted K):
        the measured cycle (which caught up on one position) plus the expected extra
        catch-up over the positions a K-cycle commits."""
        return self._cycle_cost(k, committed_distribution(acceptance, k))

    def rates(self, acceptance: list[float]) -> list[float]:
        """Expected tokens per second for every K of the table: ``_mean_tokens`` over
        ``_cycle_cost`` of each K's ``committed_distribution``, in one pass over the positions
        (auto K prices every K each cycle: ~2 µs in Python, where one K at a time took ~13,
        1.2% of a demo model's plain cycle on a 2-core AMD EPYC VM).

        A K-cycle commits n <= K tokens with probability r_{n-1} (1 - a_n) (r_i: the first i
        drafts all accepted) and K+1 with r_K; the sums over n <= K are shared by every larger
        K, so each K adds its own last term to them."""
        catch_ups, cycle, last = self._catch_ups, self.cycle, len(acceptance) - 1
        rates = [1.0 / cycle[0]]
        run, tokens, catch_up = 1.0, 0.0, 0.0  # r_i, and the sums over n <= i
        for k in range(1, len(cycle)):
            a = acceptance[min(k - 1, last)] if acceptance else 0.0
            tokens += k * run * (1 - a)
            catch_up += catch_ups[k - 1] * run * (1 - a)
            run *= a
            seconds = cycle[k] + catch_up + catch_ups[k] * run - catch_ups[0]
            rates.append((tokens + (k + 1) * run) / seconds)
        return rates

    def predicted_speedup(self, acceptance: list[float], k: int) -> float:
        rates = self.rates(acceptance)
        return rates[k] / rates[0]

    def scaled(self, plain: float, drafting: float) -> CostTable:
        """The table with plain cycles' costs times ``plain`` and every drafting cost (cycles,
        catch-up) times ``drafting``."""
        return replace(
            self,
            cycle=[self.cycle[0] * plain, *(c * drafting for c in self.cycle[1:])],
            absorb=[a * drafting for a in self.absorb],
            absorb_far=self.absorb_far * drafting,
            head_step=self.head_step * drafting,
        )

    def lowest(self, other: CostTable) -> CostTable:
        """Each entry's lower reading of two measurements of the same costs. On a shared
        machine noise only adds time, and one slow moment can skew a whole measurement (the
        benchmark measures before and after its run and predicts from this)."""
        return replace(
            self,
            cycle=[min(a, b) for a, b in zip(self.cycle, other.cycle, strict=True)],
            trunk=[min(a, b) for a, b in zip(self.trunk, other.trunk, strict=True)],
            head_step=min(self.head_step, other.head_step),
            absorb=[min(a, b) for a, b in zip(self.absorb, other.absorb, strict=True)],
            absorb_far=min((x for x in (self.absorb_far, other.absorb_far) if x), default=0.0),
        )

    def expected_seconds(self, k: int, committed_before: int) -> float:
        """Seconds the table gives a K-cycle whose head catches up on ``committed_before``
        positions (what the previous drafting cycle committed; 1 for a plain cycle's K=0)."""
        if k == 0:
            return self.cycle[0]
        catch_ups = self._catch_ups  # absorb_seconds(n) for n = 1..len(cycle), computed once
        n = committed_before
        catch_up = catch_ups[n - 1] if 0 < n <= len(catch_ups) else self.absorb_seconds(n)
        return self.cycle[k] + catch_up - catch_ups[0]

    def _cycle_cost(self, k: int, committed: list[float]) -> float:
        if k == 0:
            return self.cycle[0]
        return self.cycle[k] + self.catch_up(committed) - self.catch_up([1.0])


def affine_fit(values: list[float]) -> list[float]:
    """The least-squares line through ``values[n-1]`` at n = 1, 2, ..., never falling: a
    catch-up over n positions is one head forward over n tokens, affine in n while the head's
    weights bound it. Single medians of it differ by noise alone (0.45-0.72 ms on the demo
    model for n = 1..5, in no order), and the differences between them are what prices one
    drafting K against another: a table whose catch-up over 3 positions measured 0.12 ms
    under its one over 4 priced a K=2 cycle ~5% cheaper against a K=3 one."""
    if len(values) < 2:
        return list(values)
    counts = range(1, len(values) + 1)
    slope, intercept = statistics.linear_regression(counts, values)
    if slope < 0:
        slope, intercept = 0.0, statistics.fmean(values)
    # (an outlier must not take the line's low end under every reading)
    return [max(intercept + slope * n, min(values)) for n in counts]


def catch_up_seconds(absorb: list[float], n: int, far: float = 0.0) -> float:
    """``absorb[n-1]``, the catch-up over n positions; beyond the measured counts, linear up to
    ``far`` at ``MAX_CATCH_UP`` positions (held at the longest measured count without it)."""
    if n <= len(absorb) or far <= 0.0:
        return absorb[min(n, len(absorb)) - 1]
    n, last = min(n, MAX_CATCH_UP), len(absorb)
    return absorb[-1] + (far - absorb[-1]) * (n - last) / (MAX_CATCH_UP - last)


def expected_tokens(acceptance: list[float], k: int) -> float:
    return _mean_tokens(committed_distribution(acceptance, k))


def _mean_tokens(committed: list[float]) -> float:
    return sum(n * p for n, p in enumerate(committed, 1))


def committed_distribution(acceptance: list[float], k: int) -> list[float]:
    """P(a K-cycle emits n tokens) for n = 1..K+1: n-1 drafts accepted, then a rejection (or,
    for n = K+1, all K accepted and the bonus token)."""
    probs, run = [], 1.0
    for i in range(k):
        a = acceptance[min(i, len(acceptance) - 1)] if acceptance else 0.0
        probs.append(run * (1 - a))
        run *= a
    return [*probs, run]


def best_k(costs: CostTable, acceptance: list[float]) -> int:
    rates = costs.rates(acceptance)
    return max(range(len(rates)), key=rates.__getitem__)


def machine_key(model_dir: Path) -> str:
    weights = sorted(model_dir.glob("*.safetensors"))
    stamp = [(p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in weights]
    parts = [
        str(model_dir),
        json.dumps(stamp),
        platform.machine(),
        platform.processor(),
        str(os.cpu_count()),
        str(mx.default_device()),
        mx.__version__,
        blas_in_use(),
        malloc_in_use(),
        _code_stamp(),
        _group_stamp(),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _group_stamp() -> str:
    """Ranks sharing the trunk: a sharded cycle pays collectives, so its costs differ."""
    return f"ranks={mx.distributed.init().size()}"


@functools.cache
def _code_stamp() -> str:
    """A hash of the code a cycle runs, the native kernel's sources included: costs measured
    before an engine or kernel change are stale. Once a process: the code it runs is what it
    loaded, and hashing the sources took ~2 ms, which every save of a refined table (one a
    request) paid on the decoding thread."""
    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    patterns = (
        "engine/**/*.py",
        "sampling/**/*.py",
        "engine/model/native/*.cpp",
        "engine/model/native/*.h",
    )
    for path in sorted(path for pattern in patterns for path in root.glob(pattern)):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def measure_costs(
    engine: CostProbe, max_k: int = MAX_AUTO_K, reps: int = 9, params: Any = None
) -> CostTable:
    """Time real cycles on a dummy sequence (greedy unless ``params``), median of ``reps``
    interleaved repetitions. Each repetition starts a fresh 128-token sequence and grows it by
    ~150 tokens, the context lengths of a typical request (on one ever-growing sequence, K=4
    cycles at 1,600 tokens measured 15% dearer than in a bench run).

    The sequence repeats four tokens, so that a model that drafts at all drafts it alike at
    every K: a cycle after one that rejected drafts costs more than one after a cycle that
    accepted them all (the Gated-DeltaNet state is rolled back and replayed; ~5% at K=3 on the
    demo model), and on 128 tokens in no pattern the demo model's greedy text fell into a loop
    only as the repetition went on, its K=1 and K=2 rows rejecting (0.8 and 0.6 drafts
    accepted a cycle) and its K=3 and K=4 rows accepting every draft: short drafts priced
    dearer than long ones by the regime they were timed in."""
    dummy_ids = [(i % 4 * 7919) % (engine.vocab_size - 1) for i in range(128)]
    params = params or SamplingParams(temperature=0.0)
    trunk, head = engine.trunk, engine.head
    assert head is not None, "a cost table prices drafting: the model needs its MTP head"

    def median(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    def settle() -> None:
        """Run the head (untimed) over all but the last pending position, so every timed
        K-cycle catches up on exactly one, as ``CostTable.cycle`` defines."""
        if sum(h.shape[1] for h in seq.head_pending) > 1:
            absorb_pending(trunk, head, seq, keep_last=True)
            mx.eval(seq.head_cache.state, *seq.head_pending)

    def time_cycles(k: int, n: int) -> list[tuple[float, int]]:
        """``n`` K-cycles as a request runs them (the decode loop; plain ones launched ahead):
        per cycle after the first, the gap since the previous cycle's event and the tokens that
        cycle committed (this one's head catch-up)."""
        request = GenerationRequest(
            seq.tokens, params, n * (k + 1), draft_tokens=k, ignore_eos=True
        )
        events: list[tuple[float, int]] = []
        for event in engine.decode(seq, request):
            events.append((time.perf_counter(), len(event.token_ids)))
            if len(events) == n:
                break  # closing the loop undoes a launched look-ahead cycle
        return [(t - t0, c0) for (t0, c0), (t, _) in zip(events, events[1:], strict=False)]

    def time_trunk(n: int) -> float:
        t = time.perf_counter()
        ids = mx.array([seq.tokens[-1]] * n)[None]
        hidden = trunk_hidden(trunk, ids, seq.trunk_cache, capture=True)
        # the vocabulary projection too: the verify stage it is compared with includes it
        mx.eval(hidden, project_to_vocab(trunk, hidden), seq.trunk_cache.arrays())
        seq.trunk_cache.commit(1, n)
        seq.head_pending.append(hidden[:, :1])
        seq.tokens.append(seq.tokens[-1])
        return time.perf_counter() - t

    def time_head() -> float:
        t = time.perf_counter()
        _, logits = head(trunk, mx.array([[seq.tokens[-1]]]), probe, seq.head_cache)
        mx.eval(argmax_ids(logits))
        seq.head_cache.trim(1)
        return time.perf_counter() - t

    def time_absorb(n: int) -> float:
        t = time.perf_counter()
        _, logits = head(trunk, mx.array([[seq.tokens[-1]] * n]), probe_n[:, :n], seq.head_cache)
        mx.eval(argmax_ids(logits))
        seq.head_cache.trim(n)
        return time.perf_counter() - t

    probe = mx.zeros((1, 1, trunk.args.hidden_size))
    probe_n = mx.zeros((1, max(max_k + 1, MAX_CATCH_UP), trunk.args.hidden_size))
    # Interleave the configurations rep by rep so that noise from other processes hits all
    # alike; the first two reps compile and warm up. Within a rep each K runs a few cycles in a
    # row, as in decoding: a lone cycle between other work finds colder caches (it measured
    # ~15% slower than the same cycle in a run).
    cycle_rows: list[list[list[tuple[float, int]]]] = [[] for _ in range(max_k + 1)]
    trunk_times: list[list[float]] = [[] for _ in range(max_k + 1)]
    absorb_times: list[list[float]] = [[] for _ in range(max_k + 1)]
    head_times: list[float] = []
    far_times: list[float] = []
    for rep in range(reps + 2):
        seq = engine.new_sequence(dummy_ids, params, draft=True)  # the helpers above read it
        for k in range(max_k + 1):
            row = time_cycles(k, PLAIN_ROW if k == 0 else CYCLES_IN_A_ROW)
            t = time_trunk(k + 1)
            settle()
            # The catch-up over k+1 positions, timed after the drafting row (the catch-up over
            # one after the last): as a drafting cycle runs it, with the head warm. Timed
            # after the plain row, the head idle for 32 cycles, the demo model's one-position
            # catch-up measured 0.84-0.85 ms where the others took 0.57-0.63.
            a = time_absorb(k + 1) if k else None
            if rep >= 2:
                cycle_rows[k].append(row[-CYCLES_IN_A_ROW + 1 :])
                trunk_times[k].append(t)
                if a is not None:
                    absorb_times[k].append(a)
        one = time_absorb(1)
        h = time_head()
        far = time_absorb(MAX_CATCH_UP)
        if rep >= 2:
            absorb_times[0].append(one)
            head_times.append(h)
            far_times.append(far)
    absorb = affine_fit([median(x) for x in absorb_times])

    def one_position_catch_up(gap: float, committed_before: int) -> float:
        """A cycle's time as if its head had caught up on one position (``CostTable.cycle``)."""
        return gap - (catch_up_seconds(absorb, committed_before) - absorb[0])

    cycle = [
        median([median([one_position_catch_up(*c) for c in row]) for row in rows])
        for rows in cycle_rows
    ]
    return CostTable(
        cycle=cycle,
        trunk=[median(x) for x in trunk_times],
        head_step=median(head_times),
        absorb=absorb,
        absorb_far=median(far_times),
        machine=platform.platform(),
    )


#: a warm-up forward slower than this (seconds) is timing enough: its compilation is a small
#: part of it, and a large model's start-up should not wait on more
SLOW_FORWARD = 0.5


#: a forward faster than this (seconds) gets its start-up table from the decode loop's own
#: cycles (``measure_costs`` with one repetition: ~200 forwards' time) instead of from timed
#: forwards: under 2 s of start-up
LOOP_TIMED_FORWARD = 0.01


def estimate_costs(
    engine: CostProbe,
    max_k: int = MAX_AUTO_K,
    reps: int = 1,
    thorough: bool = False,
    clock: Any = time.perf_counter,
) -> CostTable:
    """A quick cost table from a few timed forwards (seconds, not minutes, on a large model):
    the trunk over 1 and max_k+1 tokens with the vocabulary projection, and the head over 1 and
    max_k+1 positions, each the lowest of ``reps`` timings after one warm-up (which compiles;
    the warm-up alone when it is slower than ``SLOW_FORWARD``).
    Forwards over 2..max_k tokens are interpolated linearly between them (a forward's cost is
    affine in its tokens while weights, not arithmetic, bound it). ``thorough`` (the
    benchmark's cost table) times every length, ``reps`` times each; ``clock`` is what times
    them (the benchmark on a shared machine: the process's CPU time). Cycles follow the cost
    model:
    a plain cycle is a one-token forward; a K-cycle one catch-up step, K-1 draft steps and the
    (K+1)-token verify. A model whose forward takes under ``LOOP_TIMED_FORWARD`` is instead
    timed through the decode loop (``measure_costs``, one repetition): there the forward alone
    is not what a cycle costs.

    What the model leaves out (sampling, host syncs, the plain cycles' overlap) is learned in
    the run: ``AutoK.calibrate`` learns the machine's speed and drafting cycles' cost over
    plain ones from the first timed cycles on (the first timings weigh the most)."""
    trunk, head = engine.trunk, engine.head
    assert head is not None, "a cost table prices drafting: the model needs its MTP head"
    ids = [(i * 7919) % (engine.vocab_size - 1) for i in range(max_k + 2)]
    # A one-token prompt: nothing to prefill (on a slow model a prefill takes a forward too).
    seq = engine.new_sequence(ids[:1], SamplingParams(temperature=0.0), draft=True)
    hidden_size = trunk.args.hidden_size

    def timed(run: Any) -> float:
        t = clock()
        run()  # the warm-up compiles; on a large model that is a small part of a forward
        best = clock() - t
        for _ in range(reps if thorough or best < SLOW_FORWARD else 0):
            t = clock()
            run()
            best = min(best, clock() - t)
        return best

    def forward(n: int) -> None:
        hidden = trunk_hidden(trunk, mx.array([ids[:n]]), seq.trunk_cache, capture=True)
        mx.eval(hidden, project_to_vocab(trunk, hidden), seq.trunk_cache.arrays())
        seq.trunk_cache.commit(1, n)  # the context grows by one token per forward

    def head_run(n: int) -> None:
        _, logits = head(trunk, mx.array([ids[:n]]), mx.zeros((1, n, hidden_size)), seq.head_cache)
        mx.eval(argmax_ids(logits))
        seq.head_cache.trim(n)

    lengths = range(1, max_k + 2) if thorough else (1, max_k + 1)

    def by_length(run: Any, known: dict[int, float] | None = None) -> list[float]:
        timings = dict(known or {})
        timings |= {n: timed(lambda n=n: run(n)) for n in lengths if n not in timings}
        one, many = timings[1], timings[max_k + 1]
        times = [timings.get(n, one + (many - one) * (n - 1) / max_k) for n in range(1, max_k + 2)]
        # more positions never cost less: a noisy single timing must not make them
        return list(itertools.accumulate(times, max))

    t0 = time.perf_counter()
    one = timed(lambda: forward(1))
    if one < LOOP_TIMED_FORWARD and not thorough:
        # A fast model: a forward timed alone is mostly the host's sync and per-op costs, which
        # the decode loop overlaps (a plain cycle runs one ahead). Timed forwards priced the
        # demo model's plain cycle at 0.93-1.72 ms where the loop runs it in 0.56-0.58 (a K=3
        # cycle 1.4-1.9x, plain 1.7-3x), and once the run calibrated drafting, plain looked
        # dearer than a K=1 cycle: auto K never ran plain, so never timed it. The decode loop's
        # own cycles instead, one repetition (~0.4 s there), each drafting K at least the one
        # below it (a draft one longer is a head step and a verified position more: one noisy
        # row priced K=4 under K=3, and auto K then drafted K=4 throughout).
        costs = measure_costs(engine, max_k, reps=1)
        costs = replace(costs, cycle=[costs.cycle[0], *itertools.accumulate(costs.cycle[1:], max)])
        log.info(
            "auto K: cycle costs from the decode loop's cycles in %.1fs: %s ms",
            time.perf_counter() - t0,
            [round(1e3 * c, 2) for c in costs.cycle],
        )
        return costs
    if one > SLOW_FORWARD and not thorough:
        # A slow model (a forward of seconds: bf16 weights on a CPU, a large model): one timed
        # forward is all start-up waits for. Its weights bound it, so a verify of K+1 tokens is
        # priced as one forward and a head step by the bytes it reads; the run's first cycles
        # calibrate both classes (exploration drafts K=4 before the table decides anything).
        trunk_times = [one] * (max_k + 1)
        absorb = [one * head_bytes_ratio(engine)] * (max_k + 1)
    else:
        trunk_times = by_length(forward, {1: one})
        absorb = by_length(head_run)
    head_step = absorb[0]
    cycle = [trunk_times[0]] + [
        trunk_times[k] + absorb[0] + (k - 1) * head_step for k in range(1, max_k + 1)
    ]
    per_position = (absorb[-1] - absorb[0]) / max_k
    log.info(
        "auto K: estimated cycle costs from timed forwards in %.1fs: plain %.1f ms, "
        "head step %.1f ms, verify of %d tokens %.1f ms (refined from the cycles that run)",
        time.perf_counter() - t0,
        1e3 * cycle[0],
        1e3 * head_step,
        max_k + 1,
        1e3 * trunk_times[-1],
    )
    return CostTable(
        cycle=cycle,
        trunk=trunk_times,
        head_step=head_step,
        absorb=absorb,
        absorb_far=absorb[-1] + per_position * (MAX_CATCH_UP - max_k - 1),
        machine=platform.platform(),
    )


def head_bytes_ratio(engine: CostProbe) -> float:
    """Bytes a head step reads over the bytes a plain step reads: its own layer and the output
    projection (its draft-vocabulary rows when drafting over a subset), against the trunk's
    weights (an untied input embedding is gathered, not read whole)."""
    trunk = engine.trunk
    params = tree_flatten(trunk.parameters())
    head = sum(a.nbytes for n, a in params if n.startswith("mtp."))
    embed = trunk.model.embed_tokens.weight.nbytes
    if trunk.args.tie_word_embeddings:
        projection = embed
        plain = sum(a.nbytes for n, a in params if not n.startswith("mtp."))
    else:
        projection = trunk.lm_head.weight.nbytes
        plain = sum(a.nbytes for n, a in params if not n.startswith("mtp.")) - embed
    if engine.draft_vocab_bytes:
        projection = engine.draft_vocab_bytes
    return (head + projection) / max(plain, 1)


def cost_cache_path(engine: CostProbe, kind: str) -> Path:
    key = machine_key(engine.model_dir)
    return CACHE_DIR / f"costs-{key}-v{engine.draft_vocab_size}-{kind}.json"


def seeded_plan_path(engine: CostProbe) -> Path:
    """Where ``EngineAutoK.seeded_plan`` keeps its plan (per build, machine and model)."""
    key = machine_key(engine.model_dir)
    return CACHE_DIR / f"seeded-plan-{key}-v{engine.draft_vocab_size}.json"


def cached_costs(engine: CostProbe, kind: str) -> CostTable | None:
    path = cost_cache_path(engine, kind)
    try:
        return CostTable(**json.loads(path.read_text()))
    except (OSError, TypeError, ValueError):
        return None


def save_costs(engine: CostProbe, kind: str, costs: CostTable) -> None:
    try:
        path = cost_cache_path(engine, kind)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(costs)))
    except OSError:
        pass


def load_or_measure(engine: CostProbe, refresh: bool = False, params: Any = None) -> CostTable:
    """The cost table for greedy (``params`` None) or for sampling with ``params``: the cached
    one unless ``refresh``, else measured now and cached."""
    kind = "greedy" if params is None else decoding_kind(params)
    if not refresh and (cached := cached_costs(engine, kind)) is not None:
        return cached
    t = time.perf_counter()
    costs = measure_costs(engine, params=params)
    log.info("measured cycle costs in %.1fs: %s", time.perf_counter() - t, costs.cycle)
    save_costs(engine, kind, costs)
    return costs
