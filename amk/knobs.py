"""Every environment knob AMK reads, in one place, each read by one function, grouped by concern.

Read at use time (tests monkeypatch them), and only at the edge: amk.jit, the pass dumps and the
reference VM call these; the CUDA backend gets them as one frozen CudaOptions (cuda_options()),
built once when amk.jit first lowers a function.
"""
from __future__ import annotations

import os
from pathlib import Path

from amk.backends.cuda.options import CudaOptions


def _int(name: str, default: int) -> int:
    v = os.environ.get(name, "")
    try:
        return int(v) if v else default
    except ValueError:
        raise ValueError(f"{name}={v!r} is not an integer") from None


# ---- debug and dumps ----------------------------------------------------------------------------
def debug() -> int:
    """AMK_DEBUG: 1 timings + verify after every pass, 2 schedule summary, 3 IR after each
    pass, 4 generated CUDA."""
    return _int("AMK_DEBUG", 0)


def dump_ir_dir() -> Path | None:
    """AMK_DUMP_IR=DIR: one folder per compiled function with every stage's text (the CUDA
    backend's stages too: kernel.cu and the cubin)."""
    v = os.environ.get("AMK_DUMP_IR", "")
    return Path(v) if v else None


def print_ir_after() -> str:
    """AMK_PRINT_IR_AFTER=all|<stage>[,<stage>]: print those stages to stderr."""
    return os.environ.get("AMK_PRINT_IR_AFTER", "")


# ---- caches -------------------------------------------------------------------------------------
def cache_dir() -> Path:
    """AMK_CACHE_DIR: where compiled programs, lowered tables, cubins and the `amk serve` socket
    live (default ~/.cache/amk). amk_client.protocol.cache_dir reads it too: the torch-free
    client cannot import this module (tests/test_serve.py checks that the two agree)."""
    v = os.environ.get("AMK_CACHE_DIR", "")
    return Path(v) if v else Path.home() / ".cache" / "amk"


# ---- backend choice -----------------------------------------------------------------------------
def backend() -> str:
    """AMK_BACKEND: default backend name; empty = cuda where a GPU is present, else reference."""
    return os.environ.get("AMK_BACKEND", "")


# ---- the CUDA kernel's shape (part of every CUDA cache key) -------------------------------------
def preload_bytes() -> int:
    """AMK_PRELOAD: bytes of a batch-1 GEMV tile's first weight rows (q/k/v, o, gate/up, down,
    the LM head) that the CUDA kernel copies into shared memory while the task before it runs
    (one bulk copy a matrix: from the staged attention once its own loads are issued, else when
    that task ends), so the tile's GEMV reads them from there (cuda/preload.py, NOTES v11, v35).
    0 = off; at most 65536 (the area at the top of shared memory); default 65536."""
    n = _int("AMK_PRELOAD", 65536)
    if not 0 <= n <= 65536 or n % 16:
        raise ValueError(f"AMK_PRELOAD={n}: expected a multiple of 16 in 0..65536")
    return n


def spin_ns() -> int:
    """AMK_SPIN_NS: the longest sleep (ns) between two polls of a counter by a waiting CTA
    (the backoff doubles from 16 up to it). Every waiting SM polls the same counter, so short
    sleeps load one L2 slice; long ones wake consumers late."""
    n = _int("AMK_SPIN_NS", 128)
    if not 16 <= n <= 1 << 16:
        raise ValueError(f"AMK_SPIN_NS={n}: expected 16..65536")
    return n


def counter_stride() -> int:
    """AMK_COUNTER_STRIDE: 4-byte words between two counters in device memory (1 = packed;
    64 = one 256-byte line each, so counters of different stages live in different L2 lines)."""
    n = _int("AMK_COUNTER_STRIDE", 1)
    if n < 1 or n > 1024 or n & (n - 1):
        raise ValueError(f"AMK_COUNTER_STRIDE={n}: expected a power of two in 1..1024")
    return n


def profile() -> bool:
    """AMK_PROFILE=1: the CUDA megakernel records per task %globaltimer at wait start, wait end
    and task end (CudaProgram.profile() reads them; bench/profile/profile_decode.py summarises)."""
    return _int("AMK_PROFILE", 0) != 0


def lineinfo() -> bool:
    """AMK_LINEINFO=1: NVRTC adds line info to the cubin (-lineinfo), so a profiler (ncu's
    source page, bench/profile/ncu_step.py) maps each SASS instruction to a line of the kernel source."""
    return _int("AMK_LINEINFO", 0) != 0


def cuda_source() -> tuple[str, str] | None:
    """AMK_CUDA_SOURCE=path/to/kernel.cu: compile this file instead of the rendered kernel (an
    experiment on a dumped kernel.cu; it must match the program's tables). -> (path, text)."""
    v = os.environ.get("AMK_CUDA_SOURCE", "")
    if not v:
        return None
    try:
        return v, Path(v).read_text()
    except OSError as e:
        raise ValueError(f"AMK_CUDA_SOURCE={v!r}: cannot read it ({e.strerror})") from None


# ---- runtime and watchdogs ----------------------------------------------------------------------
def watchdog_s() -> float:
    """AMK_WATCHDOG_S: seconds a kernel or VM may make no progress before it is declared stuck."""
    return float(os.environ.get("AMK_WATCHDOG_S", "") or 1.0)


def vm_timeout_s() -> float:
    """AMK_VM_TIMEOUT_S: wall-clock limit of one reference-VM run."""
    return float(os.environ.get("AMK_VM_TIMEOUT_S", "") or 600.0)


# ---- the CUDA backend's options, built once at the edge -----------------------------------------
def cuda_options() -> CudaOptions:
    """Every CUDA knob, read now, as the CudaOptions the backend gets."""
    src = cuda_source()
    return CudaOptions(preload_bytes=preload_bytes(), spin_ns=spin_ns(),
                       counter_stride=counter_stride(), profile=profile(), lineinfo=lineinfo(),
                       source=src[1] if src else None, source_path=src[0] if src else "",
                       watchdog_s=watchdog_s(), cache_dir=cache_dir())
