"""Continuous batching: many requests decoding together, speculation on for every row.

``BatchDecoder`` holds up to ``capacity`` rows. It is the one decode loop: a request alone is
a batch of one row (``Engine.generate``). Each row is ``Engine.row_steps`` — the request's own
loop (prefill, K choice, stops, stats, events) that yields to the batch whenever
it needs the model: ``None`` after a prefill chunk, a ``CycleNeed`` for a cycle. One ``step``
of the batch advances every row once:

0. the rows that emitted an event in the previous step go on to their next cycle's need (or
   end, cancelled meanwhile: a request's ``cancelled()`` is polled after its consumer has seen
   each event, before the next cycle);
1. the rows that asked for a cycle run it together — one ``launch_cycles`` per distinct K:
   each draft depth runs the head once for all its rows, the verify is one trunk pass over
   every row's K+1 positions, acceptance and commit are per row — and read back with one sync;
2. every row gets its result back and runs until it emits its event; the
   newcomers still prefilling get one prompt chunk each, first come first served, within a
   budget of prompt tokens per step (the first always gets its chunk): one chunk's worth while
   any row is decoding, so the running rows never wait more than a chunk of prefill between
   two cycles, and ``PREFILL_TOKENS_IDLE`` while none is, so that a burst of short prompts
   starts decoding together; of several newcomers none overtakes an earlier one; a row that
   finishes, is cancelled or fails leaves at once.

Rows are independent: a row's draws are keyed by its own seed and sequence position
(``sampling.distribution.keyed_uniform``), it has its own penalty history and caches, and its
commit keeps its own accepted length, so what a row emits does not depend on the other rows
(tests/engine/test_batching.py checks it against the same request alone). A seeded sampled row never
shares the batch's automatic K: its own chooser (``EngineAutoK.seeded_plan``) follows the build
and machine's measured plan and the row's own draws, so its text repeats beside any neighbours.

Plain cycles run one ahead, as a request alone runs them (``engine.cycle.speculative``'s
docstring): when every row of the batch is decoding, they all run a plain cycle together and
each will run a plain one next, the batch commits the cycle unread (``commit_unread``),
launches the next one for the same rows and only then reads this one back, so the host builds
one graph while the other runs. A row that stops meanwhile, is cancelled or dropped has its
look-ahead cycle undone (``CacheSnapshot``) before it ends, so its caches hold exactly what it
emitted. Not while a newcomer prefills (it joins the next cycle instead of waiting out one run
ahead without it). A batched cycle is timed as the batch runs it — from the previous cycle's
read-back to its own — so a plain cycle launched ahead costs what its look-ahead leaves of it,
and a drafting one its host work as well (``BatchK``).

K for the batch: rows with a fixed K keep it; rows under automatic K share one K chosen by
``BatchK`` from their own acceptance estimates and the measured cost of a batched cycle at
this many rows (the verify grows with rows x (K+1), so K=0 can win when many rows run). A
row near its max_tokens drafts no further than it may emit.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Generator, Hashable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from engine.api import GenerationEvent, GenerationRequest, RequestError
from engine.cycle.sequence import PREFILL_CHUNK, CacheSnapshot, Sequence
from engine.cycle.speculative import (
    CycleResult,
    LaunchedCycle,
    commit_unread,
    launch_cycles,
    launch_heads_ahead,
    read_cycles,
)
from engine.model.memory import release_between_requests, release_while_running
from engine.scheduling.costs import MAX_AUTO_K, expected_tokens

log = logging.getLogger("mtpserve.batching")

#: cycles a K runs, interleaved with the other K being measured, each time it is priced: three,
#: so that the median discards the first, which also compiles the cycle's blocks for new shapes
EXPLORE_CYCLES = 3
#: how fast the machine runs now: the median over this many latest batched cycles at a size
SPEED_WINDOW = 5
#: every this many cycles at a batch size, the least recently timed K is priced anew
RETIME_EVERY = 64
#: a K whose rate is below this share of the best K's is priced anew only at every
#: ``FAR_WAIT``-th re-time (its rate still follows the rows' acceptance all along: only its
#: cost per cycle waits)
FAR_SHARE = 0.9
FAR_WAIT = 4
#: a row's first cycles are slower than its later ones (an 8-row K=2 group's first three: 60,
#: 42 and 36 ms, then 29-45): only cycles of rows past them price a K
SETTLING_CYCLES = 2
#: prompt tokens prefilled in a step while no row is decoding (nobody waits on it), across all
#: newcomers, each getting at most one chunk: a burst of eight chat-sized prompts joins in one
#: or two steps instead of eight (docs/BENCHMARKS.md, "Many requests at once"), and the first
#: newcomer's first token waits for at most this much of the others' prefill. While rows
#: decode: one chunk's worth.
PREFILL_TOKENS_IDLE = 4 * PREFILL_CHUNK


@dataclass
class BatchK:
    """Automatic K for a batch: argmax over K of (expected tokens of the automatic rows) /
    (measured seconds of a K-cycle at this batch size).

    Costs are measured, not modelled: each batched cycle's period per row goes to its batch
    size class, 2, 3-4, 5-8, 9-16, ... rows (rows join and leave all the time; per exact size,
    every size a batch passes through would be explored anew). The period runs from the
    previous cycle's read-back to this one's, over the same rows with nothing else between: it
    holds the host's work between cycles (the rows' commits and events, the next graph), and a
    plain cycle launched ahead (``BatchDecoder._look_ahead``) counts only what the overlap
    leaves of it. Launch to read-back alone priced an 8-row plain cycle of the demo model at
    4.0 ms against the 3.5 it takes ahead and an 8-row K=2 cycle at 9.4 against 9.8, and auto
    ran K=2 at 0.82x the plain batch's tokens/s.

    What is compared is each K's price relative to the machine's speed when it was measured.
    This machine's speed drifts by more than neighbouring K differ (an 8-row K=2 cycle took 25
    ms in one group and 41 ms a few seconds later; docs/BENCHMARKS.md, "Machine and method"),
    and only the K in use can be timed all the time: a K last timed in a fast spell looked
    cheaper than the running one timed in a slow spell, and the batch switched to it. So a K is
    priced in bursts: ``EXPLORE_CYCLES`` cycles (real ones, their tokens kept) when its size
    class is new — K=0's in a row, so that they run ahead as a plain stretch does, then the
    drafting K's interleaved — and again every ``RETIME_EVERY`` cycles for the least recently
    timed K among those within ``FAR_SHARE`` of the best rate (the best among them), of every
    K only at every ``FAR_WAIT``-th time (a burst of a K that cannot win costs the most: 8-row
    bursts of K=3 every 64 cycles held auto at ~0.91x plain batches); each burst cycle's
    seconds are divided by the machine's current speed, and the K's price is their median
    (the first cycle at a new shape also compiles its blocks: up to twice a warm cycle). Every
    other cycle measures that speed: its seconds over its K's price, the median of the last
    ``SPEED_WINDOW``. The speed scales every price alike, so the choice depends on the prices
    alone.
    """

    #: (size class, K) -> the per-row seconds of its last burst, each over the speed then
    prices: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    #: size class -> the latest cycles' seconds over their K's price
    speed: dict[int, deque[float]] = field(default_factory=dict)
    #: (size class, K) -> cycles run in its current burst
    counts: dict[tuple[int, int], int] = field(default_factory=dict)
    last_timed: dict[tuple[int, int], int] = field(default_factory=dict)
    cycles: dict[int, int] = field(default_factory=dict)

    @staticmethod
    def size_class(rows: int) -> int:
        return 1 << (rows - 1).bit_length()

    def price(self, rows: int, k: int) -> float:
        """A K-cycle's seconds per row at this batch size, relative to the machine's speed."""
        return statistics.median(self.prices[(self.size_class(rows), k)])

    def choose(self, rows: int, estimates: list[list[float]]) -> int:
        size = self.size_class(rows)
        ks = range(MAX_AUTO_K + 1)
        measuring = [k for k in ks if self.counts.get((size, k), 0) < EXPLORE_CYCLES]
        if measuring:
            # plain cycles in a row (each launched ahead of the last), then the drafting K's
            # interleaved, so that every K of a burst sees the same spell of the machine
            return min(measuring, key=lambda k: (k > 0, self.counts.get((size, k), 0), k))

        def rate(k: int) -> float:
            return sum(expected_tokens(a, k) for a in estimates) / self.price(rows, k)

        cycles = self.cycles.get(size, 0)
        if cycles % RETIME_EVERY == RETIME_EVERY - 1:
            best = max(rate(k) for k in ks)
            # every FAR_WAIT-th re-time any K may be due, else only those near the best
            # (among them the best itself, whose burst costs nothing more)
            anyone = cycles // RETIME_EVERY % FAR_WAIT == FAR_WAIT - 1
            due = [k for k in ks if anyone or rate(k) >= FAR_SHARE * best]
            stale = min(due, key=lambda k: self.last_timed[(size, k)])
            self.counts[(size, stale)] = 0
            self.prices[(size, stale)] = []
            return stale
        return max(ks, key=rate)

    def count(self, rows: int) -> None:
        """A cycle at this batch size that is not timed (no period: the batch's rows changed
        since the last read-back, or its rows ran in several groups) still brings the next
        re-time nearer."""
        size = self.size_class(rows)
        self.cycles[size] = self.cycles.get(size, 0) + 1

    def observe(self, rows: int, k: int, seconds: float) -> None:
        """A K-cycle of ``rows`` rows took ``seconds`` (its period: the class docstring)."""
        size = self.size_class(rows)
        cell, per_row = (size, k), seconds / rows
        if self.counts.get(cell, 0) < EXPLORE_CYCLES:
            recent = self.speed.get(size)
            speed = statistics.median(recent) if recent else 1.0
            self.prices.setdefault(cell, []).append(per_row / speed)
            self.counts[cell] = self.counts.get(cell, 0) + 1
        else:
            window = self.speed.setdefault(size, deque(maxlen=SPEED_WINDOW))
            window.append(per_row / self.price(rows, k))
        self.cycles[size] = self.cycles.get(size, 0) + 1
        self.last_timed[cell] = self.cycles[size]


class RowEngine(Protocol):
    """What a batch needs from the engine its rows run on (``engine.runtime.Engine``): each
    request's own loop, the model its cycles run on, and where batched costs are kept."""

    trunk: Any
    profile: bool
    prefill_chunk: int
    prefix_cache: Any
    batch_k: BatchK
    #: automatic K's cost tables (``EngineAutoK``), None before any request used auto K
    autok: Any

    @property
    def head(self) -> Any: ...

    def row_steps(
        self,
        request: GenerationRequest,
        cancelled: Callable[[], bool],
        trace: Callable[[dict[str, Any]], None] | None,
        seq: Sequence | None,
    ) -> Generator[Any, CycleResult | None, None]: ...


