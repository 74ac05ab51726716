"""The conversation cache's disk tier: every stored block and snapshot written to a file of its
own (through ``DiskWriter``), the index of those files read at start, and a snapshot's arrays
read back, checked, when a lookup needs them."""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.cache.cache_file import encode_file, read_file, read_header
from engine.cache.disk_writer import DiskWriter
from engine.cache.entries import Block, Snapshot, chain_digest

log = logging.getLogger("mtpserve.prefix_cache")


class SnapshotGone(FileNotFoundError):
    """A snapshot only on disk whose file is not there: removed to keep the disk budget, or
    its write failed."""


class DiskTier:
    """The disk tier of ``PrefixCache``, which inherits these methods: they read and write the
    cache's own trie and byte count, so they act on the cache itself rather than on an object
    of their own."""

    # Set by PrefixCache.__init__; the memory tier's methods these call are PrefixCache's.
    root: Block
    block_tokens: int
    is_attention: list[bool]
    bytes_held: int
    counters: Any
    fingerprint: str
    directory: Path | None
    writer: DiskWriter | None
    _fill: Callable[..., None]
    _evict: Callable[..., None]
    _add: Callable[[Snapshot], None]

    # Every file name carries the model's fingerprint, so that models sharing a directory
    # never read, count toward their budget, overwrite or delete each other's files.
    @property
    def _file_tag(self) -> str:
        return self.fingerprint[:16] or "any"

    def _block_file(self, block: Block) -> Path:
        return self.directory / f"b-{self._file_tag}-{block.digest}.mtpc"

    def _snap_file(self, snap: Snapshot) -> Path:
        return self.directory / f"s-{self._file_tag}-{snap.digest}.mtpc"

    def _own_files(self, kind: str = "[bs]") -> list[Path]:
        return list(self.directory.glob(f"{kind}-{self._file_tag}-*.mtpc"))

    def _write_blocks(self, node: Block) -> None:
        """Write ``node``'s blocks not yet on disk; a failure (a full disk) is logged and
        counted, never raised: the disk tier is an optimisation."""
        if self.directory is None:
            return
        try:
            self._write_block_files(node)
        except (OSError, ValueError) as exc:
            self.counters.errors += 1
            log.warning("prompt cache: could not write to %s: %s", self.directory, exc)

    def _write_block_files(self, node: Block) -> None:
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
                self.writer.submit(self._block_file(block), encode_file(header, arrays))
                block.on_disk = True

    def _write(self, snap: Snapshot) -> None:
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
            self.writer.submit(self._snap_file(snap), encode_file(header, arrays))
            snap.on_disk = True
        except (OSError, ValueError) as exc:
            self.counters.errors += 1
            log.warning("prompt cache: could not write to %s: %s", self.directory, exc)

    def _load(self, snap: Snapshot, path: list[Block]) -> None:
        """Read a snapshot's missing arrays (and its blocks') from disk; checked. On a
        failure the blocks read for it are let go again, so the byte count holds only what
        some loaded snapshot uses."""
        if self.writer is not None and (not snap.loaded or any(b.kv is None for b in path)):
            self.writer.drain()  # a file it needs may still be on its way to the disk
            self._forget_deleted()
            if not snap.on_disk and not snap.loaded:
                raise SnapshotGone("its file was removed for the disk budget, or never written")
        read: list[Block] = []
        try:
            for block in path:
                if block.kv is None:
                    header, arrays = read_file(self._block_file(block), self.fingerprint)
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
            header, arrays = read_file(self._snap_file(snap), self.fingerprint)
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
                header = read_header(path)
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
                    child = Block(key, node, chain_digest(node.digest, key), on_disk=True)
                    node.children[key] = child
                node = child
            tail = tuple(tokens[(len(tokens) // B) * B :])
            snap = Snapshot(node, tail, len(tokens), chain_digest(node.digest, tail, "snapshot"))
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

    def _all_blocks(self) -> list[Block]:
        out, todo = [], [self.root]
        while todo:
            node = todo.pop()
            out.append(node)
            todo.extend(node.children.values())
        return out

    def _all_snapshots(self) -> list[Snapshot]:
        return [s for b in self._all_blocks() for s in b.snapshots.values()]
