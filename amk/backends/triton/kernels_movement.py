"""Triton micro-kernels: rotary embedding, embedding lookup, greedy argmax and the KV append.

Positions and token ids are read from device tensors inside the kernels (never passed as host
ints), so one captured CUDA graph serves every decode step.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rope_kernel(x_ptr, pos_ptr, f_ptr, y_ptr, C, n_off, n_end, head_dim, per_pos,
                BLOCK: tl.constexpr):
    """Rotate-half rope on x viewed as [rows, C], columns [n_off, n_end) (whole heads).
    Element (r, c) uses pos[(r*C + c) // per_pos] (per_pos = numel / len(pos)) and
    inv_freq[(c % head_dim) % half]. Grid (col blocks, rows)."""
    r = tl.program_id(1)
    cols = n_off + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_end
    half = head_dim // 2
    dd = cols % head_dim
    first = dd < half
    partner = tl.where(first, cols + half, cols - half)
    x = tl.load(x_ptr + r * C + cols, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + r * C + partner, mask=mask, other=0.0).to(tl.float32)
    pos = tl.load(pos_ptr + (r * C + cols) // per_pos, mask=mask, other=0).to(tl.float32)
    ang = pos * tl.load(f_ptr + dd % half, mask=mask, other=0.0).to(tl.float32)
    c = tl.cos(ang)
    s = tl.sin(ang)
    # first half: x1*c - x2*s ; second half: x2*c + x1*s
    y = tl.where(first, x * c - xp * s, x * c + xp * s)
    tl.store(y_ptr + r * C + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def embed_kernel(ids_ptr, table_ptr, y_ptr, H, BLOCK: tl.constexpr):
    """y[b, :] = table[ids[b], :]. Grid (col blocks, B)."""
    b = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    tok = tl.load(ids_ptr + b).to(tl.int64)
    row = tl.load(table_ptr + tok * H + cols, mask=mask, other=0.0)
    tl.store(y_ptr + b * H + cols, row.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def argmax_kernel(x_ptr, y_ptr, V, BLOCK: tl.constexpr):
    """y[b] = first index of the max of x[b, :V]. Each lane keeps its own first max (strict >),
    then the smallest index among lanes holding the row max wins. Grid (B,)."""
    b = tl.program_id(0)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], dtype=tl.int32)
    for k in range(0, V, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + b * V + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        upd = x > best
        best = tl.where(upd, x, best)
        best_i = tl.where(upd, offs, best_i)
    m = tl.max(best, axis=0)
    idx = tl.min(tl.where(best == m, best_i, 2147483647), axis=0)
    tl.store(y_ptr + b, idx.to(y_ptr.dtype.element_ty))


@triton.jit
def kv_append_kernel(new_ptr, pos_ptr, cache_ptr, pos_value, D, n, max_seq, pos_step,
                     HAS_POS: tl.constexpr, BLOCK: tl.constexpr):
    """cache[b, pos + j, :] = new[b, j, :] for the n new rows of each of B sequences (rows of D
    elements). Grid (col blocks, B*n). Rows past max_seq are not written (the host cannot check
    a device-side position without a sync; the reference VM reports it)."""
    r = tl.program_id(1)
    b = r // n
    j = r % n
    if HAS_POS:   # pos_step 1: a prompt block, row j at pos[j]; 0: rows from pos[0] on
        pos = tl.load(pos_ptr + j * pos_step).to(tl.int32) + j * (1 - pos_step)
    else:
        pos = pos_value + j
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    dst_row = tl.zeros([BLOCK], dtype=tl.int32) + pos           # a vector: one mask dtype
    mask = (cols < D) & (dst_row < max_seq) & (dst_row >= 0)
    x = tl.load(new_ptr + r * D + cols, mask=mask, other=0.0)
    dst = cache_ptr + (b * max_seq + dst_row).to(tl.int64) * D + cols
    tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)
