"""Peak memory of loading and generating, with or without the MTP head, each in a fresh process.

``python -m engine.memory MODEL 0|1`` prints one JSON object (run by ``measure`` below, which the
bench and tests/test_memory.py use): mlx's peak-memory counter after loading, and during 64
greedy tokens (K=2 with the head, K=0 without), plus the trunk's and the head's weight bytes.
A fresh process per measurement keeps the peaks from mixing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def measure(model: str | Path, with_head: bool) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "engine.memory", str(model), "1" if with_head else "0"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        timeout=600,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _probe(model: str, with_head: bool) -> dict[str, Any]:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from transformers import AutoTokenizer

    from engine import loader
    from engine.api import GenerationRequest
    from engine.runtime import Engine
    from sampling.params import SamplingParams

    mx.reset_peak_memory()
    loaded = loader.load(model, with_head=with_head)
    load_peak = mx.get_peak_memory()
    params = tree_flatten(loaded.trunk.parameters())
    trunk_bytes = sum(a.nbytes for n, a in params if not n.startswith("mtp."))
    head_bytes = sum(a.nbytes for n, a in params if n.startswith("mtp."))
    k = 2 if with_head else 0
    tokenizer = AutoTokenizer.from_pretrained(str(loaded.model_dir))
    engine = Engine(loaded, tokenizer, "m", default_draft_tokens=k)
    request = GenerationRequest(
        list(range(3, 200)), SamplingParams(temperature=0.0), 64, draft_tokens=k, ignore_eos=True
    )
    mx.reset_peak_memory()
    event = None
    for event in engine.generate(request):
        pass
    assert event is not None and event.stats is not None
    return {
        "load_peak": load_peak,
        "generate_peak": mx.get_peak_memory(),
        "trunk_bytes": trunk_bytes,
        "head_bytes": head_bytes,
        "proposed": event.stats.proposed,
    }


if __name__ == "__main__":  # `python -m` imports the engine package first: the fast BLAS is loaded
    print(json.dumps(_probe(sys.argv[1], sys.argv[2] == "1")))
