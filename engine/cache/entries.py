"""The conversation cache's entries: the trie of KV blocks keyed by their tokens (``Block``), the
snapshots of the GDN and head states hung on it (``Snapshot``), and the digests that name them."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np


@dataclass(eq=False)
class Block:
    tokens: tuple[int, ...]
    parent: Block | None
    digest: str
    children: dict[tuple[int, ...], Block] = field(default_factory=dict)
    snapshots: dict[tuple[int, ...], Snapshot] = field(default_factory=dict)
    #: per attention layer (keys, values) [1, nKV, B, hd]; None while only on disk
    kv: list[tuple[mx.array, mx.array]] | None = None
    #: the head's (keys, values) of the pairs whose second token is in this block
    head: tuple[mx.array, mx.array] | None = None
    on_disk: bool = False
    #: snapshot entries (loaded or on disk) at or below this block
    refs: int = 0
    #: loaded snapshots at or below this block
    loaded_refs: int = 0

    @property
    def nbytes(self) -> int:
        if self.kv is None:
            return 0
        arrays = [a for kv in self.kv for a in kv] + (list(self.head) if self.head else [])
        return sum(a.nbytes for a in arrays)

    def path(self) -> list[Block]:
        """Blocks from the first to this one (the root excluded)."""
        out: list[Block] = []
        node: Block | None = self
        while node is not None and node.parent is not None:
            out.append(node)
            node = node.parent
        return out[::-1]


@dataclass(eq=False)
class Snapshot:
    node: Block
    tail: tuple[int, ...]
    position: int
    digest: str
    #: per trunk layer: (keys, values) of the tail for attention, (conv, recurrent) for GDN
    layers: list[tuple[mx.array, mx.array]] | None = None
    head_tail: tuple[mx.array, mx.array] | None = None
    head_pending: mx.array | None = None
    has_head: bool = False
    on_disk: bool = False
    nbytes: int = 0

    @property
    def loaded(self) -> bool:
        return self.layers is not None

    def tokens(self) -> list[int]:
        return [t for b in self.node.path() for t in b.tokens] + list(self.tail)


def ancestors(node: Block) -> list[Block]:
    out = []
    while node.parent is not None:
        node = node.parent
        out.append(node)
    return out


def chain_digest(parent: str, tokens: tuple[int, ...], kind: str = "block") -> str:
    h = hashlib.sha256(f"{parent}|{kind}|".encode())
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.hexdigest()[:32]
