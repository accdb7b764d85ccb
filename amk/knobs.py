"""Every environment knob AMK reads, in one place. Read at use time, so tests can monkeypatch."""
from __future__ import annotations

import os
from pathlib import Path


def _int(name: str, default: int) -> int:
    v = os.environ.get(name, "")
    try:
        return int(v) if v else default
    except ValueError:
        raise ValueError(f"{name}={v!r} is not an integer") from None


def debug() -> int:
    """AMK_DEBUG: 1 timings + verify after every pass, 2 schedule summary, 3 IR after each
    pass, 4 generated CUDA."""
    return _int("AMK_DEBUG", 0)


def dump_ir_dir() -> Path | None:
    """AMK_DUMP_IR=DIR: one folder per compiled function with every stage's text."""
    v = os.environ.get("AMK_DUMP_IR", "")
    return Path(v) if v else None


def print_ir_after() -> str:
    """AMK_PRINT_IR_AFTER=all|<pass>[,<pass>]: print those stages to stderr."""
    return os.environ.get("AMK_PRINT_IR_AFTER", "")


def cache_dir() -> Path:
    """AMK_CACHE_DIR: where compiled cubins live (default ~/.cache/amk)."""
    v = os.environ.get("AMK_CACHE_DIR", "")
    return Path(v) if v else Path.home() / ".cache" / "amk"


def backend() -> str:
    """AMK_BACKEND: default backend name; empty = cuda where a GPU is present, else reference."""
    return os.environ.get("AMK_BACKEND", "")


def watchdog_s() -> float:
    """AMK_WATCHDOG_S: seconds a kernel or VM may make no progress before it is declared stuck."""
    return float(os.environ.get("AMK_WATCHDOG_S", "") or 1.0)


def vm_timeout_s() -> float:
    """AMK_VM_TIMEOUT_S: wall-clock limit of one reference-VM run."""
    return float(os.environ.get("AMK_VM_TIMEOUT_S", "") or 600.0)


def profile() -> bool:
    """AMK_PROFILE=1: the CUDA megakernel records per task %globaltimer at wait start, wait end
    and task end (CudaProgram.profile() reads them; bench/profile/profile_decode.py summarises)."""
    return _int("AMK_PROFILE", 0) != 0


def gemv_ring() -> bool:
    """AMK_GEMV_RING=1|SxK: the CUDA backend streams float batch-1 GEMV weight tiles through
    shared memory: per CTA, the weight chunks of its whole queue form one stream that the
    bulk-copy engine keeps S chunks of K KiB ahead of the GEMVs (1 = 4x32), across task
    boundaries (so the next tasks' weights land while their counters are waited on). 0: off.
    Opt-in: correct, but measured slower than the direct loads on an H200 (bench/NOTES.md, v3)."""
    return gemv_ring_shape()[0] > 0


def _shape(name: str, on: tuple[int, int], example: str) -> tuple[int, int]:
    """A knob that is 0 (off: (0, 0)), 1 (`on`) or AxB (two ints)."""
    v = os.environ.get(name, "") or "0"
    if v in ("0", "1"):
        return (0, 0) if v == "0" else on
    try:
        a, b = (int(p) for p in v.lower().split("x"))
    except ValueError:
        raise ValueError(f"{name}={v!r}: expected 0, 1 or a shape such as {example}") from None
    if a <= 0 or b <= 0:
        raise ValueError(f"{name}={v!r}: a shape's numbers are positive (0 turns it off)")
    return a, b


def gemv_ring_shape() -> tuple[int, int]:
    """(stages, chunk bytes) of AMK_GEMV_RING (see gemv_ring); (0, 0) when off."""
    st, kib = _shape("AMK_GEMV_RING", (4, 32), "8x16")
    if st and (not 2 <= st <= 16 or kib not in (8, 16, 32) or st * kib > 128):
        raise ValueError(f"AMK_GEMV_RING={st}x{kib}: S in 2..16 stages of K in 8, 16, 32 KiB, "
                         "S*K <= 128 KiB")
    return st, kib * 1024


