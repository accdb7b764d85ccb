"""Triton micro-kernel: the GEMM tile of a prompt block (M >= 16 rows), on tensor cores.

y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for n in [n_off, n_end): one [BLOCK_M, BLOCK_N]
output block per program, tl.dot over BLOCK_K slices with an fp32 accumulator, one cast on the
store. Float weights only (a quantized tile keeps the GEMV kernel). Each weight block is read
once per BLOCK_M rows instead of once per row as the decode GEMV reads it.

The tile shape, warps and pipeline depth come from (M, N) (`gemm_config`): 128 x 128 x 64
blocks for a large bf16 GEMM, smaller ones where the large blocks would leave SMs idle. The
programs run in groups of GROUP_M row blocks that share a column block, so a weight block is
read from DRAM once and the few row blocks of a prompt chunk stay in L2.
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8


# bf16 / fp16 operands, largest first: the first whose grid fills the GPU is taken (a small
# GEMM is bound by its weight reads, which need many programs in flight)
_TILES = (GemmConfig(128, 128, 64, 8, 3), GemmConfig(128, 64, 64, 4, 4),
          GemmConfig(64, 64, 64, 4, 4), GemmConfig(64, 32, 64, 4, 4),
          GemmConfig(32, 64, 64, 4, 4), GemmConfig(32, 32, 64, 4, 4),
          GemmConfig(16, 64, 64, 4, 4), GemmConfig(16, 32, 64, 4, 4))
_FILL = 3 / 4          # a grid of at least this many programs per SM counts as filling the GPU


def gemm_config(M: int, N: int, K: int, upcast: bool, sms: int) -> GemmConfig:
    """The tiles of an [M, K] x [K, N] GEMM on a GPU of `sms` SMs. upcast (fp32 operands: ieee
    products, no tensor cores; or the CPU interpreter) keeps small tiles: fp32 blocks take
    twice the shared memory."""
    bk = max(16, min(32 if upcast else 64, triton.next_power_of_2(K)))
    if upcast:
        return GemmConfig(64 if M >= 64 else 16, 64, bk, 4, 2)
    fits = [c for c in _TILES if c.block_m <= max(M, 16)]      # no tile taller than M
    c = next((c for c in fits if triton.cdiv(M, c.block_m) * triton.cdiv(N, c.block_n)
              >= _FILL * sms), fits[-1])
    return GemmConfig(c.block_m, c.block_n, bk, c.num_warps, c.num_stages)


@triton.jit
def gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, K, n_off, n_end, stride_x, stride_w, stride_y,
                HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, EVEN_K: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr):
    """Grid (cdiv(M, BLOCK_M) * cdiv(n_end - n_off, BLOCK_N),), grouped: GROUP_M row blocks
    run next to each other on one column block. UPCAST: dot in fp32 (the interpreter gets bf16
    dots wrong), with ieee products: fp32 weights get fp32 arithmetic, not tf32's 10-bit
    mantissa. EVEN_K: K is a multiple of BLOCK_K (no mask on the K loads)."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(n_end - n_off, BLOCK_N)
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = n_off + cn
    m_mask = rm < M
    n_mask = rn < n_end
    # rows / columns past the edge load a valid row (wrapped) and are never stored: unmasked loads
    xm = rm % M
    wn = n_off + cn % (n_end - n_off)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + xm[:, None] * stride_x + ks[None, :]
    w_ptrs = w_ptr + wn[None, :] * stride_w + ks[:, None]                   # [K, N] view of W
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_mask = (k0 + ks) < K
            x = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
        if UPCAST:     # exact fp32 products: tl.dot's default for fp32 operands is tf32
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])
