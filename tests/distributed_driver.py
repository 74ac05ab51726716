"""Run by tests/e2e/test_distributed.py under ``mlx.launch``: rank 0 generates every case of a spec
for each model with the sharded engine and writes the token ids; the other ranks follow.

``python tests/distributed_driver.py SPEC.json OUT.json [--auto]`` with SPEC
``{"models": [folder, ...], "cases": [{"prompt_ids", "k", "max_tokens", "temperature",
"top_k", "seed"}, ...]}``; OUT gets, per folder, each case's tokens and counts, and the ranks'
memory. ``--auto`` loads the engine with automatic K as its default.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from engine.blas import use_fast_blas

use_fast_blas()  # before mlx is imported

from mlx.utils import tree_flatten  # noqa: E402

from engine import distributed  # noqa: E402
from engine.api import GenerationRequest  # noqa: E402
from sampling.params import SamplingParams  # noqa: E402


def generate(engine: distributed.DistributedEngine, case: dict) -> dict:
    params = SamplingParams(
        temperature=case["temperature"], top_k=case.get("top_k", 0), seed=case.get("seed")
    )
    request = GenerationRequest(
        case["prompt_ids"], params, case["max_tokens"], draft_tokens=case["k"], ignore_eos=True
    )
    tokens: list[int] = []
    for event in engine.generate(request):
        tokens += event.token_ids
    s = event.stats
    return {
        "tokens": tokens,
        "proposed": s.proposed,
        "accepted": s.accepted,
        "k_histogram": s.k_histogram,
    }


def head_bytes(engine: distributed.DistributedEngine) -> int:
    """The MTP head's weights: all that rank 0 holds beyond its shard."""
    return sum(a.nbytes for _, a in tree_flatten(engine.trunk.mtp.parameters()))


def main(spec_path: str, out_path: str, auto: bool) -> int:
    spec = json.loads(Path(spec_path).read_text())
    results: dict[str, object] = {}
    for model in spec["models"]:
        if distributed.rank() != 0:
            status = distributed.run_follower(model)
            if status:
                return status
            continue
        engine = distributed.DistributedEngine.load(model, draft_tokens=None if auto else 0)
        results[model] = [generate(engine, case) for case in spec["cases"]]
        results[model + ":memory"] = engine.leader.memory_per_rank()
        results[model + ":head"] = head_bytes(engine)
        # a draft vocabulary: its projection rows are gathered from every rank's part
        engine.set_draft_vocab(spec["draft_vocab"])
        cases = spec["draft_vocab_cases"]
        results[model + ":draft_vocab"] = [generate(engine, case) for case in cases]
        engine.shutdown()
    if distributed.rank() == 0:
        Path(out_path).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], auto="--auto" in sys.argv))
