"""Memory: what a checkpoint needs in the dtype it will run in, and what the machine has.

Planning (``plan``), before any weight is read: the bytes of every tensor come from the
safetensors headers; floating tensors are counted in the dtype chosen, packed quantized ones
as stored. On CPUs fp32 is chosen only when it fits with ``HEADROOM`` (bf16 matmuls are ~8x
slower than fp32 there); else the stored dtype is kept and the server says so;
when not even that fits, loading is refused with the figures. GPUs keep the stored dtype.
A mixture of experts with unquantized expert weights runs on a CPU only in fp32 (mlx's CPU
``gather_mm`` supports nothing else; quantized experts use ``gather_qmm``, which does): there
fp32 is chosen whenever it fits at all, and a narrower dtype is refused with the reason.
The memory available is MemAvailable (and a cgroup limit) on Linux, the recommended working set
on Metal, or ``MTPSERVE_MEMORY_LIMIT`` (bytes, or with a K/M/G suffix) when set.

Peak memory is measured by ``engine.bench.memory``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.allocator import jemalloc_mallctl

log = logging.getLogger("mtpserve.memory")

GiB = 2**30
#: fp32 on a CPU only when weights x this + RESERVE fit: the KV caches, activations, the
#: tokenizer and the OS need room too
HEADROOM = 1.15
RESERVE = 512 * 2**20
FLOAT_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8}
DTYPE_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
BYTES_OF = {"float32": 4, "bfloat16": 2, "float16": 2}


class InsufficientMemory(MemoryError):
    """The checkpoint does not fit in the memory available, in any dtype the engine may use."""


class UnsupportedDtype(ValueError):
    """The checkpoint cannot run in the dtype asked for on this device."""


#: mlx's CPU backend multiplies unquantized expert weights (``gather_mm``) only in float32
CPU_EXPERTS = (
    "a mixture of experts' unquantized expert weights run only in float32 on mlx's CPU backend"
)


@dataclass(frozen=True)
class CheckpointSize:
    #: floating-point elements (cast with the dtype chosen), their stored dtype's name
    float_elements: int
    stored_dtype: str
    #: bytes of everything else (packed quantized weights), kept as stored
    other_bytes: int
    #: unquantized stacked expert weights (a mixture of experts not quantized)
    floating_experts: bool = False

    def bytes_in(self, dtype: str | None) -> int:
        """Resident bytes with floating tensors in ``dtype`` (None: as stored)."""
        width = BYTES_OF[dtype or self.stored_dtype]
        return self.float_elements * width + self.other_bytes

    def per_rank(self, ranks: int) -> CheckpointSize:
        """One rank's part of a model sharded over ``ranks`` (tensor parallel, the vocabulary
        tables by rows): about 1/ranks. Rank 0's head and the replicated norms are not split,
        which the plan's headroom covers."""
        if ranks <= 1:
            return self
        return CheckpointSize(
            -(-self.float_elements // ranks),
            self.stored_dtype,
            -(-self.other_bytes // ranks),
            self.floating_experts,
        )


@dataclass(frozen=True)
class MemoryPlan:
    dtype: str  # the floating dtype the weights will be held in
    size: CheckpointSize
    available: int

    @property
    def needed(self) -> int:
        return self.size.bytes_in(self.dtype)


def safetensors_header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


def is_expert_weight(name: str) -> bool:
    """An expert's weight matrix: HF's ``mlp.experts.*`` or mlx-lm's ``switch_mlp.*``, not a
    quantized one's scales or biases."""
    return (".experts." in name or ".switch_mlp." in name) and not name.endswith(
        (".scales", ".biases")
    )


def checkpoint_size(files: list[Path]) -> CheckpointSize:
    elements: dict[str, int] = {}
    other = 0
    floating_experts = False
    for f in files:
        for name, info in safetensors_header(f).items():
            n = 1
            for d in info["shape"]:
                n *= d
            if info["dtype"] in DTYPE_NAMES:
                elements[info["dtype"]] = elements.get(info["dtype"], 0) + n
                floating_experts = floating_experts or is_expert_weight(name)
            else:
                begin, end = info["data_offsets"]
                other += end - begin
    stored = max(elements, key=elements.__getitem__) if elements else "F32"
    return CheckpointSize(sum(elements.values()), DTYPE_NAMES[stored], other, floating_experts)


def parse_bytes(text: str) -> int:
    text = text.strip().upper().removesuffix("B")
    scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def available_bytes() -> int:
    """Memory this process may fill (see the module docstring)."""
    if limit := os.environ.get("MTPSERVE_MEMORY_LIMIT"):
        return parse_bytes(limit)
    import mlx.core as mx

    if mx.default_device() == mx.gpu and mx.metal.is_available():
        return int(mx.device_info()["max_recommended_working_set_size"])
    candidates = []
    try:
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        fields = {line.split(":")[0]: line.split()[1] for line in meminfo}
        candidates.append(int(fields["MemAvailable"]) * 1024)
    except (OSError, KeyError, ValueError, IndexError):
        candidates.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    try:
        cgroup = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if cgroup != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            candidates.append(int(cgroup) - used)
    except (OSError, ValueError):
        pass
    return min(candidates)


def plan(
    size: CheckpointSize,
    requested: str,
    on_cpu: bool,
    available: int | None = None,
    widen_on_cpu: bool = True,
) -> MemoryPlan:
    """The dtype to load in (``requested``: auto, float32, bfloat16 or float16), or
    ``InsufficientMemory`` naming what is needed and what there is; ``UnsupportedDtype`` for a
    dtype the device cannot run the checkpoint in. ``widen_on_cpu``: auto widens half-precision
    weights to float32 on a CPU (where only mlx's float32 products are fast); False where the
    native product kernel runs them in their stored type (``engine.model.products``)."""
    available = available_bytes() if available is None else available
    stored = size.stored_dtype
    fp32_only = on_cpu and size.floating_experts
    if fp32_only and requested not in ("auto", "float32"):
        raise UnsupportedDtype(
            f"{CPU_EXPERTS}: --dtype {requested} cannot run this checkpoint here; use float32 or "
            f"a quantized checkpoint (`mtpserve convert --bits 4`)"
        )
    if requested != "auto":
        choice = MemoryPlan(requested, size, available)
    elif on_cpu and stored != "float32" and (widen_on_cpu or fp32_only):
        fp32 = MemoryPlan("float32", size, available)
        if fp32.needed * HEADROOM + RESERVE <= available:
            return fp32
        choice = fp32 if fp32_only else MemoryPlan(stored, size, available)
        if fp32_only and choice.needed <= available:
            log.warning(
                "float32 with little headroom: the weights need %.1f GB, %.1f GB available; "
                "%s (a quantized checkpoint, `mtpserve convert --bits 4`, needs far less)",
                fp32.needed / 1e9,
                available / 1e9,
                CPU_EXPERTS,
            )
        elif choice.needed <= available:
            log.warning(
                "keeping the weights in %s: float32 would need %.1f GB (with headroom %.1f GB), "
                "%.1f GB available; %s matmuls are slower than float32 on CPUs (--dtype "
                "float32 forces it)",
                stored,
                fp32.needed / 1e9,
                (fp32.needed * HEADROOM + RESERVE) / 1e9,
                available / 1e9,
                stored,
            )
    else:
        choice = MemoryPlan(stored, size, available)
    if choice.needed > available:
        raise InsufficientMemory(
            f"the weights need {choice.needed / 1e9:.1f} GB in {choice.dtype} and "
            f"{available / 1e9:.1f} GB are available: not loading"
            + (f" ({CPU_EXPERTS})" if fp32_only else "")
            + " (a quantized checkpoint, `mtpserve convert --bits 4`, needs about a quarter of"
            " bfloat16)"
        )
    return choice


def configure_device(weight_bytes: int) -> None:
    """On Metal, as mlx-lm does: wire the recommended working set so the weights stay
    resident between requests, and warn when the model is close to it."""
    import mlx.core as mx

    if not (mx.default_device() == mx.gpu and mx.metal.is_available()):
        return
    limit = int(mx.device_info()["max_recommended_working_set_size"])
    if weight_bytes > 0.9 * limit:
        log.warning(
            "the weights (%.1f GB) are close to the recommended working set (%.1f GB): "
            "generation may be slow; raise it with `sudo sysctl iogpu.wired_limit_mb=N`",
            weight_bytes / 1e9,
            limit / 1e9,
        )
    mx.set_wired_limit(limit)


def release_between_requests() -> None:
    """Free mlx's buffer cache after a request (as mlx-lm's server does on Metal), so a long
    prompt's activations do not stay allocated and the cache cannot drift up with the mix of
    shapes traffic brings; on Linux the host heap then hands the freed pages back."""
    import mlx.core as mx

    mx.clear_cache()
    trim_host_heap()


def release_while_running() -> None:
    """``release_between_requests`` for a batch that never idles, when one of its rows leaves:
    at most every ``TRIM_INTERVAL_S``, and not on a GPU (the running rows would wait for their
    buffers to be allocated again); on a CPU reallocating a cycle's buffers costs little."""
    import mlx.core as mx

    if mx.default_device() == mx.gpu or time.monotonic() - _last_trim < TRIM_INTERVAL_S:
        return
    mx.clear_cache()
    trim_host_heap()


def release_thread() -> None:
    """Free what mlx keeps per thread — its compile cache and the thread's streams — at the end
    of a thread that ran the model (the engine's worker), from that thread.

    The compile cache's entries hold Python objects. Left to the thread's exit, a C++
    thread-local destructor releases them and must take the GIL; when that exit comes after
    the interpreter began finalizing (a server stopped at process exit), taking the GIL ends
    the thread by unwinding through the destructor and the process aborts ("terminate called
    without an active exception", exit status 134). Called here, under the GIL, nothing is
    left for the destructor. The thread's streams go with it: no other thread uses them."""
    import mlx.core as mx

    mx.clear_streams()


# -- the host heap (jemalloc or glibc) --------------------------------------------------------
# mlx's CPU backend allocates every array through malloc, from several threads (the caller's,
# mlx's stream thread, BLAS threads). glibc keeps an arena per thread and holds the pages freed
# in each until the heap is trimmed; jemalloc (what the ``mtpserve`` command runs under,
# engine.allocator) returns a freed page only after a decay delay, and only when some thread
# next allocates. Without releasing them, a server's resident memory follows the high-water mark
# of its traffic rather than what it holds (`make soak`; docs/BENCHMARKS.md, "Many requests at
# once").

#: glibc's mallopt parameter for the number of arenas
_M_ARENA_MAX = -8
#: arenas a glibc serving process keeps: its two busy allocating threads
HOST_ARENAS = 2
#: jemalloc's name for every arena at once (MALLCTL_ARENAS_ALL)
_JEMALLOC_PURGE_ALL = b"arena.4096.purge"
#: while requests run, memory is released at most this often (``release_while_running``)
TRIM_INTERVAL_S = 2.0
_last_trim = 0.0


@functools.cache
def _glibc() -> Any:
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def limit_host_arenas() -> None:
    """Cap glibc's malloc arenas at ``HOST_ARENAS`` (a serving process calls this at start,
    before its threads allocate); nothing under jemalloc, whose arenas return their pages."""
    libc = _glibc()
    if libc is not None and jemalloc_mallctl() is None:
        libc.mallopt(_M_ARENA_MAX, HOST_ARENAS)


def trim_host_heap() -> None:
    """Return the heap's free pages to the system: jemalloc's purge of every arena, or glibc's
    ``malloc_trim``; nothing elsewhere."""
    global _last_trim
    _last_trim = time.monotonic()
    mallctl = jemalloc_mallctl()
    if mallctl is not None:
        mallctl(_JEMALLOC_PURGE_ALL, None, None, None, 0)
        return
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
