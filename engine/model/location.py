"""Where a model's files are: a local folder as it is, anything else a Hugging Face repo id
fetched into the hub's cache.

No mlx here: ``mtpserve serve`` resolves ``--model`` before it starts the server, so that a
missing folder or an unreachable repo is one line and an exit status, not a traceback out of
the server's start-up, without importing mlx on the server's main thread (the engine's worker
thread owns mlx)."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("mtpserve.loader")


class ModelNotFound(FileNotFoundError):
    """``--model`` names neither a local folder nor a repo the hub (or its cache) has."""


def resolve_model_dir(model: str) -> Path:
    """A local folder as is; anything else is a Hugging Face repo id to download."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.exists() or model.startswith((".", "/", "~")):
        raise ModelNotFound(f"model folder {model!r} does not exist")
    from huggingface_hub import snapshot_download

    log.info("downloading %s from the Hugging Face hub", model)
    try:
        return Path(
            snapshot_download(
                model,
                allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja", "tokenizer.model"],
            )
        )
    except Exception as exc:  # offline, no such repo, no access: the hub's own words
        raise ModelNotFound(f"{model!r} is not a local folder, and the hub: {exc}") from exc
