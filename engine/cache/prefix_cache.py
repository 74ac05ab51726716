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

This module owns the lookups, the stores and the memory tier; the trie's entries are
engine.cache.entries, the disk tier engine.cache.disk_tier (its files' format cache_file, their
writer disk_writer, the model's fingerprint fingerprint).
"""

from __future__ import annotations

import logging
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from engine.cache.disk_tier import DiskTier, SnapshotGone
from engine.cache.disk_writer import DiskWriter
from engine.cache.entries import Block, Snapshot, ancestors, chain_digest
from engine.cache.fingerprint import model_fingerprint
from engine.cycle.sequence import PREFILL_CHUNK, absorb_pending
from engine.model.attention import RowKVCache
from engine.model.gated_deltanet import GDNLayerState

# model_fingerprint's home is engine.cache.fingerprint; the engine imports it from here.
__all__ = [
    "DEFAULT_BLOCK_TOKENS",
    "DEFAULT_BUDGET_BYTES",
    "DEFAULT_DISK_BUDGET_BYTES",
    "CacheCounters",
    "PrefixCache",
    "Restored",
    "model_fingerprint",
    "prefill_hook",
]

T = TypeVar("T")
log = logging.getLogger("mtpserve.prefix_cache")

#: Positions per KV block and between in-prompt snapshots: the prefill chunk, so that block ends
#: are chunk ends.
DEFAULT_BLOCK_TOKENS = PREFILL_CHUNK
DEFAULT_BUDGET_BYTES = 1 << 30
DEFAULT_DISK_BUDGET_BYTES = 8 << 30


def _own(x: mx.array) -> mx.array:
    """A copy that does not keep the buffer it was sliced from alive."""
    return mx.contiguous(x)


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


class PrefixCache(DiskTier):
    """The conversation cache's memory tier and its lookups; the disk tier's methods come from
    ``DiskTier``."""

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
        self.root = Block((), None, "root")
        self._lru: OrderedDict[int, Snapshot] = OrderedDict()
        self.bytes_held = 0
        self.counters = CacheCounters()
        self.fingerprint = fingerprint
        self.directory = Path(directory) if directory else None
        self.disk_budget_bytes = disk_budget_bytes
        self._stride: int | None = None
        self._unwritten: list[Snapshot] = []
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

    def _candidates(self, prompt: list[int], need_head: bool) -> list[Snapshot]:
        limit = len(prompt) - 1  # the trunk holds at most prompt[:-1]
        B = self.block_tokens
        found: list[Snapshot] = []
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

    def _restore(self, snap: Snapshot, need_head: bool) -> Restored | None:
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
                child = Block(key, node, chain_digest(node.digest, key))
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
            snap = Snapshot(node, tail, P, chain_digest(node.digest, tail, "snapshot"))
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
    def _arrays(snap: Snapshot) -> list[mx.array]:
        out = [a for pair in snap.layers or [] for a in pair]
        if snap.head_tail is not None:
            out += [*snap.head_tail, snap.head_pending]
        return out

    def _fill(
        self,
        snap: Snapshot,
        layers: list[tuple[mx.array, mx.array]],
        head_tail: tuple[mx.array, mx.array] | None,
        pending: mx.array | None,
    ) -> None:
        """Give an entry its arrays (new, only on disk, or upgraded with the head's)."""
        if snap.loaded:
            self.bytes_held -= snap.nbytes
        else:
            for b in [snap.node, *ancestors(snap.node)]:
                b.loaded_refs += 1
        snap.layers, snap.head_tail, snap.head_pending = layers, head_tail, pending
        snap.has_head = head_tail is not None
        snap.nbytes = sum(a.nbytes for a in self._arrays(snap))
        self.bytes_held += snap.nbytes
        self._lru[id(snap)] = snap
        self._lru.move_to_end(id(snap))

    def _add(self, snap: Snapshot) -> None:
        snap.node.snapshots[snap.tail] = snap
        for b in [snap.node, *ancestors(snap.node)]:
            b.refs += 1

    def _unload(self, snap: Snapshot) -> None:
        """Free a snapshot's arrays (it stays as an on-disk entry) and blocks nobody needs."""
        if not snap.loaded:
            return
        self._lru.pop(id(snap), None)
        self.bytes_held -= snap.nbytes
        snap.layers, snap.head_tail, snap.head_pending = None, None, None
        for b in [snap.node, *ancestors(snap.node)]:
            b.loaded_refs -= 1
            if b.loaded_refs == 0 and b.parent is not None and b.kv is not None:
                self.bytes_held -= b.nbytes
                b.kv, b.head = None, None

    def _drop(self, snap: Snapshot, count: bool = True) -> None:
        """Forget a snapshot entirely (memory and index); blocks nobody needs go with it."""
        self._unload(snap)
        if snap.node.snapshots.get(snap.tail) is snap:
            del snap.node.snapshots[snap.tail]
        for b in [snap.node, *ancestors(snap.node)]:
            b.refs -= 1
        node = snap.node
        while node.parent is not None and node.refs == 0:
            node.parent.children.pop(node.tokens, None)
            node = node.parent

    def _evict(self, keep: Snapshot | None = None) -> None:
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
