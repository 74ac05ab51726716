"""The format of one conversation-cache file: a magic, a JSON header (format version, model
fingerprint, key, each array's place) and the arrays' bytes under a checksum; encoding and
checked reading."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

FORMAT_VERSION = 1
_MAGIC = b"MTPSPC01"
_DTYPES = {
    mx.float32: "float32",
    mx.float16: "float16",
    mx.bfloat16: "bfloat16",
}


def _to_bytes(a: mx.array) -> tuple[str, list[int], bytes]:
    dtype = _DTYPES.get(a.dtype)
    if dtype is None:
        raise ValueError(f"cannot store dtype {a.dtype}")
    raw = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
    return dtype, list(a.shape), np.array(raw).tobytes()


def encode_file(header: dict[str, Any], arrays: dict[str, mx.array]) -> bytes:
    """A cache file's bytes (copied out of the arrays on the engine's thread)."""
    payload, entries, offset = [], {}, 0
    for name, a in arrays.items():
        dtype, shape, raw = _to_bytes(a)
        entries[name] = {"dtype": dtype, "shape": shape, "offset": offset, "size": len(raw)}
        payload.append(raw)
        offset += len(raw)
    body = b"".join(payload)
    full = dict(header, format=FORMAT_VERSION, arrays=entries)
    full["sha256"] = hashlib.sha256(body).hexdigest()
    head = json.dumps(full).encode()
    return _MAGIC + struct.pack("<Q", len(head)) + head + body


def read_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        start = f.read(len(_MAGIC) + 8)
        if len(start) < len(_MAGIC) + 8 or start[: len(_MAGIC)] != _MAGIC:
            raise ValueError("not a prompt-cache file")
        (n,) = struct.unpack("<Q", start[len(_MAGIC) :])
        if n > 1 << 26:
            raise ValueError("header too large")
        header = json.loads(f.read(n))
    if header.get("format") != FORMAT_VERSION:
        raise ValueError(f"format {header.get('format')} (expected {FORMAT_VERSION})")
    return header


def read_file(path: Path, fingerprint: str) -> tuple[dict[str, Any], dict[str, mx.array]]:
    header = read_header(path)
    if header.get("fingerprint") != fingerprint:
        raise ValueError(f"{path.name} belongs to another model")
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[len(_MAGIC) : len(_MAGIC) + 8])
    body = data[len(_MAGIC) + 8 + n :]
    if hashlib.sha256(body).hexdigest() != header.get("sha256"):
        raise ValueError(f"{path.name} fails its checksum")
    arrays = {}
    for name, e in header["arrays"].items():
        raw = body[e["offset"] : e["offset"] + e["size"]]
        if e["dtype"] == "bfloat16":
            a = mx.array(np.frombuffer(raw, dtype=np.uint16).reshape(e["shape"])).view(mx.bfloat16)
        else:
            a = mx.array(np.frombuffer(raw, dtype=e["dtype"]).reshape(e["shape"]))
        arrays[name] = a
    mx.eval(list(arrays.values()))
    os.utime(path)  # the disk budget evicts the least recently used files first
    return header, arrays
