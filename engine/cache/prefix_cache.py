"""The conversation cache: restore the longest cached prefix of a prompt, prefill only the rest.

Keys are token ids. The state after a prefix of P tokens (the trunk cache holding exactly those
P positions, as the ``Sequence`` invariant has it after prefill: engine.cycle.speculative) is:

* attention KV of every trunk attention layer for positions 0..P-1 — trimmable, so it is kept
  **by block** of ``block_tokens`` positions in a trie keyed by each block's token ids: a prefix
  shared by many prompts (a system prompt) is held once;
* the Gated-DeltaNet conv window and recurrent state of every GDN layer at P — not trimmable,
  so they are kept only at chosen points (**snapshots**): block ends inside a prompt (every
  ``snapshot_stride`` positions), where the prompt's last message begins, the end of every
  prompt, the end of every generation (after its final commit);
* the MTP head's KV for the pairs (h_t, x_{t+1}), t <= P-2, and the pending trunk state
  h_{P-1} (its pair needs x_P, which belongs to the next request). A block holds the head rows
  of the pairs whose x_{t+1} lies in the block, so a block's head rows depend on its own path
  only.

A snapshot is a block path plus a tail of < ``block_tokens`` tokens (their KV and head rows
held privately) plus the GDN states and the pending head state. Restoring builds fresh arrays
(concatenations), so a live sequence never aliases a stored array (mlx's ``__setitem__``
rewrites the array object a KV cache holds). Every stored state is a function of its key
tokens alone — how or why the generation that produced it stopped does not matter — so any
restore gives the state a cold prefill of those tokens gives (up to floating-point rounding of
the different kernels that computed it).

Memory is bounded by ``budget_bytes`` (LRU over snapshots; a block lives while a snapshot
needs it). With ``directory`` set, every stored block and snapshot is also written to disk
(one file each, checked on load: format version, model fingerprint, key, checksum), so a
restarted server can resume a long chat without prefilling it; the disk tier has its own byte
budget, oldest files go first. The files are written, and the budget kept, by a thread of
the cache's own (``DiskWriter``): the engine's thread only copies a state's bytes out, so a
slow or full disk never holds up the rows decoding.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from engine.cycle.speculative import PREFILL_CHUNK, absorb_pending
from engine.model.attention import RowKVCache
from engine.model.gated_deltanet import GDNLayerState

T = TypeVar("T")
log = logging.getLogger("mtpserve.prefix_cache")

#: Positions per KV block and between in-prompt snapshots: the prefill chunk, so that block ends
#: are chunk ends.
DEFAULT_BLOCK_TOKENS = PREFILL_CHUNK
DEFAULT_BUDGET_BYTES = 1 << 30
DEFAULT_DISK_BUDGET_BYTES = 8 << 30
FORMAT_VERSION = 1
_MAGIC = b"MTPSPC01"
_DTYPES = {
    mx.float32: "float32",
    mx.float16: "float16",
    mx.bfloat16: "bfloat16",
}


def _own(x: mx.array) -> mx.array:
    """A copy that does not keep the buffer it was sliced from alive."""
    return mx.contiguous(x)


@dataclass(eq=False)
class _Block:
    tokens: tuple[int, ...]
    parent: _Block | None
    digest: str
    children: dict[tuple[int, ...], _Block] = field(default_factory=dict)
    snapshots: dict[tuple[int, ...], _Snapshot] = field(default_factory=dict)
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

    def path(self) -> list[_Block]:
        """Blocks from the first to this one (the root excluded)."""
        out: list[_Block] = []
        node: _Block | None = self
        while node is not None and node.parent is not None:
            out.append(node)
            node = node.parent
        return out[::-1]


@dataclass(eq=False)
class _Snapshot:
    node: _Block
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


@dataclass
class CacheCounters:
    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0
    evictions: int = 0
    stored: int = 0
    disk_loads: int = 0
    disk_rejected: int = 0
    #: faults (a full disk, an unreadable file, anything unexpected): logged, and the request
    #: went on without the cache
    errors: int = 0


@dataclass
class Restored:
    """What a lookup hands to the engine: the caches at ``position`` (fresh arrays)."""

    position: int
    layers: list[Any]  # KVCache | GDNLayerState per trunk layer
    head_cache: KVCache | None
    head_pending: mx.array | None


class PrefixCache:
    def __init__(
        self,
        trunk: Any,
        *,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        directory: str | Path | None = None,
        disk_budget_bytes: int = DEFAULT_DISK_BUDGET_BYTES,
        fingerprint: str = "",
    ) -> None:
        if block_tokens < 2:
            raise ValueError("block_tokens must be at least 2")
        self.budget_bytes = budget_bytes
        self.block_tokens = block_tokens
        self.is_attention = [not layer.is_linear for layer in trunk.layers]
        self.root = _Block((), None, "root")
        self._lru: OrderedDict[int, _Snapshot] = OrderedDict()
        self.bytes_held = 0
        self.counters = CacheCounters()
        self.fingerprint = fingerprint
        self.directory = Path(directory) if directory else None
        self.disk_budget_bytes = disk_budget_bytes
        self._stride: int | None = None
        self._unwritten: list[_Snapshot] = []
        self.writer: DiskWriter | None = None
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._load_index()
            self.writer = DiskWriter(self.directory, self._file_tag, disk_budget_bytes)

    def guarded(self, what: str, work: Callable[..., T], *args: Any) -> T | None:
        """``work(*args)``, or None after logging and counting its fault: the cache is an
        optimisation, and no fault of it may fail a request or the engine's thread."""
        try:
            return work(*args)
        except Exception:
            self.counters.errors += 1
            log.exception("prompt cache: %s failed; going on without it", what)
            return None

    # -- lookup and restore --------------------------------------------------------------------
    def lookup(self, prompt: list[int], need_head: bool) -> Restored | None:
        """The longest usable snapshot of ``prompt[:-1]``, restored into fresh caches."""
        self.counters.lookups += 1
        for snap in self._candidates(prompt, need_head):
            restored = self._restore(snap, need_head)
            if restored is not None:
                self.counters.hits += 1
                self.counters.reused_tokens += restored.position
                return restored
        return None

    def _candidates(self, prompt: list[int], need_head: bool) -> list[_Snapshot]:
        limit = len(prompt) - 1  # the trunk holds at most prompt[:-1]
        B = self.block_tokens
        found: list[_Snapshot] = []
        node, pos, heads = self.root, 0, True
        while True:
            for tail, snap in node.snapshots.items():
                end = pos + len(tail)
                usable = not need_head or (heads and snap.has_head)
                if usable and end <= limit and tuple(prompt[pos:end]) == tail:
                    found.append(snap)
            if pos + B > limit:
                break
            child = node.children.get(tuple(prompt[pos : pos + B]))
            if child is None:
                break
            node, pos = child, pos + B
            heads = heads and (child.head is not None or (child.kv is None and child.on_disk))
        return sorted(found, key=lambda s: -s.position)

    def _restore(self, snap: _Snapshot, need_head: bool) -> Restored | None:
        path = snap.node.path()
        try:
            self._load(snap, path)
        except SnapshotGone:  # nothing wrong with the directory: just not there any more
            self._drop(snap)
            return None
        except (OSError, ValueError, KeyError, struct.error) as exc:
            log.warning("prompt cache: skipping a stored snapshot: %s", exc)
            self.counters.disk_rejected += 1
            self._drop(snap)
            return None
        if need_head and (not snap.has_head or any(b.head is None for b in path)):
            return None
        self._lru.move_to_end(id(snap))
        layers: list[Any] = []
        attn = 0
        for i, is_attn in enumerate(self.is_attention):
            a, b = snap.layers[i]
            if is_attn:
                keys = [blk.kv[attn][0] for blk in path] + [a]
                values = [blk.kv[attn][1] for blk in path] + [b]
                attn += 1
                layers.append(_kv_cache(keys, values, snap.position))
            else:
                layers.append(GDNLayerState(conv=a, recurrent=b))
        head_cache = None
        if need_head:
            keys = [blk.head[0] for blk in path] + [snap.head_tail[0]]
            values = [blk.head[1] for blk in path] + [snap.head_tail[1]]
            head_cache = _kv_cache(keys, values, snap.position - 1)
        return Restored(snap.position, layers, head_cache, snap.head_pending if need_head else None)

    # -- store -----------------------------------------------------------------------------
    def store(self, seq: Any, trunk: Any, head: Any) -> None:
        """Keep the state of ``seq`` at ``P = seq.trunk_cache.length`` as a snapshot.

        ``seq`` must be at a consistent point: the trunk holding ``seq.tokens[:P]`` with nothing
        uncommitted, the head (if any) covering the same positions. Pending head pairs whose
        tokens are known are run first, so the head holds pairs t <= P-2 and h_{P-1} pending,
        as after a cold prefill.
        """
        if self.budget_bytes <= 0:
            return
        P = seq.trunk_cache.length
        if not 1 <= P < len(seq.tokens) or seq.unread_token is not None:
            return
        tokens = seq.tokens[:P]
        head_cache = seq.head_cache
        pending = _pending_one(seq, trunk, head) if head_cache is not None else None
        with_head = (
            pending is not None
            and seq.head_skipped == 0
            and head_cache.offset == P - 1
            and (P == 1 or head_cache.keys is not None)
        )
        B = self.block_tokens
        trunk_layers = seq.trunk_cache.layers
        node = self.root
        new: list[mx.array] = []
        for k in range(P // B):
            key = tuple(tokens[k * B : (k + 1) * B])
            child = node.children.get(key)
            if child is None:
                child = _Block(key, node, _chain(node.digest, key))
                node.children[key] = child
            if child.kv is None:
                lo, hi = k * B, (k + 1) * B
                child.kv = [
                    (_own(c.keys[..., lo:hi, :]), _own(c.values[..., lo:hi, :]))
                    for c in trunk_layers
                    if isinstance(c, KVCache)
                ]
                child.head = None
                new += [a for kv in child.kv for a in kv]
                self.bytes_held += child.nbytes
            if with_head and child.head is None:
                lo, hi = max(k * B - 1, 0), (k + 1) * B - 1
                child.head = (
                    _own(head_cache.keys[..., lo:hi, :]),
                    _own(head_cache.values[..., lo:hi, :]),
                )
                new += list(child.head)
                self.bytes_held += sum(a.nbytes for a in child.head)
            node = child
        start = (P // B) * B
        tail = tuple(tokens[start:])
        snap = node.snapshots.get(tail)
        if snap is not None and snap.loaded and (snap.has_head or not with_head):
            self._lru.move_to_end(id(snap))
            mx.eval(new)
            if self.directory is not None:
                self._write_blocks(node)
            return
        layers: list[tuple[mx.array, mx.array]] = []
        for c in trunk_layers:
            if isinstance(c, KVCache):
                layers.append((_own(c.keys[..., start:P, :]), _own(c.values[..., start:P, :])))
            else:
                # own copies: after a batched cycle a row's states are views of the whole
                # batch's stacked states, which the cache must not keep alive
                layers.append((_own(c.conv), _own(c.recurrent)))
        head_tail = None
        if with_head:
            lo = max(start - 1, 0)
            if head_cache.keys is None:
                empty = mx.zeros((1, 1, 0, 1))
                head_tail = (empty, empty)
            else:
                head_tail = (
                    _own(head_cache.keys[..., lo : P - 1, :]),
                    _own(head_cache.values[..., lo : P - 1, :]),
                )
        if snap is None:
            snap = _Snapshot(node, tail, P, _chain(node.digest, tail, "snapshot"))
            self._add(snap)
        self._fill(snap, layers, head_tail, _own(pending) if with_head else None)
        mx.eval(new + self._arrays(snap))
        self.counters.stored += 1
        if self.directory is not None and snap not in self._unwritten:
            self._unwritten.append(snap)
        self._evict()

    def flush(self) -> None:
        """Hand the snapshots stored since the last flush to the disk tier's writer (the engine
        calls this after a generation's last event)."""
        self._forget_deleted()
        unwritten, self._unwritten = self._unwritten, []
        for snap in unwritten:
            if snap.loaded and snap.node.snapshots.get(snap.tail) is snap:
                self._write(snap)

    @staticmethod
    def _arrays(snap: _Snapshot) -> list[mx.array]:
        out = [a for pair in snap.layers or [] for a in pair]
        if snap.head_tail is not None:
            out += [*snap.head_tail, snap.head_pending]
        return out

    def _fill(
        self,
        snap: _Snapshot,
        layers: list[tuple[mx.array, mx.array]],
        head_tail: tuple[mx.array, mx.array] | None,
        pending: mx.array | None,
    ) -> None:
        """Give an entry its arrays (new, only on disk, or upgraded with the head's)."""
        if snap.loaded:
            self.bytes_held -= snap.nbytes
        else:
            for b in [snap.node, *_ancestors(snap.node)]:
                b.loaded_refs += 1
        snap.layers, snap.head_tail, snap.head_pending = layers, head_tail, pending
        snap.has_head = head_tail is not None
        snap.nbytes = sum(a.nbytes for a in self._arrays(snap))
        self.bytes_held += snap.nbytes
        self._lru[id(snap)] = snap
        self._lru.move_to_end(id(snap))

    def _add(self, snap: _Snapshot) -> None:
        snap.node.snapshots[snap.tail] = snap
        for b in [snap.node, *_ancestors(snap.node)]:
            b.refs += 1

    def _unload(self, snap: _Snapshot) -> None:
        """Free a snapshot's arrays (it stays as an on-disk entry) and blocks nobody needs."""
        if not snap.loaded:
            return
        self._lru.pop(id(snap), None)
        self.bytes_held -= snap.nbytes
        snap.layers, snap.head_tail, snap.head_pending = None, None, None
        for b in [snap.node, *_ancestors(snap.node)]:
            b.loaded_refs -= 1
            if b.loaded_refs == 0 and b.parent is not None and b.kv is not None:
                self.bytes_held -= b.nbytes
                b.kv, b.head = None, None

    def _drop(self, snap: _Snapshot, count: bool = True) -> None:
        """Forget a snapshot entirely (memory and index); blocks nobody needs go with it."""
        self._unload(snap)
        if snap.node.snapshots.get(snap.tail) is snap:
            del snap.node.snapshots[snap.tail]
        for b in [snap.node, *_ancestors(snap.node)]:
            b.refs -= 1
        node = snap.node
        while node.parent is not None and node.refs == 0:
            node.parent.children.pop(node.tokens, None)
            node = node.parent

    def _evict(self, keep: _Snapshot | None = None) -> None:
        """Least recently used snapshots out until within the budget (never ``keep``)."""
        if keep is not None:
            self._lru.move_to_end(id(keep))
        while self.bytes_held > self.budget_bytes and len(self._lru) > (keep is not None):
            _, oldest = next(iter(self._lru.items()))
            self.counters.evictions += 1
            if oldest in self._unwritten:  # the disk tier still gets it
                self._unwritten.remove(oldest)
                self._write(oldest)
            if oldest.on_disk:
                self._unload(oldest)
            else:
                self._drop(oldest)

    def clear(self) -> None:
        """Forget everything held in memory (disk files stay)."""
        for snap in list(self._lru.values()):
            self._drop(snap)

    # -- disk tier --------------------------------------------------------------------------
    # Every file name carries the model's fingerprint, so that models sharing a directory
    # never read, count toward their budget, overwrite or delete each other's files.
    @property
    def _file_tag(self) -> str:
        return self.fingerprint[:16] or "any"

    def _block_file(self, block: _Block) -> Path:
        return self.directory / f"b-{self._file_tag}-{block.digest}.mtpc"

    def _snap_file(self, snap: _Snapshot) -> Path:
        return self.directory / f"s-{self._file_tag}-{snap.digest}.mtpc"

    def _own_files(self, kind: str = "[bs]") -> list[Path]:
        return list(self.directory.glob(f"{kind}-{self._file_tag}-*.mtpc"))

    def _write_blocks(self, node: _Block) -> None:
        """Write ``node``'s blocks not yet on disk; a failure (a full disk) is logged and
        counted, never raised: the disk tier is an optimisation."""
        if self.directory is None:
            return
        try:
            self._write_block_files(node)
        except (OSError, ValueError) as exc:
            self.counters.errors += 1
            log.warning("prompt cache: could not write to %s: %s", self.directory, exc)

    def _write_block_files(self, node: _Block) -> None:
        for block in node.path():
            if not block.on_disk and block.kv is not None:
                arrays = {
                    f"kv{i}_{j}": a for i, kv in enumerate(block.kv) for j, a in enumerate(kv)
                }
                if block.head is not None:
                    arrays |= {"head_0": block.head[0], "head_1": block.head[1]}
                header = {
                    "kind": "block",
                    "tokens": list(block.tokens),
                    "fingerprint": self.fingerprint,
                }
                self.writer.submit(self._block_file(block), _encode_file(header, arrays))
                block.on_disk = True

    def _write(self, snap: _Snapshot) -> None:
        try:
            self._write_block_files(snap.node)
            arrays = {
                f"layer{i}_{j}": a for i, pair in enumerate(snap.layers) for j, a in enumerate(pair)
            }
            if snap.has_head:
                arrays |= {
                    "head_0": snap.head_tail[0],
                    "head_1": snap.head_tail[1],
                    "pending": snap.head_pending,
                }
            header = {
                "kind": "snapshot",
                "fingerprint": self.fingerprint,
                "tokens": snap.tokens(),
                "blocks": [b.digest for b in snap.node.path()],
                "has_head": snap.has_head,
                "block_tokens": self.block_tokens,
            }
            self.writer.submit(self._snap_file(snap), _encode_file(header, arrays))
            snap.on_disk = True
        except (OSError, ValueError) as exc:
            self.counters.errors += 1
            log.warning("prompt cache: could not write to %s: %s", self.directory, exc)

    def _load(self, snap: _Snapshot, path: list[_Block]) -> None:
        """Read a snapshot's missing arrays (and its blocks') from disk; checked. On a
        failure the blocks read for it are let go again, so the byte count holds only what
        some loaded snapshot uses."""
        if self.writer is not None and (not snap.loaded or any(b.kv is None for b in path)):
            self.writer.drain()  # a file it needs may still be on its way to the disk
            self._forget_deleted()
            if not snap.on_disk and not snap.loaded:
                raise SnapshotGone("its file was removed for the disk budget, or never written")
        read: list[_Block] = []
        try:
            for block in path:
                if block.kv is None:
                    header, arrays = _read_file(self._block_file(block), self.fingerprint)
                    if header.get("kind") != "block" or tuple(header["tokens"]) != block.tokens:
                        raise ValueError(f"{self._block_file(block).name} does not hold this block")
                    n_attn = sum(self.is_attention)
                    block.kv = [(arrays[f"kv{i}_0"], arrays[f"kv{i}_1"]) for i in range(n_attn)]
                    block.head = (
                        (arrays["head_0"], arrays["head_1"]) if "head_0" in arrays else None
                    )
                    self.bytes_held += block.nbytes
                    read.append(block)
            if snap.loaded:
                return
            header, arrays = _read_file(self._snap_file(snap), self.fingerprint)
            if header.get("kind") != "snapshot" or header["tokens"] != snap.tokens():
                raise ValueError(f"{self._snap_file(snap).name} does not hold this snapshot")
            layers = [
                (arrays[f"layer{i}_0"], arrays[f"layer{i}_1"])
                for i in range(len(self.is_attention))
            ]
        except BaseException:
            for block in read:
                if block.loaded_refs == 0 and block.kv is not None:
                    self.bytes_held -= block.nbytes
                    block.kv, block.head = None, None
            raise
        if snap.has_head:
            self._fill(snap, layers, (arrays["head_0"], arrays["head_1"]), arrays["pending"])
        else:
            self._fill(snap, layers, None, None)
        self.counters.disk_loads += 1
        self._evict(keep=snap)

    def _load_index(self) -> None:
        """Register every snapshot file of this model found in the directory (headers only)."""
        B = self.block_tokens
        for path in sorted(self._own_files("s"), key=lambda p: p.stat().st_mtime):
            try:
                header = _read_header(path)
            except (OSError, ValueError, KeyError, struct.error) as exc:
                log.warning("prompt cache: skipping %s: %s", path.name, exc)
                continue
            if header.get("fingerprint") != self.fingerprint or header.get("block_tokens") != B:
                log.info("prompt cache: skipping %s (another model or block size)", path.name)
                continue
            tokens = header.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                log.warning("prompt cache: skipping %s (no token key)", path.name)
                continue
            node = self.root
            for k in range(len(tokens) // B):
                key = tuple(tokens[k * B : (k + 1) * B])
                child = node.children.get(key)
                if child is None:
                    child = _Block(key, node, _chain(node.digest, key), on_disk=True)
                    node.children[key] = child
                node = child
            tail = tuple(tokens[(len(tokens) // B) * B :])
            snap = _Snapshot(node, tail, len(tokens), _chain(node.digest, tail, "snapshot"))
            if path.name != self._snap_file(snap).name:
                log.warning("prompt cache: skipping %s (name does not match its key)", path.name)
                continue
            snap.has_head = bool(header.get("has_head"))
            snap.on_disk = True
            if tail not in node.snapshots:
                self._add(snap)

    def _forget_deleted(self) -> None:
        """Take in the files the writer removed to keep the disk budget (engine thread)."""
        if self.writer is None:
            return
        names = self.writer.take_deleted()
        if not names:
            return
        for snap in self._all_snapshots():
            if snap.on_disk and self._snap_file(snap).name in names:
                snap.on_disk = False  # one only on disk is dropped when a lookup meets it
        for block in self._all_blocks():
            if block.on_disk and self._block_file(block).name in names:
                block.on_disk = False

    def _all_blocks(self) -> list[_Block]:
        out, todo = [], [self.root]
        while todo:
            node = todo.pop()
            out.append(node)
            todo.extend(node.children.values())
        return out

    def _all_snapshots(self) -> list[_Snapshot]:
        return [s for b in self._all_blocks() for s in b.snapshots.values()]

    def snapshot_stride(self, seq: Any) -> int:
        """Positions between in-prompt snapshots: the multiple of the block whose KV (trunk and
        head) weighs at least one snapshot's GDN states, so in-prompt snapshots at most double
        a prompt's bytes (demo model: a snapshot weighs ~140 positions of its KV, so every
        block; Qwen3.5-0.8B: ~19 MB against 14-29 KB per position, every 768-1,536)."""
        if self._stride is None:
            gdn = kv = 0
            for c in seq.trunk_cache.layers:
                if isinstance(c, KVCache):
                    kv += 2 * c.keys[..., :1, :].nbytes
                else:
                    gdn += c.conv.nbytes + c.recurrent.nbytes
            if seq.head_cache is not None and seq.head_cache.keys is not None:
                kv += 2 * seq.head_cache.keys[..., :1, :].nbytes
            blocks = -(-gdn // max(kv * self.block_tokens, 1))
            self._stride = self.block_tokens * max(1, blocks)
        return self._stride

    # -- facts -------------------------------------------------------------------------------
    @property
    def snapshots(self) -> int:
        return len(self._lru)

    def describe(self) -> dict[str, Any]:
        c = self.counters
        return {
            "lookups": c.lookups,
            "hits": c.hits,
            "reused_tokens": c.reused_tokens,
            "evictions": c.evictions,
            "errors": c.errors + (self.writer.errors if self.writer is not None else 0),
            "bytes_held": self.bytes_held,
            "snapshots": self.snapshots,
        }


# -- helpers ----------------------------------------------------------------------------------
def _ancestors(node: _Block) -> list[_Block]:
    out = []
    while node.parent is not None:
        node = node.parent
        out.append(node)
    return out


def _chain(parent: str, tokens: tuple[int, ...], kind: str = "block") -> str:
    h = hashlib.sha256(f"{parent}|{kind}|".encode())
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.hexdigest()[:32]


def _kv_cache(keys: list[mx.array], values: list[mx.array], offset: int) -> KVCache:
    cache = RowKVCache()
    keys = [k for k in keys if k.shape[2]]
    values = [v for v in values if v.shape[2]]
    if keys:
        # a fresh array either way: concatenating one array can return a view of it
        cache.keys = mx.concatenate(keys, axis=2) if len(keys) > 1 else keys[0] + 0
        cache.values = mx.concatenate(values, axis=2) if len(values) > 1 else values[0] + 0
    cache.offset = offset
    return cache


def _pending_one(seq: Any, trunk: Any, head: Any) -> mx.array | None:
    """Run the head over the pending pairs but the last (their tokens are known); return the
    last pending trunk state h_{P-1} (None without one)."""
    if not seq.head_pending or head is None:
        return None
    absorb_pending(trunk, head, seq, keep_last=True)
    return mx.concatenate(seq.head_pending, axis=1)[:, -1:]


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


def _to_bytes(a: mx.array) -> tuple[str, list[int], bytes]:
    dtype = _DTYPES.get(a.dtype)
    if dtype is None:
        raise ValueError(f"cannot store dtype {a.dtype}")
    raw = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
    return dtype, list(a.shape), np.array(raw).tobytes()


def _encode_file(header: dict[str, Any], arrays: dict[str, mx.array]) -> bytes:
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


def _write_file(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class SnapshotGone(FileNotFoundError):
    """A snapshot only on disk whose file is not there: removed to keep the disk budget, or
    its write failed."""


class DiskWriter:
    """The disk tier's one writing thread: writes the files handed to it in order, then keeps
    the model's files within the byte budget (oldest snapshots first, then the blocks no
    snapshot left needs). Only file operations run here; what it removed is taken in by the
    cache on the engine's thread (``take_deleted``), as are the files it failed to write. Its
    faults are logged and counted."""

    def __init__(self, directory: Path, tag: str, budget_bytes: int) -> None:
        self.directory, self.tag, self.budget_bytes = directory, tag, budget_bytes
        self.errors = 0  # written by this thread only
        self._jobs: queue.Queue[tuple[Path, bytes]] = queue.Queue()
        self._deleted: set[str] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="mtpserve-cache-writer", daemon=True)
        self._thread.start()

    def submit(self, path: Path, data: bytes) -> None:
        self._jobs.put((path, data))

    def drain(self) -> None:
        """Wait until every file handed over so far is written (or failed)."""
        self._jobs.join()

    def take_deleted(self) -> set[str]:
        with self._lock:
            names, self._deleted = self._deleted, set()
        return names

    def _run(self) -> None:
        while True:
            path, data = self._jobs.get()
            try:
                _write_file(path, data)
                if path.name.startswith("s-"):
                    self._keep_budget()
            except Exception as exc:  # OSError above all (a full disk): the cache is optional
                with self._lock:
                    self._deleted.add(path.name)
                self.errors += 1
                if self.errors & (self.errors - 1) == 0:  # the 1st, 2nd, 4th, 8th, ... fault
                    log.warning(
                        "prompt cache: could not write %s: %s (%d writes failed so far)",
                        path,
                        exc,
                        self.errors,
                    )
            finally:
                self._jobs.task_done()

    def _own(self, kind: str) -> list[Path]:
        return list(self.directory.glob(f"{kind}-{self.tag}-*.mtpc"))

    def _keep_budget(self) -> None:
        files = [(p, p.stat()) for p in self._own("[bs]")]
        total = sum(st.st_size for _, st in files)
        if total <= self.budget_bytes:
            return
        removed: set[str] = set()
        for path, st in sorted(files, key=lambda f: f[1].st_mtime):
            if total <= self.budget_bytes:
                break
            if path.name.startswith("s-"):
                path.unlink(missing_ok=True)
                total -= st.st_size
                removed.add(path.name)
        needed: set[str] = set()
        for path in self._own("s"):
            try:
                needed.update(_read_header(path).get("blocks", []))
            except (OSError, ValueError, KeyError, struct.error):
                continue
        for path in self._own("b"):
            if path.name.removesuffix(".mtpc").rsplit("-", 1)[-1] not in needed:
                path.unlink(missing_ok=True)
                removed.add(path.name)
        with self._lock:
            self._deleted |= removed


def _read_header(path: Path) -> dict[str, Any]:
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


def _read_file(path: Path, fingerprint: str) -> tuple[dict[str, Any], dict[str, mx.array]]:
    header = _read_header(path)
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


def prefill_hook(
    cache: PrefixCache | None, trunk: Any, head: Any, cancelled: Callable[[], bool]
) -> Callable[[Any], bool]:
    """The callback the prefill runs after each chunk: a snapshot at every block end (with a
    cache), then whether to go on (False once the request is cancelled)."""

    def after_chunk(seq: Any) -> bool:
        if cache is not None and seq.trunk_cache.length % cache.snapshot_stride(seq) == 0:
            cache.guarded("a snapshot", cache.store, seq, trunk, head)
        return not cancelled()

    return after_chunk
