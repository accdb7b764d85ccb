"""The megakernel's CTA: its threads and its dynamic shared-memory layout, in one place (the
lowering sizes tiles against it, codegen renders it as AMK_* defines, the runtime launches
with it).

One CTA an SM, 512 threads, 212 KiB:
    [0, STAGE_OFF)           work area: x staged as fp32 (XS_MAX floats), sums, the attention
    [STAGE_OFF, SMEM_BYTES)  staging area: the combine's partials and the attention's K/V chunks
    [PRE_OFF, SMEM_BYTES)    a GEMV tile's preloaded rows (the top 64 KiB; preload.py)
    [x's end, PRE_OFF)       an o tile's folded combine: its partials, staged from the end of
                             its x (1024-aligned) up to the preload (FOLD_STAGE_TOP)
"""
from __future__ import annotations

NTHREADS = 512                   # threads of the one persistent CTA an SM
NWARPS = NTHREADS // 32
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

# A batch-1 GEMV's x (fp32) and its sums may run past the work area into the staging area
# below the preload: nothing lands there while a GEMV runs (the attention's and the combine's
# copies are waited for inside their own tasks; the preload lies above). So K up to ~21.5 K
# (Qwen2-7B's down projection, K 18944) runs where the work area alone stops at XS_MAX. Past it,
# bf16 x takes op_gemv_mma (x in windows, gemv_batch.py). The bound is the deleted kernel v2's
# (its weight ring began there, 87 KiB in: NOTES v57), kept so that every GEMV keeps its path.
GEMV_X_MAX = (87 << 10) // 4
assert GEMV_X_MAX > XS_MAX

