"""Triton micro-kernels: decode attention (GQA, split-KV partials) and the split-KV combine.

Layouts (docs/PROGRAM.md): q ``[B, n_heads, head_dim]``, caches ``[B, max_seq, n_kv, head_dim]``
(B = 1 and batch stride 0 for a single-sequence cache). One program handles one kv head and
its ``rep = n_heads // n_kv`` q heads, so each K/V row is read once per group. The window is
``[kv_start, kv_start+kv_len) ∩ [0, pos+1)`` with pos read from a device tensor at run time (a
split-KV shard takes its piece of that live window), so a captured CUDA graph stays valid for
every decode step.
"""
from __future__ import annotations

import triton
import triton.language as tl

from amk.backends.triton.kernels_elementwise import tanh_f32


@triton.jit
def attention_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, o_ptr,
                     head_dim, n_heads, rep, max_seq, kv_start, kv_end, g_off, scale,
                     window, softcap, stride_cb, stride_cs, split_len, stride_split, kv_shard,
                     kv_shards, shard_rows, pos_step,
                     HAS_POS: tl.constexpr, PARTIAL: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (kv groups, B, splits). Online softmax over BLOCK_N cache rows at a time, fp32
    throughout. Split s covers rows [kv_start + s*split_len, +split_len) of the window and
    writes at o_ptr + s*stride_split (one split: the whole window). PARTIAL writes
    ``[acc | m | l]`` per head (row width head_dim+2); an empty window leaves acc=0, m=-inf,
    l=0. Otherwise writes acc / l (0 for an empty window). window > 0: only rows
    (pos - window, pos] (a sliding window); softcap > 0: scores -> softcap tanh(s / softcap).
    A prompt block (pos_step 1, cache batch stride 0): program b is query row b at position
    pos[b] over the one cache, so the window ends at pos[b] (causal); decode has pos_step 0
    (one position for every row). shard_rows > 0 (AMK's live count, regions.kv_window): the
    live window is split over live_shards(...) <= kv_shards shards; a shard past them stores
    nothing."""
    g = g_off + tl.program_id(0)
    b = tl.program_id(1)
    sid = tl.program_id(2)
    o_ptr = o_ptr + sid * stride_split
    hi = tl.minimum(kv_end, max_seq)               # the live window (regions.kv_window) ...
    if HAS_POS:
        p_now = tl.load(pos_ptr + b * pos_step).to(tl.int32)
        hi = tl.minimum(hi, p_now + 1)
        if window > 0:
            kv_start = tl.maximum(kv_start, p_now + 1 - window)
    hi = tl.maximum(hi, kv_start)
    live = _live_shards(hi - kv_start, kv_shards, shard_rows)   # ... its live shards ...
    alive = kv_shard < live
    size = (hi - kv_start + live - 1) // live                   # ... a split-KV shard's piece of it
    kv_start = kv_start + kv_shard * size
    hi = tl.minimum(hi, kv_start + size)
    hi = tl.where(alive, hi, kv_start)                          # not live: no rows ...
    kv_start = kv_start + sid * split_len          # ... and this program's split of that
    hi = tl.minimum(hi, kv_start + split_len)
    heads = g * rep + tl.arange(0, BLOCK_H)
    h_mask = heads < tl.where(alive, (g + 1) * rep, 0)         # ... and no heads: no stores
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    hd_mask = h_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + (b * n_heads + heads[:, None]) * head_dim + d[None, :], mask=hd_mask,
                other=0.0).to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    kv_base = b * stride_cb + g * head_dim
    for s0 in range(kv_start, hi, BLOCK_N):
        n = s0 + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        nd = kv_base + n[:, None] * stride_cs + d[None, :]
        nd_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + nd, mask=nd_mask, other=0.0).to(tl.float32)       # [N, D]
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale             # [H, N]
        if softcap > 0:
            s = tanh_f32(s / softcap) * softcap
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        v = tl.load(v_ptr + nd, mask=nd_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    if PARTIAL:
        row = o_ptr + (b * n_heads + heads) * (head_dim + 2)
        tl.store(row[:, None] + d[None, :], acc.to(o_ptr.dtype.element_ty), mask=hd_mask)
        tl.store(row + head_dim, m_i.to(o_ptr.dtype.element_ty), mask=h_mask)
        tl.store(row + head_dim + 1, l_i.to(o_ptr.dtype.element_ty), mask=h_mask)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + (b * n_heads + heads[:, None]) * head_dim + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=hd_mask)


@triton.jit
def _live_shards(rows, shards, shard_rows):
    """regions.live_shards: shards of at least shard_rows rows, 1..shards (0: every shard)."""
    by_rows = tl.minimum(tl.maximum(rows // tl.maximum(shard_rows, 1), 1), shards)
    return tl.where(shard_rows > 0, by_rows, shards)


@triton.jit
def _combine_live(pos_ptr, b, pos_step, num, shard_rows, kv_start, kv_end, window):
    """regions.combine_live: the partials row b merges (its shards' live count, from pos; pos
    is not read when shard_rows is 0)."""
    p_now = tl.load(pos_ptr + b * pos_step, mask=shard_rows > 0, other=0).to(tl.int32)
    hi = tl.minimum(kv_end, p_now + 1)
    lo = tl.where(window > 0, tl.maximum(kv_start, p_now + 1 - window), kv_start)
    return _live_shards(tl.maximum(hi, lo) - lo, num, shard_rows)


@triton.jit
def _part(i: tl.constexpr, p0, p1, p2, p3, p4, p5, p6, p7):
    """The i-th partial pointer (i is a compile-time constant, so this folds away)."""
    if i == 0:
        return p0
    elif i == 1:
        return p1
    elif i == 2:
        return p2
    elif i == 3:
        return p3
    elif i == 4:
        return p4
    elif i == 5:
        return p5
    elif i == 6:
        return p6
    else:
        return p7


@triton.jit
def combine_kernel(o_ptr, p0, p1, p2, p3, p4, p5, p6, p7, head_dim, n_heads, h_off,
                   pos_ptr, pos_step, shard_rows, kv_start, kv_end, window,
                   NUM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (h_count, B): merge NUM (<= 8) partials [acc | m | l] of one head. The reference's
    order: m = max_p m_p, then l and acc summed over p in order with weight e^(m_p - m), a shard
    with l_p == 0 getting weight exactly 0; out = acc / max(l, 1e-20). shard_rows > 0: only
    the first _combine_live(...) partials are read (the live shards')."""
    h = h_off + tl.program_id(0)
    b = tl.program_id(1)
    live = _combine_live(pos_ptr, b, pos_step, NUM, shard_rows, kv_start, kv_end, window)
    row = (b * n_heads + h) * (head_dim + 2)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    m = tl.load(p0 + row + head_dim).to(tl.float32)
    for i in tl.static_range(1, NUM):
        m = tl.maximum(m, tl.load(_part(i, p0, p1, p2, p3, p4, p5, p6, p7) + row + head_dim,
                                  mask=i < live, other=float("-inf")).to(tl.float32))
    l = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in tl.static_range(0, NUM):
        p = _part(i, p0, p1, p2, p3, p4, p5, p6, p7)
        mp = tl.load(p + row + head_dim, mask=i < live, other=float("-inf")).to(tl.float32)
        lp = tl.load(p + row + head_dim + 1, mask=i < live, other=0.0).to(tl.float32)
        w = tl.where(lp > 0, tl.exp(mp - m), 0.0)
        l = l + lp * w
        acc = acc + tl.load(p + row + d, mask=d < tl.where(i < live, head_dim, 0),
                            other=0.0).to(tl.float32) * w
    out = acc / tl.maximum(l, 1e-20)
    tl.store(o_ptr + (b * n_heads + h) * head_dim + d, out.to(o_ptr.dtype.element_ty),
             mask=d_mask)


@triton.jit
def combine_stacked_kernel(o_ptr, parts_ptr, P, part_stride, head_dim, n_heads, h_off,
                           pos_ptr, pos_step, shard_rows, kv_start, kv_end, window,
                           BLOCK_D: tl.constexpr):
    """combine_kernel for any number of partials stacked in one tensor [P, ...] (more than 8
    shards); same order of operations. l is kept lane-wise (every lane holds the same value)."""
    h = h_off + tl.program_id(0)
    b = tl.program_id(1)
    P = _combine_live(pos_ptr, b, pos_step, P, shard_rows, kv_start, kv_end, window)
    row = (b * n_heads + h) * (head_dim + 2)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    zero = tl.zeros([BLOCK_D], dtype=tl.float32)
    m = zero + tl.load(parts_ptr + row + head_dim).to(tl.float32)
    for i in range(1, P):
        m = tl.maximum(m, tl.load(parts_ptr + i * part_stride + row + head_dim).to(tl.float32))
    l = zero
    acc = zero
    for i in range(0, P):
        p = parts_ptr + i * part_stride + row
        mp = tl.load(p + head_dim).to(tl.float32)
        lp = tl.load(p + head_dim + 1).to(tl.float32)
        w = tl.where(lp > 0, tl.exp(mp - m), 0.0)
        l = l + lp * w
        acc = acc + tl.load(p + d, mask=d_mask, other=0.0).to(tl.float32) * w
    out = acc / tl.maximum(l, 1e-20)
    tl.store(o_ptr + (b * n_heads + h) * head_dim + d, out.to(o_ptr.dtype.element_ty),
             mask=d_mask)
