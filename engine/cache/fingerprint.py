"""The model fingerprint every conversation-cache file carries: the format, config.json and the
content of every weight file, its per-file digests remembered between restarts."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from engine.cache.cache_file import FORMAT_VERSION

log = logging.getLogger("mtpserve.prefix_cache")


def model_fingerprint(
    model_dir: Path, extra: str = "", memo_dir: Path | None = None, files: list[Path] | None = None
) -> str:
    """What a disk snapshot must match: the format, ``extra``, config.json and the content of
    every weight file (the model folder's ``*.safetensors`` and ``files``): a fine-tune of the
    same shape copied over the old files changes it. Hashing the weights reads them once;
    with ``memo_dir`` each file's digest is remembered there by its size, modification and
    change times and inode, so a restart on unchanged files reads nothing (any write to a
    file changes its change time, which no tool can set back)."""
    h = hashlib.sha256(f"mtpserve-prefix-cache-v{FORMAT_VERSION}|{extra}|".encode())
    config = model_dir / "config.json"
    if config.exists():
        h.update(config.read_bytes())
    memo_path = memo_dir / "weights-digests.json" if memo_dir is not None else None
    memo: dict[str, str] = {}
    if memo_path is not None:
        try:
            memo = json.loads(memo_path.read_text())
        except (OSError, ValueError):
            memo = {}
    fresh: dict[str, str] = {}
    for path in [*sorted(model_dir.glob("*.safetensors")), *(files or [])]:
        st = path.stat()
        key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}"
        digest = memo.get(key) or _file_digest(path)
        fresh[key] = digest
        h.update(f"{path.name}:{digest}|".encode())
    if memo_path is not None and fresh.items() - memo.items():
        try:
            _replace_text(memo_path, json.dumps(memo | fresh))
        except OSError as exc:  # the memo only saves time
            log.warning("prompt cache: could not write %s: %s", memo_path, exc)
    return h.hexdigest()[:32]


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _replace_text(path: Path, text: str) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
