"""`mtpserve bench` end to end on a tiny checkpoint: every row, file and derived figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bench_writes_table_json_and_plot(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """The default samplers: greedy, Qwen's seeded and Qwen's unseeded."""
    out_dir = tmp_path / "bench"
    run_cli(
        tmp_path,
        ["bench", "--model", str(tiny_checkpoint), "--draft-tokens", "0,2,auto"],
        ["--max-tokens", "12", "--limit", "2", "--repeats", "1"],
        ["--profile-prompts", "1", "--out", str(out_dir)],
    )
    result = json.loads((out_dir / "results.json").read_text())
    assert (out_dir / "speedup.png").stat().st_size > 0
    table = (out_dir / "table.txt").read_text()
    rows = {(r["sampler"], r["config"]): r for r in result["rows"]}
    samplers = ("greedy", "preset:qwen", "unseeded:qwen")
    assert set(rows) == {(s, c) for s in samplers for c in ("mlx_lm", "K=0", "K=2", "auto")}
    for (sampler, config), row in rows.items():
        assert row["completion_tokens"] == 2 * 12, (sampler, config)
        assert row["decode_tps"] > 0 and row["prefill_tps"] > 0
        assert f"{row['decode_tps']:.1f}" in table
        if config == "K=0":
            assert row["speedup"] == 1.0 and row["acceptance"] == 0.0
            assert row["bytes_bound"] == 1.0  # no head step: nothing for speculation to give
        if config == "K=2":
            assert row["proposed"] > 0 and 0.0 <= row["acceptance"] <= 1.0
            assert sum(row["proposed_per_position"]) == row["proposed"]
            assert row["predicted_speedup"] is not None and row["predicted_speedup"] > 0
            split = row["split"]
            assert split["draft"] > 0 and split["verify"] > 0
            assert row["bandwidth_gbps"] > 0
        if config == "mlx_lm":
            assert row["cycles"] == 0 and row["speedup"] > 0
    k2 = rows[("greedy", "K=2")]
    assert k2["tokens_per_cycle"] == k2["completion_tokens"] / k2["cycles"]
    # up to two head steps a cycle (fewer near the token limit), each reading the head's share
    # of a plain step's bytes
    ratio = result["head_bytes_ratio"]
    head_steps = sum(k * n for k, n in enumerate(k2["k_histogram"]))
    assert 0 < ratio < 1 and k2["cycles"] < head_steps <= 2 * k2["cycles"]
    bound = k2["tokens_per_cycle"] / (1 + head_steps / k2["cycles"] * ratio)
    assert k2["bytes_bound"] == pytest.approx(bound)
    assert f"{k2['bytes_bound']:.2f}x" in table
    assert result["head_bytes"] > 0 and result["trunk_bytes"] > result["head_bytes"]
    memory = result["memory"]
    assert memory["trunk_only"]["head_bytes"] == 0 and memory["with_head"]["head_bytes"] > 0
    # each peak holds what its process loaded; the head's weights show in the load. (On a
    # checkpoint this small, decoding's transient buffers, which vary with how far the host runs
    # ahead of the device, outweigh the head: the two generate peaks may come either way.)
    for run in ("trunk_only", "with_head"):
        held = memory[run]["trunk_bytes"] + memory[run]["head_bytes"]
        assert memory[run]["generate_peak"] >= memory[run]["load_peak"] >= held
    head = memory["with_head"]["head_bytes"]
    assert memory["with_head"]["load_peak"] > memory["trunk_only"]["load_peak"] + head // 2
    assert "peak memory (fresh processes" in table
    for sampler in samplers:
        factors = result["auto_calibration"][sampler]
        assert factors["plain"] > 0 and factors["drafting"] > 0 and len(factors["tilt"]) == 4
    # seeded and unseeded sampling share one decoding kind, so one calibration and one table
    assert "auto K's in-run calibration (greedy)" in table
    assert "auto K's in-run calibration (preset:qwen, unseeded:qwen)" in table
    assert result["costs"]["preset:qwen"] == result["costs"]["unseeded:qwen"]


@pytest.mark.fast
def test_sampled_rows_are_seeded_per_prompt_or_unseeded() -> None:
    """The default row set has both sampled rows, and only ``preset:`` requests carry a seed:
    under automatic K a seeded request drafts a fixed K, an unseeded one the live choice."""
    import argparse

    from engine.bench.speed import parse_samplers, register, request_params
    from sampling.params import SamplingOverrides

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    default = parser.parse_args(["bench"]).sampler
    assert default == "greedy,preset:qwen,unseeded:qwen"

    class Engine:
        # a checkpoint whose defaults carry a seed: the unseeded row must still send none
        sampling_defaults = SamplingOverrides(temperature=1.0, seed=5)

    samplers = parse_samplers(default, Engine())
    assert list(samplers) == ["greedy", "preset:qwen", "unseeded:qwen"]
    sent = {name: request_params(name, params, 7) for name, params in samplers.items()}
    assert sent["greedy"].greedy and sent["greedy"] == samplers["greedy"]
    assert sent["preset:qwen"].seed == 7 and not sent["preset:qwen"].greedy
    assert sent["unseeded:qwen"].seed is None and not sent["unseeded:qwen"].greedy
    assert sent["unseeded:qwen"] == samplers["unseeded:qwen"]


def run_cli(tmp_path: Path, *args: list[str]) -> None:
    """``mtpserve ARGS`` in a subprocess with its own cost cache under ``tmp_path``; it must
    succeed."""
    run = subprocess.run(
        [sys.executable, "-m", "mtpserve", *(a for part in args for a in part)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        env={"MTPSERVE_CACHE": str(tmp_path / "cache"), **_env()},
    )
    assert run.returncode == 0, run.stderr


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "MTPSERVE_CACHE"}


@pytest.mark.fast
def test_gap_note_names_the_stage_that_differs_from_the_start_up_table() -> None:
    from engine.api import GenerationStats
    from engine.bench.speed import Row, _gap_note
    from engine.scheduling.costs import CostTable

    costs = CostTable(
        cycle=[0.003, 0.006, 0.008],
        trunk=[0.003, 0.004, 0.0045],
        head_step=0.001,
        absorb=[0.001, 0.0012, 0.0014],
    )
    plain = Row("greedy", "K=0", GenerationStats(cycles=100, generation_seconds=0.3))
    row = Row("greedy", "K=2")
    # the run's verify took 2 ms more than the table's 3-token forward; draft as expected
    expected_draft = 0.5 * 0.0012 + 0.5 * 0.0014 + 0.001  # acceptance 1.0, then 0.5
    row.split = {"draft": expected_draft, "verify": 0.0065}
    note = _gap_note(0.010, costs, 2, row, plain, [1.0, 0.5])
    assert "K=2 cycle 10.0 ms in run" in note and "K=0 step 3.0 ms in run vs 3.0 ms" in note
    assert note.endswith("mostly verify, +2.0 ms")


@pytest.mark.fast
def test_prediction_uses_conditional_per_position_acceptance() -> None:
    """Stats count P(draft i accepted) unconditionally (8 of 10 cycles accepted draft 1, 4 of
    10 draft 2); the cost model multiplies conditional rates: 0.8, then 4 of those 8."""
    from engine.api import GenerationStats
    from engine.bench.speed import conditional_acceptance
    from engine.scheduling.costs import expected_tokens

    stats = GenerationStats(accepted_per_position=[8, 4], proposed_per_position=[10, 10])
    rates = conditional_acceptance(stats)
    assert rates == [0.8, 0.5]
    assert expected_tokens(rates, 2) == 1 + 0.8 + 0.4  # = 1 + (8 + 4) / 10 tokens per cycle


@pytest.mark.fast
def test_auto_choices_are_priced_at_the_fixed_rows_cycles() -> None:
    """Auto ran 10 cycles at K=3 and 2 at K=4; priced at the fixed rows' average cycles (10 ms
    for 3 tokens, 12 ms for 3.4) that is 36.8 tokens in 124 ms, against the best fixed K's
    (K=3's) 300 tok/s. A K auto used without a fixed row leaves nothing to price with."""
    from engine.api import GenerationStats
    from engine.bench.speed import Row, price_auto_choices

    def row(config: str, cycles: int, seconds: float, tokens: int, hist: dict[int, int]) -> Row:
        histogram = [hist.get(k, 0) for k in range(9)]
        stats = GenerationStats(
            completion_tokens=tokens,
            generation_seconds=seconds,
            cycles=cycles,
            k_histogram=histogram,
        )
        return Row("s", config, stats)

    rows = {
        ("s", "K=3"): row("K=3", 100, 1.0, 300, {3: 100}),
        ("s", "K=4"): row("K=4", 100, 1.2, 340, {4: 100}),
        ("s", "auto"): row("auto", 12, 0.2, 40, {3: 10, 4: 2}),
    }
    priced = price_auto_choices(rows, "s")
    assert priced is not None
    assert priced["tps"] == pytest.approx(36.8 / 0.124)
    assert priced["best_fixed"] == "K=3"
    assert priced["of_best_fixed"] == pytest.approx(36.8 / 0.124 / 300)
    assert priced["measured_of_best_fixed"] == pytest.approx(200 / 300)
    rows[("s", "auto")] = row("auto", 12, 0.2, 40, {2: 1, 3: 9, 4: 2})
    assert price_auto_choices(rows, "s") is None


@pytest.mark.fast
def test_the_ratio_to_the_best_fixed_k_comes_with_its_spread_over_the_prompts() -> None:
    """The interval pairs the rows prompt by prompt: a constant ratio has no spread, a ratio
    that varies between prompts brackets the run's ratio, and wider spreads give wider
    intervals; unpaired rows give none."""
    from engine.bench.speed import paired_interval

    assert paired_interval([1.0] * 8, [2.0] * 8) == pytest.approx([0.5, 0.5])
    steady = [1.0, 2.0, 1.5, 1.2, 0.8, 1.1, 1.9, 1.3]
    narrow = paired_interval(steady, [t * (1.1 if i % 2 else 0.9) for i, t in enumerate(steady)])
    wide = paired_interval(steady, [t * (1.4 if i % 2 else 0.6) for i, t in enumerate(steady)])
    assert narrow is not None and wide is not None
    point = sum(steady) / sum(t * (1.1 if i % 2 else 0.9) for i, t in enumerate(steady))
    assert narrow[0] < point < narrow[1]
    assert wide[0] < narrow[0] and narrow[1] < wide[1]
    assert paired_interval([1.0, 2.0], [1.0]) is None


@pytest.mark.fast
def test_auto_is_also_compared_with_a_fixed_k_picked_on_the_other_passes() -> None:
    """Two passes of two prompts: K=3 is faster over pass 0 and K=2 over pass 1, so pass 1 is
    compared with K=3 and pass 0 with K=2 (each pick's own pass never picks it), and the
    held-out seconds add up; one pass, or rows of unequal length, give none."""
    from engine.bench.speed import held_out_ratio

    fixed = {"K=2": [1.0, 1.0, 0.8, 0.8], "K=3": [0.9, 0.9, 1.0, 1.0]}
    auto = [0.9, 0.95, 0.9, 0.95]
    held = held_out_ratio(fixed, auto, passes=2)
    assert held is not None
    assert held["picks"] == ["K=2", "K=3"]
    assert held["of"] == pytest.approx((1.0 + 1.0 + 1.0 + 1.0) / sum(auto))
    # picking on the same pass would have compared auto with the faster K each time
    assert held["of"] > (0.9 + 0.9 + 0.8 + 0.8) / sum(auto)
    assert held_out_ratio(fixed, auto, passes=1) is None
    assert held_out_ratio({"K=2": [1.0, 1.0, 0.8]}, auto, passes=2) is None


@pytest.mark.fast
def test_bench_batch_writes_its_table_and_checks_every_row(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """`mtpserve bench-batch` end to end: every configuration at each concurrency, the ratios,
    the newcomer figures, the files; the command itself exits non-zero if a batched row's
    tokens differ from the same request alone."""
    out_dir = tmp_path / "bench-batch"
    run_cli(
        tmp_path,
        ["bench-batch", "--model", str(tiny_checkpoint), "--concurrency", "1,2"],
        ["--draft-tokens", "2", "--max-tokens", "6", "--repeats", "1"],
        ["--newcomer-tokens", "12", "--out", str(out_dir)],
    )
    result = json.loads((out_dir / "bench_batch.json").read_text())
    assert (out_dir / "bench_batch.png").stat().st_size > 0
    table = (out_dir / "bench_batch.md").read_text()
    names = {"serial K=2", "serial K=auto", "batched K=0", "batched K=2", "batched K=auto"}
    for c, rows in ((1, 1), (2, 2)):
        merged = result["concurrency"][str(c)]
        assert set(merged) == names | {"ratios"}
        for name in names:
            assert merged[name]["tokens"] == 6 * rows, (c, name)
            assert merged[name]["aggregate_tps"] > 0
        assert merged["ratios"]["auto_over_best_batched"] > 0
    newcomer = result["newcomer"]
    assert newcomer["steps_to_first_token"] >= 1 and newcomer["ttft_ms"] > 0
    assert "batched best / one at a time best" in table
