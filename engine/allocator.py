"""Run the ``mtpserve`` command under jemalloc on Linux.

Every mlx primitive allocates and frees small host objects (the array's descriptor and shared
state, the task queued to mlx's stream thread, shape vectors): a few per primitive, hundreds of
primitives per decode cycle, allocated on the calling thread and freed on either thread. glibc's
malloc spends ~14% of the calling thread's samples there; under jemalloc a plain decode step of
the demo model takes ~0.78x the CPU time and a K=4 cycle ~0.76x, with token-identical output
(the allocator touches no float), and glibc's tunables (arena count, tcache size, trim and mmap
thresholds) did not close the gap (docs/CPU_CHOICES.md).

An allocator is chosen when the process starts: memory glibc handed out cannot be freed by
another malloc, and ``LD_PRELOAD`` is read by the dynamic loader only. So the console command
re-executes itself once, with jemalloc added to ``LD_PRELOAD`` (same pid, argv, stdio and
environment otherwise); the re-executed process then puts ``LD_PRELOAD`` back as it was, so the
programs it starts (llama.cpp in the comparison script) run as they would have. The library
comes from Debian's
``libjemalloc2`` (``make install`` installs it when apt is there). ``MTPSERVE_MALLOC=system``
keeps glibc's malloc (for before/after measurements); ``MTPSERVE_MALLOC`` may also name a
library path. Nothing happens on macOS (not measured there).

jemalloc runs with ``thp:always`` (``MALLOC_CONF``, ahead of any options the user gives there,
which win): it advises its mappings for transparent huge pages, so that the model's weights,
mlx arrays from malloc, lie in 2 MiB pages where the kernel leaves THP to ``madvise`` (Debian's
and most distributions' default). Decoding streams every weight once a token; in 4 KiB pages
that is a TLB miss every 4 KiB, and the hardware prefetcher stops at each page's end. Plain
decoding at the Qwen3.5-0.8B shape runs ~17% faster in 4 bits and ~7% in bf16
(docs/CPU_CHOICES.md). With the system's malloc the weights stay in 4 KiB pages.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
    "/usr/lib64/libjemalloc.so.2",
    "/usr/lib/libjemalloc.so.2",
)


def jemalloc_path() -> str | None:
    """The jemalloc library to preload (None: keep the system's malloc)."""
    if not sys.platform.startswith("linux"):
        return None
    choice = os.environ.get("MTPSERVE_MALLOC", "")
    if choice.lower() == "system":
        return None
    for path in (choice,) if choice else CANDIDATES:
        if path and os.path.exists(path):
            return path
    return None


#: jemalloc's options for the re-executed process (the module's docstring says why)
JEMALLOC_CONF = "thp:always"

#: each variable the re-execution sets, and where it keeps the value the command was started
#: with (restored once the process runs, so that the programs it starts see them unchanged)
SAVED_AS = {
    "LD_PRELOAD": "MTPSERVE_LD_PRELOAD_BEFORE",
    "MALLOC_CONF": "MTPSERVE_MALLOC_CONF_BEFORE",
}


def preload_environment(path: str, environ: dict[str, str]) -> dict[str, str] | None:
    """The environment to re-execute with so that ``path`` is preloaded with ``JEMALLOC_CONF``;
    None when it already is preloaded."""
    preloaded = environ.get("LD_PRELOAD", "").replace(":", " ").split()
    if path in preloaded:
        return None
    user_conf = environ.get("MALLOC_CONF", "")
    setting = {
        "LD_PRELOAD": " ".join([path, *preloaded]),
        "MALLOC_CONF": f"{JEMALLOC_CONF},{user_conf}" if user_conf else JEMALLOC_CONF,
    }
    saved = {SAVED_AS[name]: environ.get(name, "") for name in setting}
    return {**environ, **setting, **saved}


def restore_environment(environ: MutableMapping[str, str]) -> None:
    """Put ``LD_PRELOAD`` and ``MALLOC_CONF`` back as the command was started with them (the
    loader and jemalloc have read them)."""
    for name, saved_as in SAVED_AS.items():
        before = environ.pop(saved_as, None)
        if before is None:
            continue
        if before:
            environ[name] = before
        else:
            environ.pop(name, None)


def reexec_under_jemalloc() -> None:
    """Re-execute this process with jemalloc preloaded, or return when there is nothing to do.

    Call it first thing in a command's entry point, before threads or anything else starts:
    ``os.execve`` replaces the process image and does not return.
    """
    path = jemalloc_path()
    if path is None:
        return
    environ = preload_environment(path, dict(os.environ))
    if environ is None:  # preloaded: this is the re-executed process (or the user preloaded it)
        restore_environment(os.environ)
        return
    argv = [sys.executable, *sys.orig_argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, environ)


@functools.cache
def malloc_in_use() -> str:
    """What serves this process's malloc: the jemalloc library mapped into it, or the system's
    (fixed from the process's start: read once)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system malloc"
    for line in maps.splitlines():
        if "libjemalloc" in line:
            return line.split()[-1]
    return "system malloc"


@functools.cache
def jemalloc_mallctl() -> Any:
    """jemalloc's ``mallctl`` when jemalloc serves this process's malloc (preloaded), else None."""
    import ctypes

    try:
        mallctl = ctypes.CDLL(None).mallctl
    except (OSError, AttributeError):
        return None
    mallctl.argtypes = [ctypes.c_char_p] + [ctypes.c_void_p] * 3 + [ctypes.c_size_t]
    mallctl.restype = ctypes.c_int
    return mallctl
