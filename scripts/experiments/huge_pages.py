"""Plain decoding tokens/s with the weights in transparent huge pages and without: jemalloc as
the ``mtpserve`` command runs it (``thp:always``) against the same with ``MALLOC_CONF=thp:default``
(4 KiB pages where the kernel leaves THP to ``madvise``), each in a fresh process, the two
taking turns round by round::

    python scripts/experiments/huge_pages.py runs/shapes/qwen3.5-0.8B --rounds 3
    python scripts/experiments/huge_pages.py .llamacpp/qwen3.5-0.8B-mlx-4bit --rounds 3

Each process loads the checkpoint as stored, warms up, then times ``--tokens`` greedy plain
steps ``--reps`` times (best of them) and reports the MB of its memory in huge pages.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {"huge pages": {}, "4 KiB pages": {"MALLOC_CONF": "thp:default"}}


def measure(model: str, tokens: int, reps: int) -> dict[str, float]:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "scripts"))
    from compare_llamacpp import mtpserve_plain_tps

    import engine  # noqa: F401  (the fast BLAS before mlx)
    from engine.runtime import Engine

    ours = Engine.load(model, draft_tokens=0)
    mtpserve_plain_tps(ours, 4)  # warm-up: the first steps compile
    best = max(mtpserve_plain_tps(ours, tokens) for _ in range(reps))
    rollup = Path("/proc/self/smaps_rollup").read_text()
    huge_kb = int(re.search(r"AnonHugePages:\s+(\d+)", rollup).group(1))
    return {"tokens_per_s": best, "huge_mb": huge_kb / 1024}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.model, args.tokens, args.reps)))
        return 0
    cmd = [sys.executable, __file__, args.model, "--child", "--tokens", str(args.tokens)]
    cmd += ["--reps", str(args.reps)]
    for r in range(args.rounds):
        for name, env in SETTINGS.items():
            out = subprocess.run(
                cmd, env={**os.environ, **env}, check=True, text=True, capture_output=True
            ).stdout
            got = json.loads(out.strip().splitlines()[-1])
            print(
                f"round {r + 1}, {name}: {got['tokens_per_s']:.2f} tok/s, "
                f"{got['huge_mb']:.0f} MB in huge pages",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from engine.allocator import reexec_under_jemalloc

    reexec_under_jemalloc()  # as the mtpserve command runs (MALLOC_CONF reaches jemalloc)
    raise SystemExit(main())
