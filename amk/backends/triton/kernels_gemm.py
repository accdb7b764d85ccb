"""Triton micro-kernel: the GEMM tile of a prompt block (M >= 16 rows), on tensor cores.

y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for n in [n_off, n_end): one [BLOCK_M, BLOCK_N]
output block per program, tl.dot over BLOCK_K slices with an fp32 accumulator, one cast on the
store. Float weights only (a quantized tile keeps the GEMV kernel). Each weight block is read
once per BLOCK_M rows instead of once per row as the decode GEMV reads it.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, K, n_off, n_end, stride_x, stride_w, stride_y,
                HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (cdiv(M, BLOCK_M), cdiv(n_end - n_off, BLOCK_N)). UPCAST: dot in fp32 (the
    interpreter gets bf16 dots wrong), with ieee products: fp32 weights get fp32 arithmetic, not
    tf32's 10-bit mantissa."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = n_off + tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < n_end
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_ptr + rm[:, None] * stride_x + ks[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + rn[None, :] * stride_w + ks[:, None],
                    mask=n_mask[None, :] & k_mask[:, None], other=0.0)     # [K, N] view of W
        if UPCAST:     # exact fp32 products: tl.dot's default for fp32 operands is tf32
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])