def attn_smem() -> bool:
    """AMK_ATTN_SMEM=1 (default): the CUDA attention shard stages its K/V rows in shared memory
    with 16-byte cp.async issued before it reads pos and q, and rotates q itself (bench/NOTES.md
    v9). 0: the v5 attention (loads from global memory in each phase)."""
    return _int("AMK_ATTN_SMEM", 1) != 0


def ctas_per_sm() -> int:
    """AMK_CTAS_PER_SM=1|2: persistent CTAs the CUDA megakernel runs on each SM (512 / N threads
    each, one static queue each: the cuda target places on N x SMs queues), so one CTA streams
    weights while the other waits on a counter. 2 needs AMK_GEMV_RING=0. Default 1: 2 is
    correct but measured slower on an H200 (2.04 vs 1.92 ms a step, bench/NOTES.md v7)."""
    n = _int("AMK_CTAS_PER_SM", 1)
    if n not in (1, 2):
        raise ValueError(f"AMK_CTAS_PER_SM={n}: the CUDA megakernel runs 1 or 2 CTAs per SM")
    return n


def gemv_pipe() -> tuple[int, int]:
    """AMK_GEMV_PIPE=0|1|VxS: a float batch-1 GEMV of read-only weights streams its tile through
    a per-warp cp.async ring in shared memory (templates/gemv_pipe.cuh): V 16-byte vectors a
    lane per item, S items in flight a warp, the first S-1 issued before the task's counter
    wait. Returns (V, S); (0, 0) = off (the direct-load op_gemv, the default: the pipe measured
    slower on an H200, bench/NOTES.md v8). 1 = 4x4. Ignored under AMK_GEMV_RING (the two share
    the shared-memory area past the work area)."""
    vv, ss = _shape("AMK_GEMV_PIPE", (4, 4), "4x4")
    if vv and (vv not in (1, 2, 4, 8) or not 2 <= ss <= 16 or vv * ss * 512 > 8192):
        raise ValueError(f"AMK_GEMV_PIPE={vv}x{ss}: V in 1,2,4,8, S in 2..16, V*S*512 B <= 8 KiB a warp")
    return vv, ss


def l2_prefetch() -> int:
    """AMK_L2_PREFETCH: which weight ranges the CUDA scheduler prefetches into L2 before a
    task's counter wait. 0 (default): none; 1: the NEXT task's whole weight tiles; 2: the task's
    own whole tiles (the wait hides the HBM -> L2 copy); 3: the NEXT task's first GEMV round
    (v9's default). Every one measured slower on an H200 (bench/NOTES.md v8, v10: 3 cost 0.09
    ms a step and sped no GEMV up)."""
    n = _int("AMK_L2_PREFETCH", 0)
    if n not in (0, 1, 2, 3):
        raise ValueError(f"AMK_L2_PREFETCH={n}: expected 0, 1, 2 or 3")
    return n


def preload_bytes() -> int:
    """AMK_PRELOAD: bytes of an o-projection tile's weight rows (a GEMV task that starts with the
    split-KV combine) that the CUDA kernel copies into shared memory while the task before it
    runs (one bulk copy a matrix: from the staged attention once its own loads are issued, else
    when that task ends), so the o tile's GEMV reads them from there (lower._preload, NOTES
    v11). 0 = off; at most 65536 (the area at the top of shared memory); default 65536. Only
    with the ring area free (no AMK_GEMV_RING / AMK_GEMV_PIPE, one CTA an SM)."""
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


def lineinfo() -> bool:
    """AMK_LINEINFO=1: NVRTC adds line info to the cubin (-lineinfo), so a profiler (ncu's
    source page, bench/profile/ncu_step.py) maps each SASS instruction to a line of the kernel source."""
    return _int("AMK_LINEINFO", 0) != 0


def backend_knobs() -> tuple:
    """Every knob that changes the CUDA lowering, source or runtime (part of the cache keys)."""
    return (gemv_ring_shape(), attn_smem(), profile(), ctas_per_sm(), gemv_pipe(), l2_prefetch(),
            spin_ns(), counter_stride(), preload_bytes())
