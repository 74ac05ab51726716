"""Apply known-bad mutations to a copy of the repository, one at a time, and report which fast
test catches each (``make mutants``; not part of ``make test``).

Each mutation is a bug the suite once let through (tests/ must fail on every one). For each:
copy the working tree (tracked and untracked, not ignored files) into a temporary folder,
replace one exact snippet, run the tests named for it, and report which failed and how long
each took (from pytest's JUnit XML). A baseline run on the unmutated copy first shows that
those tests pass as the code is. Exit status 0 only when the baseline passes and every
mutation is caught by at least one test that ran in under ``FAST_SECONDS``. A mutation of code
that only one instruction set of the product kernel runs differently (``needs_isa``) is
reported as not applicable on a machine whose kernel runs another.

    python scripts/mutants.py              # all mutations
    python scripts/mutants.py verify-history bonus-from-p_K   # some of them
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAST_SECONDS = 10.0
TIMEOUT = 900


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    why: str
    #: the product kernel's instruction set the mutated code runs on (None: every machine); on
    #: another one the mutation changes nothing a test could see, and is reported as such
    needs_isa: str | None = None


MUTATIONS = [
    Mutation(
        "sampled-rows-share-a-seed",
        "engine/cycle/speculative.py",
        "    seeds = [seq.seed for seq in seqs]\n    emit = keyed_uniform_rows(",
        "    seeds = [seqs[0].seed for seq in seqs]\n    emit = keyed_uniform_rows(",
        (
            "tests/engine/test_batching.py::"
            "test_rows_sharing_a_k_each_draft_from_their_own_head_position",
        ),
        "batched sampled rows accept with the first row's uniforms: each row's text then "
        "depends on its neighbours",
    ),
    Mutation(
        "gdn-replay-keeps-one-less",
        "engine/model/delta_rule.py",
        "return self._replay((last + 1).astype(mx.int32))",
        "return self._replay(last.astype(mx.int32))",
        (
            "tests/unit/test_delta_rule_kernel.py::"
            "test_the_capture_commits_the_state_of_the_kept_positions",
        ),
        "a batched verify's rows commit the GDN state one position short of what they kept",
    ),
    Mutation(
        "verify-history",
        "engine/cycle/speculative.py",
        "history = seq.history.rows(drafts, len(self.ids) + 1) if seq.history else None",
        "history = seq.history.rows(None, len(self.ids) + 1) if seq.history else None",
        (
            "tests/engine/test_speculative_penalties.py::"
            "test_greedy_with_penalties_equals_plain_on_the_demo_model[frequency+bias-code]",
            "tests/engine/test_speculative_penalties.py::"
            "test_greedy_with_penalties_equals_plain_on_the_demo_model[presence+repetition-prose]",
            "tests/engine/test_speculative_penalties.py::"
            "test_greedy_with_penalties_equals_plain_on_test_checkpoints",
            "tests/engine/test_speculative_penalties.py::"
            "test_sampled_with_strong_penalties_matches_plain",
        ),
        "the verify pass scores every position with the committed history only",
    ),
    Mutation(
        "logprobs-reversed",
        "engine/request_progress.py",
        "return token_logprobs(result.verify_logits[: len(emitted)], emitted, top)",
        "return token_logprobs(result.verify_logits[: len(emitted)][::-1], emitted, top)",
        ("tests/engine/test_logprobs.py::test_engine_logprobs_equal_an_independent_forward",),
        "an emitted token's logprob is read from another position's row",
    ),
    Mutation(
        "prompt-scores-shifted",
        "engine/runtime.py",
        "token_logprobs(logits, ids[position + 1 : position + 1 + len(logits)], top)",
        "token_logprobs(logits, ids[position : position + len(logits)], top)",
        (
            "tests/engine/test_prefix_cache.py::test_a_scored_prompt_restores_nothing_and_equals_a_cold_run",
            "tests/server/test_server_engine_paths.py::test_completions_echo_with_logprobs_scores_the_prompt_as_evaluation_harnesses_read_it",
        ),
        "a prompt token scored by its own position's logits instead of the one before",
    ),
    Mutation(
        "scored-prompt-restores",
        "engine/runtime.py",
        "        elif cache is not None:\n            restored = cache.guarded(",
        "        if cache is not None:\n            restored = cache.guarded(",
        (
            "tests/engine/test_prefix_cache.py::test_a_scored_prompt_restores_nothing_and_equals_a_cold_run",
        ),
        "a scored prompt restores a cached prefix, whose positions have no logits",
    ),
    Mutation(
        "logprobs-unnormalised",
        "engine/request_progress.py",
        "logp = logp - mx.logsumexp(logp, axis=-1, keepdims=True)",
        "logp = logp",
        ("tests/engine/test_logprobs.py::test_engine_logprobs_equal_an_independent_forward",),
        "raw logits reported as logprobs",
    ),
    Mutation(
        "bonus-from-p_K",
        "sampling/acceptance.py",
        "candidates = mx.concatenate([residual, p[k:]], axis=0)",
        "candidates = mx.concatenate([residual, p[k - 1 : k]], axis=0)",
        (
            "tests/engine/test_acceptance_exact.py::"
            "test_emitted_tuple_is_distributed_as_plain_sampling",
        ),
        "the bonus token is drawn from the last draft's row instead of p_{K+1}",
    ),
    Mutation(
        "bonus-untruncated",
        "engine/cycle/speculative.py",
        "        return accept_drafts_with(drafts, self.q, p_all, accept, emit)\n",
        "        n_acc, next_token = accept_drafts_with(drafts, self.q, p_all, accept, emit)\n"
        "        untruncated = mx.random.categorical(\n"
        "            logits[-1].astype(mx.float32) / params.temperature\n"
        "        ).astype(mx.int32)\n"
        "        return n_acc, mx.where(n_acc == len(self.ids), untruncated, next_token)\n",
        (
            "tests/engine/test_acceptance_exact.py::"
            "test_bonus_and_every_draw_respect_top_k_on_a_flat_model",
        ),
        "the bonus token is drawn from softmax(logits / T), skipping top-k/top-p/min-p",
    ),
    Mutation(
        "autok-no-catch-up",
        "engine/scheduling/costs.py",
        "return self.cycle[k] + catch_up - catch_ups[0]",
        "return self.cycle[k]",
        ("tests/unit/test_autok_replay.py::test_exact_timings_leave_the_table_uncalibrated",),
        "CostTable.expected_seconds forgets the head's catch-up over what the last cycle kept",
    ),
    Mutation(
        "autok-sampled-kind-from-first-request",
        "engine/scheduling/autok.py",
        'plan = self.known_seeded_plan() if kind == "sampled" else None',
        "plan = None",
        (
            "tests/unit/test_autok_replay.py::"
            "test_the_sampled_kind_starts_from_the_seeded_plan_not_from_its_first_request",
        ),
        "the sampled kind explores on its first request, whose luck becomes every later prior",
    ),
    Mutation(
        "batch-k-plain-untimed",
        "engine/scheduling/batching.py",
        "settled and whole and alike and period is not None:",
        "settled and whole and alike and period is not None and not committed:",
        (
            "tests/engine/test_batching.py::"
            "test_automatic_rows_run_plain_stretches_ahead_and_still_retime",
        ),
        "BatchK leaves plain cycles launched ahead untimed: K=0 priced without its overlap",
    ),
    Mutation(
        "budget-past-its-token",
        "engine/request_progress.py",
        "        return min(remaining, self.reasoning_left + 1)",
        "        return min(remaining, self.reasoning_left + 2)",
        (
            "tests/engine/test_reasoning_budget.py::"
            "test_the_budgets_token_ends_the_reasoning_and_the_rest_is_exact",
        ),
        "a cycle may run past the thinking budget's token, which then cannot be replaced",
    ),
    Mutation(
        "format-hides-tools",
        "sampling/constraint.py",
        '        reply = "(calls | answer)"',
        '        reply = "answer"',
        (
            "tests/engine/test_constraint.py::"
            "test_tools_beside_an_output_schema_allow_their_calls_or_the_json_answer",
        ),
        "an output format beside tools allows the JSON alone: an agent cannot call its tools",
    ),
    Mutation(
        "prompt-blocks-shared",
        "engine/model/trunk.py",
        "    key = (kind, products.in_prompt())",
        "    key = (kind, False)",
        (
            "tests/engine/test_convert.py::"
            "test_a_quantized_prompt_leaves_the_same_caches_however_its_chunks_split",
        ),
        "a prompt's short chunks reuse decoding's compiled blocks, traced without the prompt flag",
        needs_isa="avx512-amx",  # only the AMX kernel runs a prompt's products another way
    ),
    Mutation(
        "interleaved-embedding-rows-row-major",
        "engine/model/products.py",
        "    if type(table) not in _LAID_OUT:\n        return arrays[0][index]",
        "    if True:\n        return arrays[0][index]",
        ("tests/unit/test_products.py::test_quantized_layers_laid_out_for_the_kernel",),
        "an embedding laid out 16 rows to a vector looks its rows up as if row-major: every "
        "token embeds as another row's codes",
    ),
    Mutation(
        "padded-row-keeps-its-own-depth",
        "engine/cycle/speculative.py",
        "    _keep_positions(seq, result.verify_hidden, result.depth, n_keep, complete)",
        "    _keep_positions(seq, result.verify_hidden, len(result.draft_ids), n_keep, complete)",
        (
            "tests/engine/test_batching.py::"
            "test_rows_of_several_k_in_one_pass_equal_each_request_alone",
        ),
        "a row padded in a pass of a higher K commits as if the pass had verified its own K",
    ),
    Mutation(
        "tape-keyed-by-types-alone",
        "engine/model/tape.py",
        "key = tuple((tuple(a.shape), a.dtype) for a in args)",
        "key = tuple(a.dtype for a in args)",
        ("tests/unit/test_tape.py::test_a_block_of_another_shape_is_traced_anew",),
        "a block traced at one shape runs its tape at another: the outputs keep the traced "
        "shapes and the work reads past its arguments",
    ),
    Mutation(
        "seeded-plan-prices-drafting-at-the-median",
        "engine/scheduling/autok.py",
        "    return max(1.0, relative[(3 * len(relative)) // 4])",
        "    return 1.0",
        (
            "tests/unit/test_autok.py::"
            "test_a_plans_drafting_cycles_are_priced_at_the_upper_quartile_of_their_rounds",
        ),
        "a seeded plan drafts on a noisy second's timings: every seeded request on the build "
        "and machine then drafts where plain decoding was faster",
    ),
    Mutation(
        "a-stretchs-early-cycles-price-it-in-full",
        "engine/scheduling/autok.py",
        "            k, before if k > 0 else 1, seconds, at_most=self.stretch <= SETTLE_CYCLES",
        "            k, before if k > 0 else 1, seconds, at_most=False",
        ("tests/unit/test_autok.py::test_a_stretchs_first_cycles_only_bound_its_price_from_above",),
        "a probe's second cycle, dear with the switch's warm-up, prices drafting: a mostly-plain "
        "run then keeps drafting overpriced and decodes plain where drafting pays",
    ),
    Mutation(
        "drafting-priced-apart-from-the-machines-speed",
        "engine/scheduling/autok.py",
        "        return [math.exp(self.machine), math.exp(self.machine + self.ratio)]",
        "        return [math.exp(self.machine), math.exp(self.ratio)]",
        (
            "tests/unit/test_autok.py::"
            "test_the_calibration_tells_the_machines_speed_from_drafting_over_plain",
        ),
        "a slow spell timed on plain cycles leaves drafting at its old price: auto K drafts "
        "(or decodes plain) on the machine's drift, not on what drafting pays",
    ),
    Mutation(
        "greedy-stops-drafting-at-the-switch-margin",
        "engine/scheduling/autok.py",
        '    "greedy": KindPolicy(PRIOR_WEIGHT, START_MARGIN, GREEDY_STOP_MARGIN),',
        '    "greedy": KindPolicy(PRIOR_WEIGHT, START_MARGIN),',
        (
            "tests/unit/test_autok.py::"
            "test_a_request_stops_drafting_only_when_plain_decoding_is_clearly_faster",
        ),
        "a greedy request stops drafting where plain decoding looks 1% ahead: at today's costs "
        "starting again (a probe, a catch-up, a cold cycle) costs more than that wins",
    ),
    Mutation(
        "a-plain-stretch-delays-a-due-probe",
        "engine/scheduling/autok.py",
        "        if self.plain_left and self.plain_cycles + 1 < self.shared.probe_interval:",
        "        if self.plain_left:",
        (
            "tests/unit/test_autok.py::"
            "test_a_plain_stretch_decides_every_few_cycles_and_probes_on_time",
        ),
        "the cycles a plain stretch runs without weighing the K's swallow a due probe: probes "
        "come late, and a text that turned predictable drafts later",
    ),
    Mutation(
        "plain-decoding-never-re-timed",
        "engine/scheduling/autok.py",
        "        if self.current and self.shared.drafting_since_plain_timed >= RETIME_PLAIN_EVERY:",
        "        if False:",
        ("tests/unit/test_autok.py::test_a_kind_that_only_drafts_re_times_plain_decoding",),
        "a kind that only drafts never times plain cycles again: a start-up table that priced "
        "them over their cost keeps auto drafting where plain decoding is faster",
    ),
    Mutation(
        "drafting-never-re-timed",
        "engine/scheduling/autok.py",
        "                    retimes = self.shared.retimes_drafting()  # (RETIME_DRAFTING_EVERY)",
        "                    retimes = False",
        (
            "tests/unit/test_autok.py::test_a_kind_that_only_decodes_plain_re_times_drafting",
            "tests/unit/test_autok_replay.py"
            "::test_auto_k_re_times_drafting_where_it_only_decodes_plain",
        ),
        "a kind that decodes plain only ever probes two cycles, whose timings can lower "
        "drafting's price but never count in full: a price raised at a switch keeps auto plain "
        "where drafting pays",
    ),
    Mutation(
        "start-up-table-timed-on-tokens-in-no-pattern",
        "engine/scheduling/costs.py",
        "    dummy_ids = [(i % 4 * 7919) % (engine.vocab_size - 1) for i in range(128)]",
        "    dummy_ids = [(i * 7919) % (engine.vocab_size - 1) for i in range(128)]",
        (
            "tests/unit/test_autok.py"
            "::test_the_start_up_table_times_every_k_where_its_drafts_are_accepted",
        ),
        "the start-up table times short drafts where they are rejected and long ones where "
        "they are accepted: a rejection's rollback prices short drafts dearer than they are",
    ),
    Mutation(
        "seeded-plan-mixes-its-rounds-speeds",
        "engine/scheduling/autok.py",
        "    ratios = round_ratios(rounds)",
        "    ratios = round_ratios([[t for timed in rounds for t in timed]])",
        (
            "tests/unit/test_autok.py"
            "::test_a_plans_drafting_cycles_are_priced_against_their_own_rounds_plain_cycles",
        ),
        "the seeded plan prices a drafting K timed in a slow round as dearer than one timed in a "
        "fast round: its line over K tilts with the machine's speed",
    ),
    Mutation(
        "a-fast-models-start-up-table-from-timed-forwards",
        "engine/scheduling/costs.py",
        "    if one < LOOP_TIMED_FORWARD and not thorough:",
        "    if False:",
        ("tests/unit/test_autok.py::test_a_fast_model_is_priced_by_the_decode_loops_own_cycles",),
        "a small model's plain cycle is priced at a synchronous forward, up to 3x its cost in "
        "the loop: auto K never decodes plain, so never learns what plain costs",
    ),
    Mutation(
        "head-ahead-feeds-the-rejected-draft",
        "engine/cycle/speculative.py",
        "tokens = mx.where(positions < accepted[:, None],",
        "tokens = mx.where(positions <= accepted[:, None],",
        (
            "tests/engine/test_head_ahead.py::test_a_step_run_ahead_is_the_catch_up_it_replaces[3-greedy]",
        ),
        "the step run ahead pairs the accepted position with the rejected draft instead of the "
        "token emitted there: the next cycle drafts from a pair no catch-up would have run",
    ),
    Mutation(
        "batch-head-ahead-picks-the-first-rows-position",
        "engine/model/trunk.py",
        "mx.take_along_axis(a, pick.reshape(-1, *([1] * (a.ndim - 1))), axis=1)",
        "mx.take_along_axis(a, mx.broadcast_to(pick[:1], pick.shape).reshape("
        "-1, *([1] * (a.ndim - 1))), axis=1)",
        ("tests/engine/test_head_ahead.py::test_a_batch_step_run_ahead_is_each_rows_catch_up",),
        "every row of a batch's step run ahead returns the output at the first row's accepted "
        "position: the other rows draft from a position that is not their last",
    ),
]


def copy_tree(dest: Path) -> None:
    """The working tree as git sees it (tracked + untracked, minus ignored files), plus the built
    native kernel (ignored: a build output), so the tests run the kernel's paths as users do."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for raw in listed:
        if not raw:
            continue
        rel = Path(os.fsdecode(raw))
        src = ROOT / rel
        if not src.is_file():
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)
    for built in (ROOT / "engine" / "model" / "native").glob("_products*.so"):
        shutil.copy2(built, dest / built.relative_to(ROOT))


