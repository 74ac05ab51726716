"""Peak memory, measured in a fresh process per measurement (mlx's peak counter is per
process, so peaks never mix).

``python -m engine.bench.memory MODEL 0|1`` prints one JSON object: mlx's peak-memory counter
after loading, and during 64 greedy tokens (K=2 with the head, K=0 without), plus the trunk's
and the head's weight bytes; ``measure`` runs it and returns the object.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def measure(model: str | Path, with_head: bool, dtype: str = "auto") -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "engine.bench.memory", str(model), "1" if with_head else "0", dtype],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        timeout=600,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _probe(model: str, with_head: bool, dtype: str) -> dict[str, Any]:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from transformers import AutoTokenizer

    from engine.api import GenerationRequest
    from engine.model import loader
    from engine.runtime import Engine
    from sampling.params import SamplingParams

    mx.reset_peak_memory()
    loaded = loader.load(model, with_head=with_head, dtype=dtype)
    load_peak = mx.get_peak_memory()
    params = tree_flatten(loaded.trunk.parameters())
    dtype = str(loaded.trunk.model.embed_tokens.weight.dtype).removeprefix("mlx.core.")
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
        "dtype": dtype,
    }


if __name__ == "__main__":  # `python -m` imports the engine package first: the fast BLAS is loaded
    print(json.dumps(_probe(sys.argv[1], sys.argv[2] == "1", sys.argv[3])))
