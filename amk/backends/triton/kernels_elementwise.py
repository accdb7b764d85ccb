"""Triton micro-kernels: column-tiled elementwise ops, the shard sum, norms and softmax.

Every kernel loads in the storage dtype, computes in fp32 and casts once on the store, the
numerics docs/PROGRAM.md fixes. Tensors are dense row-major; a 2-D ``[rows, cols]`` view is
passed as (pointer, row stride). Only triton.language APIs present in triton 3.2 are used.
"""
from __future__ import annotations

import triton
import triton.language as tl

# Elementwise opcodes of `elementwise_kernel` (a constexpr: each gets its own compiled kernel).
EW_COPY, EW_ADD, EW_MUL, EW_SCALE, EW_GELU, EW_SILU_MUL = 0, 1, 2, 3, 4, 5
EW_GELU_TANH, EW_SOFTCAP = 6, 7


@triton.jit
def tanh_f32(x):
    """tanh from exp (triton 3.2's tl.math has no tanh): sign(x) (1 - e^-2|x|) / (1 + e^-2|x|)."""
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def elementwise_kernel(a_ptr, b_ptr, y_ptr, n_off, n_end, stride_a, stride_b, stride_y, scale,
                       a_shift, OP: tl.constexpr, BLOCK: tl.constexpr):
    """y[r, c] = OP(a[r, c + a_shift], b[r, c]) for columns c in [n_off, n_end). Grid (col
    blocks, rows). A row stride of 0 broadcasts a one-row operand over all rows; a_shift moves
    columns (COPY's x_off: slice / concat)."""
    r = tl.program_id(1)
    cols = n_off + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_end
    a = tl.load(a_ptr + r * stride_a + cols + a_shift, mask=mask, other=0.0)
    if OP == 0:                      # COPY: a plain cast, no fp32 detour
        y = a
    else:
        a = a.to(tl.float32)
        if OP == 1:
            y = a + tl.load(b_ptr + r * stride_b + cols, mask=mask, other=0.0).to(tl.float32)
        elif OP == 2:
            y = a * tl.load(b_ptr + r * stride_b + cols, mask=mask, other=0.0).to(tl.float32)
        elif OP == 3:
            y = a * scale
        elif OP == 4:                # exact gelu: 0.5 x (1 + erf(x / sqrt 2))
            y = 0.5 * a * (1.0 + tl.math.erf(a * 0.7071067811865476))
        elif OP == 6:                # tanh gelu: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
            y = 0.5 * a * (1.0 + tanh_f32(0.7978845608028654 * (a + 0.044715 * a * a * a)))
        elif OP == 7:                # soft-cap: cap tanh(x / cap), cap in `scale`
            y = tanh_f32(a / scale) * scale
        else:                        # silu(gate) * up
            u = tl.load(b_ptr + r * stride_b + cols, mask=mask, other=0.0).to(tl.float32)
            y = a / (1.0 + tl.exp(-a)) * u
    tl.store(y_ptr + r * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def shard_sum_kernel(y_ptr, x0_ptr, x1_ptr, x2_ptr, x3_ptr, n,
                     NUM: tl.constexpr, BLOCK: tl.constexpr):
    """y = ((x0 + x1) + x2) + x3 in fp32 (NUM of them, left to right, the reference's order)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.load(x0_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if NUM > 1:
        acc += tl.load(x1_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if NUM > 2:
        acc += tl.load(x2_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if NUM > 3:
        acc += tl.load(x3_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rmsnorm_kernel(x_ptr, w_ptr, y_ptr, H, eps, BLOCK: tl.constexpr):
    """One program per row of H: y = x * rsqrt(mean(x^2) + eps) * w."""
    row = tl.program_id(0)
    x_row = x_ptr + row * H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, H, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < H, other=0.0).to(tl.float32)
        acc += x * x
    rms = tl.math.rsqrt(tl.sum(acc, axis=0) / H + eps)
    for k in range(0, H, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        mask = offs < H
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * H + offs, (x * rms * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def layernorm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, H, eps,
                     HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row of H: (x - mean) * rsqrt(var + eps) * w (+ b), biased variance."""
    row = tl.program_id(0)
    x_row = x_ptr + row * H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, H, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        acc += tl.load(x_row + offs, mask=offs < H, other=0.0).to(tl.float32)
    mean = tl.sum(acc, axis=0) / H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, H, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        mask = offs < H
        d = tl.where(mask, tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32) - mean, 0.0)
        acc += d * d
    rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / H + eps)
    for k in range(0, H, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        mask = offs < H
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        y = (x - mean) * rstd * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * H + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def softmax_kernel(x_ptr, y_ptr, C, BLOCK: tl.constexpr):
    """One program per row of C: a running (max, sum) pass, then the normalised write."""
    row = tl.program_id(0)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, C, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * C + offs, mask=offs < C, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # lanes still at -inf keep s = 0 (never exp(-inf - -inf))
        s = tl.where(m_new == float("-inf"), 0.0, s * tl.exp(m - m_new) + tl.exp(x - m_new))
        m = m_new
    m_row = tl.max(m, axis=0)
    s_row = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - m_row)), axis=0)
    for k in range(0, C, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        mask = offs < C
        x = tl.load(x_ptr + row * C + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.exp(x - m_row) / s_row
        tl.store(y_ptr + row * C + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
