"""The megakernel's CTA: its threads and its dynamic shared-memory layout, in one place (the
lowering sizes tiles against it, codegen renders it as AMK_* defines, the runtime launches
with it).

One CTA an SM, 512 threads, 196 KiB:
    [0, RING_OFF)          work area: x staged as fp32 (XS_MAX floats), sums, the attention
    [RING_OFF, WIN_OFF)    the weight stream's stages or the pipe's (free by default: the
                           combine's partials and the attention's K/V chunks use it)
    [WIN_OFF, SMEM_BYTES)  the weight stream's window of chunk descriptors
    [PRE_OFF, SMEM_BYTES)  the o tile's preloaded rows (the top 64 KiB, when the ring is free)
"""
from __future__ import annotations

THREADS_PER_SM = 512             # split over AMK_CTAS_PER_SM persistent CTAs (launch_shape)
NTHREADS = THREADS_PER_SM        # one CTA per SM (the default)
XS_MAX = 16384                   # floats of x a GEMV stages in shared memory (64 KiB); K must fit
GEMV_SMEM = XS_MAX * 4           # the work area that holds them
ATTN_SMEM = (8 * 256 + 8 * NTHREADS + 8 * NTHREADS) * 4
RING_OFF = max(GEMV_SMEM, ATTN_SMEM)   # then the weight stream's stages or the pipe's
RING_BYTES = 131072              # smem of the weight stream's stages (knobs.gemv_ring_shape) or the pipe's
STREAM_WIN = 128                 # stream entries per half of the smem window (16 B each)
WIN_OFF = RING_OFF + RING_BYTES
SMEM_BYTES = WIN_OFF + 2 * STREAM_WIN * 16        # 196 KiB of the 227 KiB a CTA may have
PRE_OFF = SMEM_BYTES - 65536     # lower._preload's o-tile rows: the top 64 KiB (ring area free)


def launch_shape(ctas_per_sm: int) -> tuple[int, int]:
    """(threads, dynamic smem bytes) of one CTA when `ctas_per_sm` share an SM. One CTA keeps
    the 196 KiB layout (work area + weight-stream ring); two get 256 threads (8 warps: the
    attention's 8 heads a pass still have a warp each) and only the 64 KiB work area below
    AMK_RING_OFF (x staging, attention), so both fit in the SM's 228 KiB."""
    if ctas_per_sm == 1:
        return NTHREADS, SMEM_BYTES
    return THREADS_PER_SM // ctas_per_sm, RING_OFF