def run_tests(tree: Path, tests: tuple[str, ...]) -> dict[str, tuple[str, float]]:
    """test id -> (outcome, seconds of the test's call phase: fixtures such as a loaded model
    are shared by a module's tests and not counted)."""
    report = tree / "junit.xml"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
    cmd += ["-o", "junit_duration_report=call"]  # the test itself, not its module's fixtures
    try:
        subprocess.run(
            [*cmd, *tests], cwd=tree, env=env, capture_output=True, text=True, timeout=TIMEOUT
        )
    except subprocess.TimeoutExpired:
        return {t: ("timeout", float(TIMEOUT)) for t in tests}
    outcomes: dict[str, tuple[str, float]] = {}
    if not report.exists():
        return {t: ("error", 0.0) for t in tests}
    for case in ET.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/") + ".py"
        test_id = f"{module}::{case.get('name')}"
        failed = case.find("failure") is not None or case.find("error") is not None
        skipped = case.find("skipped") is not None
        outcome = "failed" if failed else "skipped" if skipped else "passed"
        outcomes[test_id] = (outcome, float(case.get("time", 0.0)))
    # a test named without its parameters stands for all of them
    picked = {
        case: result
        for case, result in outcomes.items()
        if any(case == t or case.startswith(t + "[") for t in tests)
    }
    missing = [t for t in tests if not any(c == t or c.startswith(t + "[") for c in picked)]
    return picked | {t: ("not run", 0.0) for t in missing}


