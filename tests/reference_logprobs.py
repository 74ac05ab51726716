"""Logprobs from a plain mlx-lm forward (no engine code): what the engine's and the server's
reported logprobs are checked against (tests/engine/test_logprobs.py,
tests/server/test_server_engine_paths.py)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import numpy as np


@lru_cache(maxsize=4)
def plain_model(model_dir: str):
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(model_dir))
    model.set_dtype(mx.float32)  # what the engine runs on CPUs
    return model


def independent_logprobs(model_dir: str | Path, prompt: list[int], generated: list[int]):
    """log_softmax rows predicting each generated token, float64 ``[len(generated), V]``."""
    model = plain_model(str(model_dir))
    ids = mx.array(prompt + generated)[None]
    logits = np.array(model.language_model(ids)[0].astype(mx.float32)).astype(np.float64)
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)]
    top = rows.max(axis=1, keepdims=True)
    return rows - top - np.log(np.exp(rows - top).sum(axis=1, keepdims=True))
