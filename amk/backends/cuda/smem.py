"""The megakernel's CTA: its threads and its dynamic shared-memory layout, in one place (the
lowering sizes tiles against it, codegen renders it as AMK_* defines, the runtime launches
with it).

Kernel v1: one CTA an SM, 512 threads, 212 KiB:
    [0, STAGE_OFF)           work area: x staged as fp32 (XS_MAX floats), sums, the attention
    [STAGE_OFF, SMEM_BYTES)  staging area: the combine's partials and the attention's K/V chunks
    [PRE_OFF, SMEM_BYTES)    a GEMV tile's preloaded rows (the top 64 KiB; preload.py)
    [x's end, PRE_OFF)       an o tile's folded combine: its partials, staged from the end of
                             its x (1024-aligned) up to the preload (FOLD_STAGE_TOP)
Kernel v2 (ring.py): the same 512 threads (its consumers) plus a producer warpgroup, and
    [0, STAGE_OFF)                     the work area, as v1
    [STAGE_OFF, RING_OFF)              the staging area, STAGE_BYTES_V2 (23 KiB: the attention's
                                       chunks use it with the work area; the combine stages its
                                       partials from the end of its x, in the work area, up)
    [RING_OFF, SMEM_BYTES_V2)          the weight ring: RING_BYTES of pages no other task touches
                                       (the producer fills them while other kinds of task run)
"""
from __future__ import annotations

NTHREADS = 512                   # threads of the one persistent CTA an SM (v2: its consumers)
NWARPS = NTHREADS // 32
# v2: a producer warpgroup after them (a lane of its first warp streams each ring page).
# setmaxnreg, which moves registers between roles, works on whole warpgroups, and a CTA of 17
# warps launches with 96 registers a thread (5 warps on one SM sub-partition's 16 K registers),
# so every consumer function spilled. 20 warps launch with 96 too; the producers give theirs
# back to the CTA's pool (setmaxnreg.dec to PRODUCER_REGS) and the consumers take them from it
# (inc to CONSUMER_REGS): 128 x (96 - 32) = 512 x (112 - 96). The pool holds only what was
# given back (CUTLASS's 3 x 168 = 2 x 232 + 40 is the same balance): asking for more never
# returns, so the sum is asserted here.
PRODUCER_THREADS = 128
LAUNCH_REGS = 96
CONSUMER_REGS = 112
PRODUCER_REGS = 32
assert NTHREADS * (CONSUMER_REGS - LAUNCH_REGS) <= PRODUCER_THREADS * (LAUNCH_REGS - PRODUCER_REGS)
assert (NTHREADS + PRODUCER_THREADS) * LAUNCH_REGS <= 65536
XS_MAX = 16384                   # floats of x a GEMV stages in shared memory (64 KiB); K must fit
GEMV_SMEM = XS_MAX * 4           # the work area that holds them
ATTN_SMEM = (8 * 256 + 8 * NTHREADS + 8 * NTHREADS) * 4
STAGE_OFF = max(GEMV_SMEM, ATTN_SMEM)
STAGE_BYTES = 128 << 10
# 4 KiB more at the top (the deleted weight stream's window; the preload's 64 KiB cover it),
# and 16 KiB more so that an o tile's fold stages 16 partials of the 1B's and Qwen3-0.6B's
# shapes (135 KB / 133 KB) between its x and the preload: 212 KiB of the 227 KiB a CTA may
# have. 196 KiB + 10 KiB of static variables already took the largest carveout (228 KiB),
# so the L1 is the same size.
SMEM_BYTES = STAGE_OFF + STAGE_BYTES + 4096 + 16384
PRE_OFF = SMEM_BYTES - 65536     # preload.py's GEMV rows: the top 64 KiB
# An o tile's folded combine stages every partial (op_combine's staged path: one bulk copy a
# partial, one round trip) from the end of its x up to this: split_kv folds batch 1's combine
# only where all of P's partials fit (PassOptions.fold_partial_bytes); more took combine_direct,
# 13 us a task (NOTES v22)
FOLD_STAGE_TOP = PRE_OFF

# v2. The 227 KiB an H100/H200 CTA may have, less 12 KiB for the static variables (10 KiB in
# v1, padded to 1024; tests/backends/cuda/test_cuda_compile.py checks the sum).
CTA_SMEM_MAX = 227 << 10
STATIC_RESERVE = 12 << 10
# The ring: 16 pages of the largest item (2 rows x ring.py's 4 KiB segment), one a consumer
# warp, so 16 items are in flight as in v1's 16 warps' loads (10 pages, 80 KiB in flight, ran
# gate/up and down at ~26.5 GB/s an SM, v1 ~31: v21 call 4). It takes the top of what the CTA
# may have; the staging area below it is what is left: the attention sizes its chunk (cr) from
# it, and v2's combine stages its partials from the end of its x up to the ring (ops_simple.cuh).
RING_BYTES = 16 * 8192
RING_OFF = CTA_SMEM_MAX - STATIC_RESERVE - RING_BYTES
STAGE_BYTES_V2 = RING_OFF - STAGE_OFF
assert RING_OFF % 1024 == 0 and STAGE_BYTES_V2 > 0
SMEM_BYTES_V2 = RING_OFF + RING_BYTES

# A batch-1 GEMV's x (fp32) and its sums may run past the work area into the staging area
# below the preload (v1) or the ring (v2), whichever is lower: nothing lands there while a GEMV
# runs (the attention's and the combine's copies are waited for inside their own tasks; the
# preload and the ring lie above). So K up to ~21.5 K (Qwen2-7B's down projection, K 18944)
# runs where the work area alone stops at XS_MAX. Past it, bf16 x takes op_gemv_mma (x in
# windows, gemv_batch.py).
GEMV_X_MAX = min(PRE_OFF, RING_OFF) // 4
assert GEMV_X_MAX > XS_MAX


def cta_threads(kernel: str) -> int:
    """Threads a CTA of `kernel` ("v1" | "v2") launches with."""
    return NTHREADS + (PRODUCER_THREADS if kernel == "v2" else 0)


def smem_bytes(kernel: str) -> int:
    """Dynamic shared memory a CTA of `kernel` launches with."""
    return SMEM_BYTES_V2 if kernel == "v2" else SMEM_BYTES


def stage_bytes(kernel: str) -> int:
    """The staging area's bytes (AMK_STAGE_BYTES)."""
    return STAGE_BYTES_V2 if kernel == "v2" else STAGE_BYTES