@dataclass
class CycleNeed:
    """A batch row asking for its next cycle: the K its own policy chooses (``own_k``, asked
    only when the batch does not choose for it), the most it may draft (``max_k``: never past
    max_tokens), for automatic K its chooser, and ``auto``: whether the batch decides its K
    together with its other automatic rows' from their estimates (``BatchK``) — never for a
    seeded row, whose chooser decides alone (``DraftPolicy.batched``)."""

    seq: Sequence
    own_k: Callable[..., int]
    max_k: int
    auto: bool
    chooser: Any = None


@dataclass
class _Row:
    steps: Any  # Engine.row_steps generator
    need: CycleNeed | None = None
    result: CycleResult | None = None
    #: its cycle failed: the row ends with this error
    error: BaseException | None = None
    #: past its prefill (it has asked for a cycle)
    decoding: bool = False
    #: prompt tokens its prefill may still run (an upper bound: the conversation cache may
    #: restore part of them)
    prompt_left: int = 0
    #: cycles it has run
    cycles: int = 0
    #: its next plain cycle, launched before the last one was read back, and what undoes it
    ahead: LaunchedCycle | None = None
    undo: Callable[[], None] | None = None
    #: the K its own policy chose for its next cycle when the batch looked ahead
    decided_k: int | None = None
    #: the K of the cycle it is about to run
    k: int = 0
    #: its prompt, kept while the conversation cache can share a prefill (``_waits``)
    prompt: tuple[int, ...] | None = None
    #: its prefill has begun
    started: bool = False
    #: it yielded an event and goes on (to its next cycle's need) at the next step, once the
    #: event's consumer has seen it: a cancellation in between ends it before another cycle
    paused: bool = False

    def next_chunk(self, chunk_tokens: int) -> int:
        """The most prompt tokens its next advance prefills: chunks end at multiples of
        ``chunk_tokens``, so never more than one chunk."""
        return min(chunk_tokens, self.prompt_left)


