"""Triton micro-kernel: causal attention of a prompt block (flash-style, on tensor cores).

q ``[R, n_heads, head_dim]`` (R query rows, row r at position pos[r]) over one sequence's
caches ``[max_seq, n_kv, head_dim]``, which already hold the block's own K/V rows (kv_update
runs first). One program takes BLOCK_M query rows and the ``rep = n_heads // n_kv`` q heads of
one kv head: its (row, head) pairs are the BLOCK_M * BLOCK_H rows of one Q tile, so every K/V
block is read once for all of them and both products are tl.dot. Row r sees cache rows
``[kv_start, kv_end) ∩ [0, pos[r]]`` (and only ``(pos[r] - window, pos[r]]`` with a sliding
window): each row by its own position, so the block's rows may come in any order.

Numerics: scores from the operands' own dtype with an fp32 accumulator (bf16 products are
exact in fp32), softmax in fp32 online over BLOCK_N cache rows at a time, and p @ v with p in
fp32 (tf32x3 on tensor cores: v in bf16 is exact in tf32, p keeps ~fp32 precision).
"""
from __future__ import annotations

import triton
import triton.language as tl

from amk.backends.triton.kernels_elementwise import tanh_f32


@triton.jit
def block_attention_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, o_ptr, R, head_dim, n_heads, rep,
                           max_seq, kv_start, kv_end, g_off, scale, window, softcap, stride_cs,
                           UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (cdiv(R, BLOCK_M), kv groups). UPCAST: fp32 operands with ieee products (fp32
    caches, and the CPU interpreter, whose bf16 dot is wrong)."""
    g = g_off + tl.program_id(1)
    i = tl.arange(0, BLOCK_M * BLOCK_H)            # the Q tile's rows: (query row, head) pairs
    r = tl.program_id(0) * BLOCK_M + i // BLOCK_H
    head = g * rep + i % BLOCK_H
    valid = (r < R) & (i % BLOCK_H < rep)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    q_off = (r[:, None] * n_heads + head[:, None]) * head_dim + d[None, :]
    qd_mask = valid[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + q_off, mask=qd_mask, other=0.0)
    p_row = tl.load(pos_ptr + r, mask=valid, other=-1).to(tl.int32)     # -1: sees no row
    hi_row = tl.minimum(tl.minimum(kv_end, max_seq), p_row + 1)         # exclusive
    lo_row = tl.full([BLOCK_M * BLOCK_H], 0, tl.int32) + kv_start
    if window > 0:
        lo_row = tl.maximum(lo_row, p_row + 1 - window)
    lo = tl.min(tl.where(valid, lo_row, max_seq), axis=0)
    hi = tl.max(tl.where(valid, hi_row, 0), axis=0)
    lo = (lo // BLOCK_N) * BLOCK_N                 # aligned blocks
    m_i = tl.full([BLOCK_M * BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_H, BLOCK_D], dtype=tl.float32)
    if UPCAST:
        q = q.to(tl.float32)
    kv_base = g * head_dim
    for s0 in range(lo, hi, BLOCK_N):
        n = s0 + tl.arange(0, BLOCK_N)
        nd = kv_base + n[:, None] * stride_cs + d[None, :]
        nd_mask = (n < max_seq)[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + nd, mask=nd_mask, other=0.0)                 # [N, D]
        if UPCAST:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        s = s * scale
        if softcap > 0:
            s = tanh_f32(s / softcap) * softcap
        seen = (n[None, :] >= lo_row[:, None]) & (n[None, :] < hi_row[:, None])
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)           # a row seeing nothing yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        v = tl.load(v_ptr + nd, mask=nd_mask, other=0.0).to(tl.float32)
        if UPCAST:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p, v, input_precision="tf32x3")
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + q_off, out.to(o_ptr.dtype.element_ty), mask=qd_mask)
