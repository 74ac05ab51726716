"""Measure peak memory of loading and generating, in a fresh process (run by test_memory.py).

Usage: peak_memory.py MODEL_DIR WITH_HEAD(0|1). Prints one JSON object.
"""

import json
import sys

from engine.blas import use_fast_blas

use_fast_blas()

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from engine import loader  # noqa: E402
from engine.api import GenerationRequest  # noqa: E402
from engine.runtime import Engine  # noqa: E402
from sampling.params import SamplingParams  # noqa: E402

model_dir, with_head = sys.argv[1], sys.argv[2] == "1"
mx.reset_peak_memory()
loaded = loader.load(model_dir, with_head=with_head)
load_peak = mx.get_peak_memory()
params = tree_flatten(loaded.trunk.parameters())
trunk_bytes = sum(a.nbytes for n, a in params if not n.startswith("mtp."))
head_bytes = sum(a.nbytes for n, a in params if n.startswith("mtp."))
k = 2 if with_head else 0
engine = Engine(loaded, AutoTokenizer.from_pretrained(model_dir), "m", default_draft_tokens=k)
request = GenerationRequest(
    list(range(3, 200)), SamplingParams(temperature=0.0), 64, draft_tokens=k, ignore_eos=True
)
mx.reset_peak_memory()
for event in engine.generate(request):
    pass
print(
    json.dumps(
        {
            "load_peak": load_peak,
            "generate_peak": mx.get_peak_memory(),
            "trunk_bytes": trunk_bytes,
            "head_bytes": head_bytes,
            "proposed": event.stats.proposed,
        }
    )
)