class BatchDecoder:
    """Rows decoding together on one engine (module docstring). Not thread-safe: the engine's
    worker thread owns it."""

    def __init__(self, engine: RowEngine, capacity: int) -> None:
        self.engine = engine
        self.capacity = capacity
        self.rows: dict[Hashable, _Row] = {}
        # the engine's: what a batch size costs outlives any one batch
        self.batch_k: BatchK = engine.batch_k
        #: the rows of the last cycle that held the whole batch, and when it was read back
        self._read_at: tuple[tuple[Hashable, ...], float] | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.rows

    def add(
        self,
        key: Hashable,
        request: GenerationRequest,
        cancelled: Callable[[], bool] = lambda: False,
        trace: Callable[[dict[str, Any]], None] | None = None,
        seq: Sequence | None = None,
    ) -> None:
        """A new row; it starts (its first prefill chunk) at the next ``step``. ``seq``: the row
        continues this sequence instead of prefilling the prompt (``Engine.decode``)."""
        if len(self.rows) >= self.capacity:
            raise RuntimeError("the batch is full")
        row = _Row(self.engine.row_steps(request, cancelled, trace, seq))
        row.prompt_left = 0 if seq is not None else max(1, len(request.prompt_ids) - 1)
        if self.engine.prefix_cache is not None and seq is None:
            row.prompt = tuple(request.prompt_ids)
        self.rows[key] = row

    def drop(self, key: Hashable) -> None:
        """Remove a row now (its consumer went away); its caches stay consistent."""
        row = self.rows.pop(key, None)
        if row is not None:
            _close(row)
            self._release_if_idle()

    def step(self) -> list[tuple[Hashable, GenerationEvent | BaseException]]:
        """Resume the rows that emitted an event last step, run the cycles the rows asked for,
        then advance every row to its next event or request (module docstring). Returns the
        events (or a row's error) in order; rows that ended have left."""
        out: list[tuple[Hashable, GenerationEvent | BaseException]] = []
        for key, row in list(self.rows.items()):
            if row.paused and self._advance(key, row, out):
                del self.rows[key]
                release_while_running()
        self._run_cycles()
        prefilled, queue_closed = 0, False
        chunk_tokens = self.engine.prefill_chunk
        idle = not any(row.decoding for row in self.rows.values())
        budget = PREFILL_TOKENS_IDLE if idle else chunk_tokens
        for key, row in list(self.rows.items()):
            if not row.decoding:
                if self._waits(row):
                    continue
                row.started = True
                chunk = row.next_chunk(chunk_tokens)
                if queue_closed or (prefilled and prefilled + chunk > budget):
                    queue_closed = True  # it and every later newcomer wait for the next step
                    continue
                prefilled += chunk
                row.prompt_left -= chunk
            ended = self._advance(key, row, out)
            if ended:
                del self.rows[key]
                release_while_running()  # a batch that never idles returns what rows freed
        self._release_if_idle()
        return out

    def _waits(self, row: _Row) -> bool:
        """Whether a row that has not begun its prefill waits for an earlier row prefilling
        the same prompt (the n choices of one request): once that row has prefilled, the
        conversation cache restores the prompt for this one, so it is prefilled once, not n
        times. The restored state gives exactly what a prefill would."""
        if row.started or row.prompt is None:
            return False
        return any(
            other.started and not other.decoding and other.prompt == row.prompt
            for other in self.rows.values()
            if other is not row
        )

    # ------------------------------------------------------------------------------------------
    def _advance(
        self, key: Hashable, row: _Row, out: list[tuple[Hashable, GenerationEvent | Any]]
    ) -> bool:
        """Resume one row until it yields to the batch; True when it has ended."""
        if row.error is not None:  # reported as the row itself raises it (``_close``)
            out.append((key, _close(row, row.error)))
            return True
        send, row.result, row.need, row.paused = row.result, None, None, False
        try:
            while True:
                item = row.steps.send(send)
                send = None
                if isinstance(item, GenerationEvent):
                    out.append((key, item))
                    if item.finish_reason is not None:
                        _close(row)
                        return True
                    row.paused = True
                    return False
                elif isinstance(item, CycleNeed):
                    row.need, row.decoding = item, True
                    return False
                else:  # a prefill chunk ran
                    return False
        except StopIteration:
            _close(row)
            return True
        except Exception as exc:  # this row only: the others go on
            if not isinstance(exc, RequestError):  # a request's own mistake is no fault
                log.exception("a batch row failed")
            out.append((key, exc))
            _close(row)
            return True

    def _run_cycles(self) -> None:
        waiting = [row for row in self.rows.values() if row.need is not None]
        if not waiting:
            return
        autos = [row for row in waiting if row.need.auto]
        batch_k = None
        # rows whose next K was chosen when the batch looked ahead are not chosen for again
        if len(autos) > 1 and any(row.ahead is None and row.decided_k is None for row in autos):
            estimates = [row.need.chooser.estimates() for row in autos]
            batch_k = self.batch_k.choose(len(autos), estimates)
        groups: dict[int, list[_Row]] = {}
        for row in waiting:
            need = row.need
            if row.ahead is not None:
                k = 0
            elif row.decided_k is not None:
                k = row.decided_k
            elif batch_k is not None and need.auto:
                k = min(batch_k, need.max_k)
            else:
                k = need.own_k()
            row.decided_k = None
            if not need.seq.can_draft:
                k = 0
            row.k = k
            groups.setdefault(k, []).append(row)
        passes = ([groups.pop(0)] if 0 in groups else []) + self._passes(groups)
        engine = self.engine
        whole = len(passes) == 1 and len(waiting) == len(self.rows)
        keys = tuple(self.rows)
        previous, self._read_at = self._read_at, None
        for rows in passes:
            ks = [row.k for row in rows]
            k = max(ks)
            try:
                fresh = [row for row in rows if row.ahead is None]
                seqs = [row.need.seq for row in fresh]
                launched = iter(
                    launch_cycles(
                        engine.trunk,
                        engine.head,
                        seqs,
                        k,
                        engine.profile,
                        ks=[row.k for row in fresh] if k else None,
                    )
                    if seqs
                    else []
                )
                current = [next(launched) if row.ahead is None else row.ahead for row in rows]
                for row in rows:
                    row.ahead = row.undo = None
                committed = k == 0 and whole and self._look_ahead(rows, current)
                if k > 0 and whole and all(self._drafts_next(row) for row in rows):
                    launch_heads_ahead(engine.trunk, engine.head, seqs, current)
                results = read_cycles(current)
            except Exception as exc:  # these rows' caches are mid-cycle: they end here
                log.exception("a batched cycle of %d rows failed", len(rows))
                for row in rows:
                    row.error = exc
                continue
            read_at = time.perf_counter()
            # the period since the last read-back, when that cycle held these same rows
            period = read_at - previous[1] if previous and previous[0] == keys else None
            if whole:
                self._read_at = (keys, read_at)
            settled = all(row.cycles >= SETTLING_CYCLES for row in rows)
            alike = min(ks) == k  # a pass of several K prices none of them
            if len(rows) > 1 and settled and whole and alike and period is not None:
                self.batch_k.observe(len(rows), k, period)
            elif len(rows) > 1 and settled:
                self.batch_k.count(len(rows))
            for row, result in zip(rows, results, strict=True):
                result.rows = len(rows)
                result.committed = committed
                result.followed = row.ahead is not None
                row.result = result
                row.cycles += 1

    def _passes(self, groups: dict[int, list[_Row]]) -> list[list[_Row]]:
        """The drafting rows (``groups``: by K) in passes: a pass of several K runs each row
        at its own (``launch_cycles``' ks), the rows of lower K fed padding up to the pass's
        K. Down from the highest K, a K's rows join the pass above when their padding costs
        less than the pass they would run alone, by the auto K cost table (a verify position
        of one row costs ``p``, the slope of the table's verify forwards over T; a pass itself
        ``trunk[0] - p``, reading the weights and the dispatch; each draft step of its own a
        head step), and when it adds no more positions than the pass verifies for its rows
        (a row's positions cost more in a batch than the one-row table's slope: an 8-row plain
        demo cycle 0.4 ms a row more). Without a table each K runs its own pass. At the 0.8B
        shape in bf16 two rows of K=1 and K=3 in one pass ran 1.21x the two passes; seven demo
        rows of K=1 padded to a row of K=4 ran 0.72-0.75x (docs/CPU_CHOICES.md)."""
        table = self._cost_table()
        if table is None or len(table.trunk) < 2:
            return list(groups.values())
        per_position = (table.trunk[-1] - table.trunk[0]) / (len(table.trunk) - 1)
        own_pass = table.trunk[0] - per_position
        passes: list[list[_Row]] = []
        for k in sorted(groups, reverse=True):
            rows = groups[k]
            if passes:
                depth = passes[-1][0].k
                padded = len(rows) * (depth - k)
                verified = sum(row.k + 1 for row in passes[-1]) + len(rows) * (k + 1)
                cheaper = per_position * padded < own_pass + k * table.head_step
                if cheaper and padded <= verified:
                    passes[-1].extend(rows)
                    continue
            passes.append(list(rows))
        return passes

    def _cost_table(self) -> Any:
        """The engine's auto K cost table (any decoding kind's: what a verify position and a
        head step cost here), or None before auto K has one."""
        autok = self.engine.autok
        kinds = autok.kinds if autok is not None else {}
        return next(iter(kinds.values())).costs if kinds else None

    def _look_ahead(self, rows: list[_Row], current: list[LaunchedCycle]) -> bool:
        """Commit a plain cycle of the whole batch unread and, if every row's next cycle is
        plain too, launch it now. Returns whether the rows were committed; ``_Row.ahead`` holds
        what was launched."""
        needs = [row.need for row in rows]
        autos = sum(need.auto for need in needs)
        if self.engine.profile:
            return False
        # a row's last token, or one under a grammar (its next mask needs the token), is read
        if any(need.max_k < 1 or need.seq.constraint is not None for need in needs):
            return False
        for need, cycle in zip(needs, current, strict=True):
            commit_unread(need.seq, cycle)
            if need.chooser is not None:  # what the row tells it after reading (``row_steps``)
                need.chooser.observe(0, 0)
        batch_k = None
        if autos > 1:
            estimates = [need.chooser.estimates() for need in needs if need.auto]
            batch_k = self.batch_k.choose(autos, estimates)
        for row, need in zip(rows, needs, strict=True):
            shared = batch_k is not None and need.auto
            row.decided_k = min(batch_k, need.max_k) if shared else need.own_k(need.max_k)
        if all(row.decided_k == 0 for row in rows):
            seqs = [need.seq for need in needs]
            undo = [CacheSnapshot.of(seq) for seq in seqs]
            ahead = launch_cycles(self.engine.trunk, self.engine.head, seqs, 0)
            for row, seq, cycle, snapshot in zip(rows, seqs, ahead, undo, strict=True):
                row.ahead, row.undo, row.decided_k = cycle, partial(snapshot.restore, seq), None
        return True

    def _drafts_next(self, row: _Row) -> bool:
        """Whether a row drafting now may draft in its next cycle too, whatever this one
        accepts: worth running that cycle's first head step ahead (``launch_heads_ahead``). Not
        when the profile splits a cycle's times (its syncs would count the step) or when the
        next cycle may have too few tokens left to draft."""
        return not self.engine.profile and row.need.max_k >= row.k + 2

    def _release_if_idle(self) -> None:
        if not self.rows:
            release_between_requests()


def _close(row: _Row, failed: BaseException | None = None) -> BaseException | None:
    """End a row's generator; a plain cycle launched ahead for it is undone first, so the
    sequence it leaves (to the conversation cache) holds exactly what it emitted. ``failed``:
    its cycle failed mid-way, which the generator is told so that it keeps nothing; returns
    the error the row ends with (``failed`` itself, or what the row made of it: a sharded
    engine's lost group)."""
    if row.undo is not None:
        row.undo()
        row.ahead = row.undo = None
    if failed is None:
        row.steps.close()
        return None
    try:
        row.steps.throw(failed)
    except StopIteration:
        return failed
    except BaseException as exc:  # the error itself, or the row's own account of it
        return exc
    log.error("a failed row went on instead of ending")
    row.steps.close()
    return failed
