"""The conversation cache's disk writer: the one thread that writes the cache's files and keeps
them within the disk budget, off the engine's thread."""

from __future__ import annotations

import logging
import os
import queue
import struct
import threading
from pathlib import Path

from engine.cache.cache_file import read_header

log = logging.getLogger("mtpserve.prefix_cache")


def _write_file(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


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
                needed.update(read_header(path).get("blocks", []))
            except (OSError, ValueError, KeyError, struct.error):
                continue
        for path in self._own("b"):
            if path.name.removesuffix(".mtpc").rsplit("-", 1)[-1] not in needed:
                path.unlink(missing_ok=True)
                removed.add(path.name)
        with self._lock:
            self._deleted |= removed
