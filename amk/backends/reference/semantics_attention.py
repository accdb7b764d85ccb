"""Reference semantics of attention, the split-KV combine, rotary embedding and the KV cache.

Layouts (docs/PROGRAM.md): q is ``[B?, n_heads*head_dim]`` (any shape with that numel), a
cache is ``[max_seq, n_kv, head_dim]`` / ``[max_seq, n_kv*head_dim]`` for one sequence or
``[B, max_seq, n_kv, head_dim]`` for B sequences that share the decode position. The position
is a runtime int32 ``[1]`` input (**ext**); the seed's ``params['pos']`` still works for
KV_APPEND. GQA: q head h reads kv head ``h // (n_heads // n_kv_heads)``.
"""
from __future__ import annotations

import functools

import torch

from amk.errors import TraceError, ValidationError
from amk.backends.reference.semantics_common import column_range, f32, host_int
from amk.program.regions import (NEW_KV, PARTIAL_WRITE,   # the ATTENTION_TILE flags bits
                                 combine_live, combine_partials, kv_window, seq_range)


def _cache_view(c: torch.Tensor, n_kv: int, head_dim: int) -> torch.Tensor:
    """A cache as ``[B, max_seq, n_kv, head_dim]`` (B = 1 for a single-sequence cache)."""
    if c.dim() == 4:
        lead = tuple(c.shape[:2])
    elif c.dim() == 3 and c.shape[-2:] == (n_kv, head_dim):
        lead = (1, c.shape[0])
    else:
        lead = (1, c.numel() // (n_kv * head_dim))
    return c.view(*lead, n_kv, head_dim)


def _head_range(params, n_heads: int, rep: int) -> tuple[int, int]:
    """q heads ``[h_off, h_off+h_count)`` this task covers (ext); whole kv groups only."""
    h_off = int(params.get("h_off", 0))
    h_count = int(params.get("h_count", n_heads - h_off))
    if not (0 <= h_off and h_count >= 0 and h_off + h_count <= n_heads
            and h_off % rep == 0 and h_count % rep == 0):
        raise ValidationError(
            f"attention head range h_off={h_off}, h_count={h_count} must lie in [0, {n_heads}) "
            f"and cover whole kv groups of {rep} q heads")
    return h_off, h_count


def own_sequences(inputs, outputs, params):
    """(inputs, outputs, params) of an ATTENTION_TILE restricted to its b_off/b_count rows:
    views of those rows of q, the output, a pos per row, k_new / v_new and a cache per row,
    and the params without b_off/b_count (the triton backend runs its kernels on them too)."""
    hd, n_heads = int(params["head_dim"]), int(params["n_heads"])
    R = inputs[0].numel() // (n_heads * hd)
    b0, b1 = seq_range(params, R)
    if not 0 <= b0 < b1 <= R:
        raise ValidationError(f"attention: sequences [{b0}, {b1}) are not in the {R} query rows")

    def rows(t):
        return None if t is None else t.reshape(R, -1)[b0:b1]

    def cache(t):
        return t[b0:b1] if t.dim() == 4 and t.shape[0] == R else t

    ins = [rows(inputs[0]), cache(inputs[1]), cache(inputs[2])]
    if len(inputs) > 3:
        p = inputs[3]
        ins.append(p.reshape(-1)[b0:b1] if p is not None and p.numel() > 1 else p)
        ins += [rows(t) for t in inputs[4:]]
    rest = {k: v for k, v in params.items() if k not in ("b_off", "b_count")}
    return ins, [rows(outputs[0])], rest


def attention_tile(inputs, outputs, params, ctx):
    """softmax(q.k^T * scale).v over cache rows [kv_start, kv_start+kv_len) ∩ [0, pos+1), or
    shard kv_shard of L equal pieces of that live window (regions.kv_window). The seed splits
    into kv_shards pieces; AMK's live count (ext, kv_shard_rows R > 0) enters here: L =
    clamp(live rows // R, 1, kv_shards), and a shard >= L writes nothing (its partial is stale:
    the combine does not read it).

    inputs = [q, k_cache, v_cache, pos?]. flags bit 1 (PARTIAL_WRITE): out is the split-KV flash
    partial ``[B?, n_heads, head_dim+2] = [acc | m | l]`` (un-normalised acc = sum exp(s-m) v);
    an empty window writes acc=0, m=-inf, l=0. Only heads [h_off, h_off+h_count) are written.
    flags bit 2 (NEW_KV, ext): inputs = [q, k_cache, v_cache, pos, k_new, v_new] and cache row
    pos is read as k_new / v_new (``[B?, n_kv*head_dim]``, cast to the caches' dtypes): the
    step's KV_APPEND may then run after the attention (passes/defer_kv_append.py); with a
    position per sequence (a cache per row) sequence b's row pos[b].
    b_off/b_count (ext, split_kv's batched tasks): only query rows (sequences) [b_off,
    b_off+b_count) are computed and written, each with its own cache (a cache per row), its
    own position (a pos per row) and its own new k/v rows (regions.seq_range)."""
    if "b_off" in params or "b_count" in params:
        inputs, outputs, params = own_sequences(inputs, outputs, params)
    hd = int(params["head_dim"])
    q_in = inputs[0]
    n_heads = int(params.get("n_heads", q_in.shape[-2] if q_in.dim() >= 2 and q_in.shape[-1] == hd
                             else q_in.shape[-1] // hd))
    n_kv = int(params.get("n_kv_heads", n_heads))
    if n_kv <= 0 or n_heads % n_kv:
        raise ValidationError(f"attention: n_heads={n_heads} is not a multiple of n_kv_heads={n_kv}")
    rep = n_heads // n_kv
    k = _cache_view(inputs[1], n_kv, hd)
    v = _cache_view(inputs[2], n_kv, hd)
    B, max_seq = k.shape[0], k.shape[1]
    R = q_in.numel() // (n_heads * hd)          # query rows: B sequences, or a T-token block
    q = q_in.reshape(R, n_heads, hd)
    h_off, hc = _head_range(params, n_heads, rep)
    g0, g1 = h_off // rep, (h_off + hc) // rep
    scale = float(params.get("scale", 1.0 / hd ** 0.5))
    pos = inputs[3] if len(inputs) > 3 and inputs[3] is not None else None
    block = pos is not None and pos.numel() > 1   # ext: row r is at position pos[r]: rows of
    if block and (B not in (1, R) or pos.numel() != R):   # one cache, or sequence r in cache r
        raise ValidationError(f"attention: {R} query rows with {pos.numel()} positions need one "
                              f"position per row and a single-sequence cache or one cache per "
                              f"row, got a cache of {B} sequences")

    kv_start = int(params.get("kv_start", 0))
    window = (kv_start, int(params.get("kv_len", max_seq - kv_start)), max_seq)
    shard = (int(params.get("kv_shard", 0)), int(params.get("kv_shards", 1)))
    sliding = int(params.get("window", 0))                            # ext: a sliding window
    shard_rows = int(params.get("kv_shard_rows", 0))                  # ext: the live count
    live_rows = None                                                  # block: rows whose shard is live
    if block:        # each row its own live window (its shard of it): rows <= pos[r]
        rows = [kv_window(*window, int(p), *shard, sliding, shard_rows) for p in pos.reshape(-1).tolist()]
        live_rows = torch.tensor([r is not None for r in rows], device=q_in.device)
        if not bool(live_rows.any()):
            return
        rows = [r if r is not None else (0, 0) for r in rows]
        row_lo = torch.tensor([a for a, _ in rows], device=q_in.device)
        row_hi = torch.tensor([b for _, b in rows], device=q_in.device)
        lo, hi = int(row_lo.min()), max(int(row_lo.min()), int(row_hi.max()))
    else:
        rows = kv_window(*window, host_int(pos, ctx) if pos is not None else None, *shard,
                         sliding, shard_rows)
        if rows is None:                                              # not a live shard
            return
        lo, hi = rows

    qg = f32(q[:, h_off:h_off + hc]).reshape(R, g1 - g0, rep, hd)     # [R, G, rep, hd]
    kw = f32(k[:, lo:hi, g0:g1]).permute(0, 2, 1, 3)                  # [B, G, L, hd]
    vw = f32(v[:, lo:hi, g0:g1]).permute(0, 2, 1, 3)
    if int(params.get("flags", 0)) & NEW_KV:
        if block and B != R:
            raise ValidationError("attention: flags NEW_KV (one new row per sequence) does not "
                                  "apply to a block of positions; append the block first")
        # sequence b's new row is its cache row pos (pos[b]: each sequence at its own, ext)
        ps = [int(p) for p in pos.reshape(-1).tolist()] if block else [host_int(pos, ctx)] * B
        for w, new, cache in ((kw, inputs[4], k), (vw, inputs[5], v)):
            row = new.reshape(B, n_kv, hd).to(cache.dtype)[:, g0:g1]
            for b, p in enumerate(ps):
                if lo <= p < hi:                                      # the new row is in the window
                    w[b, :, p - lo] = f32(row[b])
    scores = (qg @ kw.transpose(-1, -2)) * scale                      # [R, G, rep, L]
    cap = float(params.get("softcap", 0.0))
    if cap > 0:                                                       # ext: Gemma 2's soft-cap
        scores = torch.tanh(scores / cap) * cap
    empty = None
    if block:                                  # causal: row r sees only its own window
        keys = torch.arange(lo, hi, device=scores.device)
        outside = (keys[None, :] < row_lo[:, None]) | (keys[None, :] >= row_hi[:, None])
        scores = scores.masked_fill(outside[:, None, None, :], float("-inf"))
        empty = row_hi <= row_lo               # rows whose window is empty: [R]

    out = outputs[0]
    if int(params.get("flags", 0)) & PARTIAL_WRITE:
        ob = out.view(R, n_heads, hd + 2)[:, h_off:h_off + hc]
        part = torch.empty(R, hc, hd + 2, dtype=torch.float32, device=out.device)
        if hi == lo:
            part[..., :hd] = 0
            part[..., hd] = float("-inf")
            part[..., hd + 1] = 0
        else:
            m = scores.amax(dim=-1)                                   # [R, G, rep]
            if empty is not None:              # exp(-inf - -inf) would be nan: use m = 0 there
                m_safe = torch.where(empty[:, None, None], torch.zeros_like(m), m)
            else:
                m_safe = m
            e = torch.exp(scores - m_safe[..., None])
            part[..., :hd] = (e @ vw).reshape(R, hc, hd)
            part[..., hd] = m.reshape(R, hc)
            part[..., hd + 1] = e.sum(dim=-1).reshape(R, hc)
        if live_rows is None:
            ob.copy_(part.to(ob.dtype))
        else:                                  # a row whose shard is not live keeps its bytes
            ob[live_rows] = part[live_rows].to(ob.dtype)
        return
    o = torch.softmax(scores, dim=-1) @ vw                            # [R, G, rep, hd]
    out.view(R, n_heads, hd)[:, h_off:h_off + hc] = o.reshape(R, hc, hd).to(out.dtype)


def attention_combine(inputs, outputs, params, ctx):
    """Online-softmax merge of P split-KV partials into ``out[B?, n_heads*head_dim]``:
    m = max_p m_p, l = sum_p l_p e^(m_p-m), out = (sum_p acc_p e^(m_p-m)) / l; a shard with
    l_p == 0 (empty window) gets weight exactly 0. Only heads [h_off, h_off+h_count) (ext).
    The seed merges every input; AMK's live count (ext, kv_shard_rows > 0) enters here: the
    last input is the runtime pos and only the first regions.combine_live(...) partials are
    read (the shards past them wrote nothing this step). A pos per row (a block) counts per
    row."""
    hd = int(params["head_dim"])
    out = outputs[0]
    n_heads = int(params.get("n_heads", out.numel() // hd if out.dim() <= 1 else out.shape[-1] // hd))
    B = out.numel() // (n_heads * hd)
    h_off, hc = _head_range(params, n_heads, 1)
    n_parts = combine_partials(params, len(inputs))
    live = torch.full((B,), n_parts, dtype=torch.long)          # partials each row merges
    if n_parts < len(inputs):
        pos = inputs[-1].reshape(-1)
        if pos.numel() == 1:
            live.fill_(combine_live(params, n_parts, host_int(pos, ctx)))
        else:
            if pos.numel() != B:
                raise ValidationError(f"ATTENTION_COMBINE: {pos.numel()} positions for {B} rows")
            live = torch.tensor([combine_live(params, n_parts, int(p)) for p in pos.tolist()])
    live = live.to(out.device)[:, None]                          # [B, 1]
    parts = [f32(p.reshape(B, n_heads, hd + 2)[:, h_off:h_off + hc]) for p in inputs[:n_parts]]
    neg = torch.tensor(float("-inf"), device=out.device)
    m = torch.stack([torch.where(i < live, p[..., hd], neg) for i, p in enumerate(parts)],
                    dim=0).amax(dim=0)                           # [B, hc]
    acc = torch.zeros(B, hc, hd, dtype=torch.float32, device=out.device)
    l = torch.zeros(B, hc, dtype=torch.float32, device=out.device)
    for i, p in enumerate(parts):
        mp, lp = p[..., hd], p[..., hd + 1]
        use = (lp > 0) & (i < live)                              # a stale partial: never read
        w = torch.where(use, torch.exp(torch.where(use, mp, m) - m), torch.zeros_like(mp))
        l = l + torch.where(use, lp, torch.zeros_like(lp)) * w
        acc = acc + torch.where(use[..., None], p[..., :hd], torch.zeros_like(p[..., :hd])) * w[..., None]
    res = acc / l[..., None].clamp_min(1e-20)
    out.view(B, n_heads, hd)[:, h_off:h_off + hc] = res.to(out.dtype)


@functools.lru_cache(maxsize=64)
def _theta_inv_freq(half: int, theta: float, device: torch.device) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, half, device=device, dtype=torch.float32) / half))


def rope(inputs, outputs, params, ctx):
    """Rotate-half rotary embedding; inputs = [x, pos, inv_freq?]. x is viewed as rows of
    head_dim; pos of length 1 broadcasts over every row, pos of length P > 1 gives one position
    per leading index of x (the seed's [S, n_heads, head_dim]). inv_freq[head_dim/2] (ext)
    overrides theta (Llama-3 scaled rope). n_off/N_tile (ext) cover whole heads."""
    hd = int(params["head_dim"])
    half = hd // 2
    out = outputs[0]
    x = inputs[0]
    if x.numel() == out.numel() and x.shape != out.shape:
        x = x.reshape(out.shape)
    lo, hi = column_range(params, out)
    y = out
    if (lo, hi) != (0, out.shape[-1]):
        if lo % hd or (hi - lo) % hd:
            raise ValidationError(f"rope column tile [{lo}, {hi}) must cover whole heads of {hd}")
        x, y = x[..., lo:hi], out[..., lo:hi]
    pos = inputs[1].reshape(-1)
    P = pos.numel()
    if len(inputs) > 2 and inputs[2] is not None:
        inv_freq = f32(inputs[2]).reshape(-1)
    else:
        inv_freq = _theta_inv_freq(half, float(params.get("theta", 10000.0)), x.device)
    ang = pos.to(torch.float32)[:, None] * inv_freq[None, :]         # [P, half]
    c = torch.cos(ang).view(P, 1, half)
    s = torch.sin(ang).view(P, 1, half)
    xr = f32(x).reshape(P, -1, hd)
    x1, x2 = xr[..., :half], xr[..., half:]
    rot = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    y.copy_(rot.to(y.dtype).reshape(y.shape))


def kv_append(inputs, outputs, params, ctx):
    """cache[pos : pos+n] = new, in place (outputs[0] IS the cache); inputs = [new, pos].
    A rank-4 cache [B, max_seq, ...] gets row pos of every sequence. A pos of n > 1 elements
    (ext: a prompt block) puts row t of new at cache row pos[t]."""
    cache = outputs[0]
    if "pos" not in params and inputs[1].numel() > 1:
        _kv_append_block(inputs[0], inputs[1], cache)
        return
    p = int(params["pos"]) if "pos" in params else host_int(inputs[1], ctx)
    new = inputs[0]
    if cache.dim() == 4:
        rows = new.reshape(cache.shape[0], -1, *cache.shape[2:])
        n, max_seq = rows.shape[1], cache.shape[1]
    else:
        rows = new.reshape(-1, *cache.shape[1:])
        n, max_seq = rows.shape[0], cache.shape[0]
    if not 0 <= p <= max_seq - n:
        raise TraceError(f"KV_APPEND: decode position {p} (+{n} rows) is outside the cache's "
                         f"{max_seq} rows; use a larger max_seq or stop generating earlier")
    if cache.dim() == 4:
        cache[:, p:p + n] = rows.to(cache.dtype)
    else:
        cache[p:p + n] = rows.to(cache.dtype)


def _kv_append_block(new: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor) -> None:
    """cache[pos[t]] = new[t] for a single-sequence cache [max_seq, ...]; with a cache per
    sequence [B, max_seq, ...] (B = len(pos)), cache[t, pos[t]] = new[t]."""
    idx = pos.reshape(-1).to(torch.long)
    per_seq = cache.dim() == 4
    if per_seq and cache.shape[0] != idx.numel():
        raise TraceError(f"KV_APPEND: {idx.numel()} positions need a single-sequence cache "
                         f"[max_seq, ...] or one cache per position, got {tuple(cache.shape)}")
    seq_len = cache.shape[1] if per_seq else cache.shape[0]
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= seq_len:
        raise TraceError(f"KV_APPEND: positions {lo}..{hi} are outside the cache's "
                         f"{seq_len} rows; use a larger max_seq or a shorter prompt")
    if per_seq:
        rows = new.reshape(idx.numel(), *cache.shape[2:])
        cache[torch.arange(idx.numel()), idx] = rows.to(cache.dtype)
    else:
        cache.index_copy_(0, idx, new.reshape(idx.numel(), *cache.shape[1:]).to(cache.dtype))
