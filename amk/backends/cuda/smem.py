"""The megakernel's CTA: its threads and its dynamic shared-memory layout, in one place (the
lowering sizes tiles against it, codegen renders it as AMK_* defines, the runtime launches
with it).

One CTA an SM, 512 threads, 196 KiB:
    [0, STAGE_OFF)           work area: x staged as fp32 (XS_MAX floats), sums, the attention
    [STAGE_OFF, SMEM_BYTES)  staging area: the combine's partials and the attention's K/V chunks
    [PRE_OFF, SMEM_BYTES)    the o tile's preloaded rows (the top 64 KiB; preload.py)
"""
from __future__ import annotations

NTHREADS = 512                   # threads of the one persistent CTA an SM
XS_MAX = 16384                   # floats of x a GEMV stages in shared memory (64 KiB); K must fit
GEMV_SMEM = XS_MAX * 4           # the work area that holds them
ATTN_SMEM = (8 * 256 + 8 * NTHREADS + 8 * NTHREADS) * 4
STAGE_OFF = max(GEMV_SMEM, ATTN_SMEM)
STAGE_BYTES = 128 << 10
# 4 KiB more at the top (the deleted weight stream's window; the preload's 64 KiB cover it): the
# 196 KiB of the 227 KiB a CTA may have that every measured version ran with
SMEM_BYTES = STAGE_OFF + STAGE_BYTES + 4096
PRE_OFF = SMEM_BYTES - 65536     # preload.py's o-tile rows: the top 64 KiB
