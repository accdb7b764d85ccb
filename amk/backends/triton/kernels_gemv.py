"""Triton micro-kernels: GEMV/GEMM tiles (fp and weight-only int8/int4/fp8) and DEQUANT.

Weight layout is torch nn.Linear ``[N, K]``; a tile computes output columns ``[n_off, n_end)``.
Quantized storage is the seed's: int8 ``[N, K]`` signed; int4 ``uint8 [N, ceil(K/2)]`` with the
low nibble = even column, stored as q+8; scales (and optional integer-valued zeros)
``[N, n_groups]``, column k uses group ``min(k // group, n_groups - 1)``; real = (q - z) * s.
The matvec multiplies elementwise and reduces with tl.sum (no tl.dot: decode is M=1, and the
interpreter gets bf16 dots wrong); fp32 accumulation, one cast on the store.
"""
from __future__ import annotations

import triton
import triton.language as tl

# Weight modes (constexpr): fp weights, int8 (or any already-unpacked integers), packed int4,
# fp8 E4M3 (its bytes, decoded here: the interpreter cannot load float8).
W_FP, W_INT, W_INT4, W_FP8 = 0, 1, 2, 3


@triton.jit
def dequant_block(w_ptr, s_ptr, z_ptr, rows, ks, mask, stride_w, stride_s, group, n_groups,
                  MODE: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """fp32 ``W[rows, ks]`` (a [BLOCK_N, BLOCK_K] block), dequantized per MODE."""
    if MODE == 2:
        byte = tl.load(w_ptr + rows[:, None] * stride_w + (ks[None, :] >> 1), mask=mask, other=0)
        nib = (byte.to(tl.int32) >> ((ks[None, :] & 1) * 4)) & 0xF
        q = nib.to(tl.float32) - 8.0
    elif MODE == 3:   # E4M3 bits: s eeee mmm = (8 + m) * 2^(e - 10), subnormal m * 2^-9 (exact)
        b = tl.load(w_ptr + rows[:, None] * stride_w + ks[None, :], mask=mask, other=0).to(tl.int32)
        e = (b >> 3) & 0xF
        m = (b & 7).to(tl.float32)
        q = tl.where(e == 0, m * 0.001953125, (m + 8.0) * tl.math.exp2((e - 10).to(tl.float32)))
        q = tl.where((b & 0x80) != 0, -q, q)
    else:
        q = tl.load(w_ptr + rows[:, None] * stride_w + ks[None, :], mask=mask, other=0)
        q = q.to(tl.float32)
    if MODE != 0:
        g = tl.minimum(ks // group, n_groups - 1)
        sg = rows[:, None] * stride_s + g[None, :]
        if HAS_ZEROS:
            q = q - tl.load(z_ptr + sg, mask=mask, other=0.0).to(tl.float32)
        q = q * tl.load(s_ptr + sg, mask=mask, other=0.0).to(tl.float32)
    return q


@triton.jit
def gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr,
                K, n_off, n_end, stride_x, stride_w, stride_s, stride_y, group, n_groups,
                MODE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for n in one BLOCK_N slice of the tile.
    Grid (cdiv(N_tile, BLOCK_N), M). Partial products stay in a [BLOCK_N, BLOCK_K] fp32
    accumulator and are reduced once at the end."""
    m = tl.program_id(1)
    rows = n_off + tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_end
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_ptr + m * stride_x + ks, mask=k_mask, other=0.0).to(tl.float32)
        w = dequant_block(w_ptr, s_ptr, z_ptr, rows, ks, row_mask[:, None] & k_mask[None, :],
                          stride_w, stride_s, group, n_groups, MODE, HAS_ZEROS)
        acc += w * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_y + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def dequant_kernel(w_ptr, s_ptr, z_ptr, y_ptr, N, K, stride_w, stride_s, group, n_groups,
                   MODE: tl.constexpr, HAS_ZEROS: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[N, K] = dequantized W, one [BLOCK_N, BLOCK_K] block per program."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < N)[:, None] & (ks < K)[None, :]
    w = dequant_block(w_ptr, s_ptr, z_ptr, rows, ks, mask, stride_w, stride_s, group, n_groups,
                      MODE, HAS_ZEROS)
    tl.store(y_ptr + rows[:, None] * K + ks[None, :], w.to(y_ptr.dtype.element_ty), mask=mask)