def kernel_isa() -> str:
    """The instruction set the native product kernel runs here ('' without the kernel)."""
    probe = "from engine.model import products; n = products.native(); print(n.isa() if n else '')"
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--no-baseline", action="store_true")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    unknown = set(args.names) - {m.name for m in MUTATIONS}
    if unknown:
        parser.error(f"unknown mutations: {sorted(unknown)}")
    ok = True
    rows: list[tuple[str, str, str, str]] = []
    with tempfile.TemporaryDirectory(prefix="mtpserve-mutants-") as tmp:
        if not args.no_baseline:
            tree = Path(tmp) / "baseline"
            copy_tree(tree)
            tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
            for test, (outcome, seconds) in run_tests(tree, tests).items():
                rows.append(("(none)", test, outcome, f"{seconds:.1f}"))
                ok &= outcome == "passed"
        isa = kernel_isa() if any(m.needs_isa for m in chosen) else ""
        for mutation in chosen:
            if mutation.needs_isa is not None and mutation.needs_isa != isa:
                here = isa or "no native kernel"
                verdict = f"not applicable: needs {mutation.needs_isa}, this machine runs {here}"
                rows.append((mutation.name, "-", verdict, "-"))
                continue
            tree = Path(tmp) / mutation.name
            copy_tree(tree)
            target = tree / mutation.path
            source = target.read_text()
            if source.count(mutation.old) != 1:
                rows.append((mutation.name, mutation.path, "snippet not found once", "-"))
                ok = False
                continue
            target.write_text(source.replace(mutation.old, mutation.new))
            t0 = time.monotonic()
            results = run_tests(tree, mutation.tests)
            caught_fast = False
            for test, (outcome, seconds) in results.items():
                caught = outcome == "failed"
                caught_fast |= caught and seconds < FAST_SECONDS
                verdict = "CAUGHT" if caught else outcome
                rows.append((mutation.name, test, verdict, f"{seconds:.1f}"))
            if not caught_fast:
                rows.append((mutation.name, "-", "NOT CAUGHT by a test under 10 s", "-"))
                ok = False
            print(f"{mutation.name}: {time.monotonic() - t0:.0f} s", file=sys.stderr)
            shutil.rmtree(tree)
    width = max(len(r[1]) for r in rows)
    print(f"{'mutation':<22} {'test':<{width}} {'result':<10} seconds")
    for name, test, verdict, seconds in rows:
        print(f"{name:<22} {test:<{width}} {verdict:<10} {seconds}")
    print("all mutations caught by a fast test" if ok else "SOME MUTATION WAS NOT CAUGHT")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
