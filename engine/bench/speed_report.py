"""``mtpserve bench``'s report: the table (``table.txt``) and the speed-up plot
(``speedup.png``) of a run's ``results.json``."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def format_table(result: dict[str, Any]) -> str:
    head = (
        f"{'sampler':<14}{'config':<12}{'decode tok/s':>13}{'prefill tok/s':>14}{'speed-up':>9}"
        f"{'predicted':>10}{'bytes bound':>12}{'accept':>8}{'per position':>26}"
        f"{'tok/cycle':>10}{'GB/s':>7}"
        f"{'peak MiB':>9}  split ms (draft/verify/accept/rollback/overhead)"
    )
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        per_pos = ",".join(
            f"{a / p:.2f}"
            for a, p in zip(r["accepted_per_position"], r["proposed_per_position"], strict=False)
            if p
        )
        split = (
            "/".join(
                f"{r['split'].get(n, 0) * 1e3:.1f}"
                for n in ("draft", "verify", "accept", "rollback", "overhead")
            )
            if r["split"]
            else ""
        )
        predicted = f"{r['predicted_speedup']:.2f}x" if r["predicted_speedup"] else ""
        bound = f"{r['bytes_bound']:.2f}x" if r.get("bytes_bound") else ""
        lines.append(
            f"{r['sampler']:<14}{r['config']:<12}{r['decode_tps']:>13.1f}{r['prefill_tps']:>14.0f}"
            f"{r['speedup']:>8.2f}x{predicted:>10}{bound:>12}{r['acceptance']:>8.2f}{per_pos:>26}"
            f"{r['tokens_per_cycle']:>10.2f}{r['bandwidth_gbps']:>7.2f}"
            f"{r['peak_memory_bytes'] / 2**20:>9.1f}  {split}"
        )
        if r["gap_note"]:
            lines.append(f"{'':<26}prediction gap: {r['gap_note']}")
    if result.get("memory"):
        plain, head = result["memory"]["trunk_only"], result["memory"]["with_head"]
        lines.append(
            f"peak memory (fresh processes, 64 greedy tokens): trunk only: load "
            f"{plain['load_peak'] / 2**20:.1f} MiB, generate {plain['generate_peak'] / 2**20:.1f} "
            f"MiB; with head: load {head['load_peak'] / 2**20:.1f} MiB, generate "
            f"{head['generate_peak'] / 2**20:.1f} MiB (head weights "
            f"{head['head_bytes'] / 2**20:.1f} MiB)"
        )
    lines.append(
        f"weights read per trunk pass {result['trunk_bytes'] / 2**20:.1f} MiB, head "
        f"{result['head_bytes'] / 2**20:.1f} MiB (+{result['draft_vocab_bytes'] / 2**20:.1f} MiB "
        f"for a draft vocabulary of {result['draft_vocab_size']}): a head step reads "
        f"{result.get('head_bytes_ratio', 0):.3f}x a trunk pass's bytes (the bytes bound's ratio);"
        f" BLAS: {result['blas']}; malloc: {result['malloc']}"
    )
    # one calibration per decoding kind: seeded and unseeded samplers share theirs
    kinds: dict[str, list[str]] = {}
    for name, factors in result.get("auto_calibration", {}).items():
        kinds.setdefault(factors.get("kind", name), []).append(name)
    for names in kinds.values():
        factors = result["auto_calibration"][names[0]]
        tilts = "/".join(f"{t:.3f}" for t in factors["tilt"])
        lines.append(
            f"auto K's in-run calibration ({', '.join(names)}): plain cycles "
            f"x{factors['plain']:.2f}, "
            f"drafting cycles x{factors['drafting']:.2f} the start-up table "
            f"(times x{tilts} for K=1..{len(factors['tilt'])})"
        )
    for name, priced in result.get("auto_priced", {}).items():
        lines.append(
            f"auto K ({name}): its choices priced at the fixed-K rows' cycles "
            f"{priced['tps']:.1f} tok/s = {priced['of_best_fixed']:.3f}x the best fixed K "
            f"({priced['best_fixed']}); measured {priced['measured_of_best_fixed']:.3f}x"
            + (
                f" (90% interval over the prompts {interval[0]:.3f}-{interval[1]:.3f}x)"
                if (interval := priced.get("measured_interval"))
                else ""
            )
            + (
                f"; {held['of']:.3f}x a fixed K picked on the other passes "
                f"({'/'.join(held['picks'])})"
                if (held := priced.get("held_out"))
                else ""
            )
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    samplers = sorted({r["sampler"] for r in result["rows"]})
    for s in samplers:
        rows = [
            r
            for r in result["rows"]
            if r["sampler"] == s and r["config"].startswith("K=") and "," not in r["config"]
        ]
        ks = [int(r["config"][2:]) for r in rows]
        ax1.plot(ks, [r["speedup"] for r in rows], "o-", label=f"{s} measured")
        ax1.plot(ks, [r["predicted_speedup"] or 1.0 for r in rows], "x--", label=f"{s} predicted")
        auto = [r for r in result["rows"] if r["sampler"] == s and r["config"] == "auto"]
        if auto:
            ax1.axhline(auto[0]["speedup"], linestyle=":", label=f"{s} auto")
        ax2.plot(ks[1:], [r["acceptance"] for r in rows[1:]], "o-", label=s)
    ax1.axhline(1.0, color="grey", linewidth=0.8)
    ax1.set(xlabel="draft tokens K", ylabel="decode speed-up vs K=0", title="Speed-up")
    ax2.set(xlabel="draft tokens K", ylabel="acceptance", title="Draft acceptance", ylim=(0, 1))
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
