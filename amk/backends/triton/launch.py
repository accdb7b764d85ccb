"""Per-opcode launcher: maps a Task (or an opcode, its params and bound tensors) to the right
Triton micro-kernel and grid.

``launch(task, tensors)`` runs one task, ``tensors`` mapping buffer ids to tensors (a dict or a
list indexed by id). ``launch_op(op, inputs, outputs, params)`` is the same with the tensors
already picked; FUSED recipes and the per-instruction tests use it. Tensors must be dense
(contiguous); outputs are written in place. Nothing here synchronises with the device: the
decode position and token ids are only ever read by the kernels.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

import torch
import triton

from amk.backends.reference.semantics_attention import own_sequences
from amk.backends.reference.semantics_common import column_range as _column_range
from amk.errors import ValidationError
from amk.program.ir import DType, InstructionKind as K, Task
from amk.program.recipe import INPUT, OUTPUT, checked_recipe
from amk.program.regions import NEW_KV, PARTIAL_WRITE, combine_partials   # flags bits; combine inputs

from amk.backends.triton import kernels_attention as ka
from amk.backends.triton import kernels_block_attention as kba
from amk.backends.triton import kernels_elementwise as ke
from amk.backends.triton import kernels_gemm as kgm
from amk.backends.triton import kernels_gemv as kg
from amk.backends.triton import kernels_movement as km

_I8, _I4, _F8 = int(DType.I8), int(DType.I4), int(DType.F8E4M3)


def _pow2(n: int, lo: int = 16, hi: int = 1 << 30) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(int(n), 1))))


def _dense(t: torch.Tensor, what: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValidationError(f"triton backend: {what} must be a dense (contiguous) tensor, got "
                              f"shape {tuple(t.shape)} strides {t.stride()}; pass .contiguous()")
    return t


def _cols(t: torch.Tensor) -> int:
    return t.shape[-1] if t.dim() else 1


# --------------------------------------------------------------------------------------------
# Elementwise family
# --------------------------------------------------------------------------------------------
def _row_stride(x: torch.Tensor, out: torch.Tensor, what: str) -> int:
    """Row stride of input ``x`` read as ``out``'s rows: same numel -> dense rows; one row of
    ``out``'s width -> broadcast (stride 0)."""
    _dense(x, what)
    if x.numel() == out.numel():
        return _cols(out)
    if x.numel() == _cols(out):
        return 0
    raise ValidationError(f"{what} has shape {tuple(x.shape)}, which neither matches the output "
                          f"{tuple(out.shape)} nor broadcasts as one row of it")


def _elementwise(code: int, inputs, outputs, params, scale: float = 1.0) -> None:
    out = _dense(outputs[0], "elementwise output")
    lo, hi = _column_range(params, out)
    if hi == lo or out.numel() == 0:
        return
    a = inputs[0]
    b = inputs[1] if len(inputs) > 1 else out         # unary: b unread, any dense tensor
    shift, a_stride = 0, None
    if "x_off" in params:            # COPY's column move: a's own rows, columns shifted
        x_off = int(params["x_off"])
        _dense(a, "input 0")
        if x_off + hi - lo > _cols(a) or a.numel() // _cols(a) != out.numel() // _cols(out):
            raise ValidationError(f"COPY: input {tuple(a.shape)} columns [{x_off}, "
                                  f"{x_off + hi - lo}) do not fit output {tuple(out.shape)}")
        shift, a_stride = x_off - lo, _cols(a)
    block = _pow2(hi - lo, hi=1024)
    grid = (triton.cdiv(hi - lo, block), out.numel() // _cols(out))
    ke.elementwise_kernel[grid](a, b, out, lo, hi,
                                a_stride if a_stride is not None else _row_stride(a, out, "input 0"),
                                _row_stride(b, out, "input 1"), _cols(out), float(scale), shift,
                                OP=code, BLOCK=block)


def _mul(inputs, outputs, params):
    if len(inputs) >= 2:
        _elementwise(ke.EW_MUL, inputs[:2], outputs, params)
    else:
        _elementwise(ke.EW_SCALE, inputs[:1], outputs, params, float(params.get("scale", 1.0)))


def _allreduce_shard(inputs, outputs, params):
    """Sum of the shards, fp32, left to right: up to 4 per launch, chained through an fp32
    scratch (exact, so the order of additions is the reference's)."""
    out = _dense(outputs[0], "ALLREDUCE_SHARD output")
    n = out.numel()
    for i, x in enumerate(inputs):
        if _dense(x, f"shard {i}").numel() != n:
            raise ValidationError(f"ALLREDUCE_SHARD: shard {i} has {x.numel()} elements, "
                                  f"the output {n}")
    block = _pow2(n, hi=1024)
    grid = (triton.cdiv(n, block),)
    xs = list(inputs)
    while True:
        chunk, xs = xs[:4], xs[4:]
        dst = out if not xs else torch.empty(n, dtype=torch.float32, device=out.device)
        ptrs = chunk + [chunk[0]] * (4 - len(chunk))
        ke.shard_sum_kernel[grid](dst, *ptrs, n, NUM=len(chunk), BLOCK=block)
        if not xs:
            return
        xs = [dst] + xs


def _rows_of(w: torch.Tensor, x: torch.Tensor, what: str) -> tuple[int, int]:
    H = w.numel()
    if H == 0 or x.numel() % H:
        raise ValidationError(f"{what}: input of {x.numel()} elements is not rows of {H}")
    return x.numel() // H, H


def _rmsnorm(inputs, outputs, params):
    x, w, out = _dense(inputs[0], "x"), _dense(inputs[1], "weight"), _dense(outputs[0], "out")
    rows, H = _rows_of(w, x, "RMSNORM")
    ke.rmsnorm_kernel[(rows,)](x, w, out, H, float(params.get("eps", 1e-6)),
                               BLOCK=_pow2(H, hi=4096))


def _layernorm(inputs, outputs, params):
    x, w, out = _dense(inputs[0], "x"), _dense(inputs[1], "weight"), _dense(outputs[0], "out")
    b = inputs[2] if len(inputs) > 2 and inputs[2] is not None else None
    rows, H = _rows_of(w, x, "LAYERNORM")
    ke.layernorm_kernel[(rows,)](x, w, b if b is not None else w, out, H,
                                 float(params.get("eps", 1e-5)), HAS_BIAS=b is not None,
                                 BLOCK=_pow2(H, hi=4096))


def _softmax(inputs, outputs, params):
    out = _dense(outputs[0], "out")
    dim = int(params.get("dim", -1))
    if dim not in (-1, out.dim() - 1):
        raise ValidationError(f"SOFTMAX: the triton backend supports the last axis only, got "
                              f"dim={dim} for a rank-{out.dim()} output")
    C = _cols(out)
    ke.softmax_kernel[(out.numel() // C,)](_dense(inputs[0], "x"), out, C,
                                           BLOCK=_pow2(C, hi=4096))


# --------------------------------------------------------------------------------------------
# GEMV / GEMM / DEQUANT
# --------------------------------------------------------------------------------------------
def _matmul_tile(inputs, outputs, params):
    if "k_off" in params or "K_tile" in params:     # whole ops only: tile.split_k never runs here
        raise ValidationError("triton backend: a GEMV's K slice (k_off / K_tile, a split GEMV's "
                              "partial sums) is not supported; compile for the reference or cuda backend")
    x, out = _dense(inputs[0], "x"), _dense(outputs[0], "out")
    xk = _cols(x)
    Kp = int(params.get("K", xk))
    M = x.numel() // xk
    N = _cols(out)
    if out.numel() // N != M:
        raise ValidationError(f"GEMV/GEMM: x has {M} rows but the output {out.numel() // N}")
    n_off = int(params.get("n_off", 0))
    qdtype = int(params.get("qdtype", 0))
    quantized = qdtype in (_I4, _I8, _F8) and len(inputs) >= 3
    w = _dense(inputs[1], "weight")
    if quantized:
        s = _dense(inputs[2], "scales")
        bias = inputs[-1] if params.get("bias") else None        # ext: the last input
        z = inputs[3] if len(inputs) > 3 + (bias is not None) and inputs[3] is not None else None
        n_tile = int(params.get("N_tile", s.shape[0]))
        mode = {_I4: kg.W_INT4, _I8: kg.W_INT, _F8: kg.W_FP8}[qdtype]
        if qdtype == _F8:
            w = w.view(torch.uint8)                              # its bits: W_FP8 decodes them
        group, n_groups, stride_s = int(params.get("group", Kp)), _cols(s), _cols(s)
    else:
        s = z = None
        n_tile = int(params.get("N_tile", w.shape[0]))
        mode, group, n_groups, stride_s = kg.W_FP, 1, 1, 0
        bias = inputs[2] if len(inputs) > 2 and inputs[2] is not None else None
    if not 0 <= n_off <= n_off + n_tile <= N or n_off + n_tile > w.shape[0]:
        raise ValidationError(f"GEMV/GEMM: tile [{n_off}, {n_off + n_tile}) is outside the "
                              f"output's {N} columns or the weight's {w.shape[0]} rows")
    if n_tile == 0 or M == 0:
        return
    if mode == kg.W_FP and M >= GEMM_MIN_ROWS:          # a prompt block: tensor-core GEMM
        _gemm(x, w, bias, out, M, Kp, n_off, n_tile)
        return
    block_k = 128 if (mode == kg.W_FP and w.element_size() >= 4) else 256
    block_k = _pow2(Kp, hi=block_k)
    # 16-byte loads (8 bf16 per lane, 128 lanes over BLOCK_N x BLOCK_K) and enough programs
    # in flight to keep every SM streaming: fewer rows per program when the tile is narrow.
    block_n = next((b for b in (8, 4) if triton.cdiv(n_tile, b) * M >= 1024), 2)
    grid = (triton.cdiv(n_tile, block_n), M)
    kg.gemv_kernel[grid](x, w, s if s is not None else w, z if z is not None else w,
                         bias if bias is not None else w, out,
                         Kp, n_off, n_off + n_tile, xk, _cols(w), stride_s, N, group, n_groups,
                         MODE=mode, HAS_ZEROS=z is not None, HAS_BIAS=bias is not None,
                         BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4 if block_n >= 4 else 2)


def _dequant(inputs, outputs, params):
    qw, out = _dense(inputs[0], "qW"), _dense(outputs[0], "out")
    Kp = int(params.get("K", _cols(out)))
    qdtype = int(params.get("qdtype", _I8))
    packed = qdtype == _I4 and qw.dtype == torch.uint8 and _cols(qw) * 2 >= Kp > _cols(qw)
    N = qw.shape[0]
    s = _dense(inputs[1], "scales")
    z = inputs[2] if len(inputs) > 2 and inputs[2] is not None else None
    n_groups = s.numel() // N
    bn, bk = 16, _pow2(Kp, hi=256)
    grid = (triton.cdiv(N, bn), triton.cdiv(Kp, bk))
    mode = kg.W_FP8 if qdtype == _F8 else kg.W_INT4 if packed else kg.W_INT
    if mode == kg.W_FP8:
        qw = qw.view(torch.uint8)
    kg.dequant_kernel[grid](qw, s, z if z is not None else s, out, N, Kp, _cols(qw), n_groups,
                            int(params.get("group", Kp)), n_groups,
                            MODE=mode, HAS_ZEROS=z is not None,
                            BLOCK_N=bn, BLOCK_K=bk)


GEMM_MIN_ROWS = 16     # tl.dot's smallest M; fewer rows (decode, small batches) take the GEMV


def _gemm(x, w, bias, out, M, K, n_off, n_tile, config: kgm.GemmConfig | None = None):
    """config: the tiles (tests); by default chosen from the shape (kernels_gemm.gemm_config)."""
    # fp32 operands on the CPU interpreter (its bf16 dot is wrong) and for fp32 weights
    upcast = x.device.type != "cuda" or w.element_size() >= 4 or x.element_size() >= 4
    c = config or kgm.gemm_config(M, n_tile, K, upcast, _sm_count(x.device))
    grid = (triton.cdiv(M, c.block_m) * triton.cdiv(n_tile, c.block_n),)
    kgm.gemm_kernel[grid](x, w, bias if bias is not None else w, out, M, K, n_off,
                          n_off + n_tile, _cols(x), _cols(w), _cols(out),
                          HAS_BIAS=bias is not None, UPCAST=upcast, EVEN_K=K % c.block_k == 0,
                          BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                          GROUP_M=c.group_m, num_warps=c.num_warps, num_stages=c.num_stages)


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------
def _head_range(params, n_heads: int, rep: int) -> tuple[int, int]:
    h_off = int(params.get("h_off", 0))
    h_count = int(params.get("h_count", n_heads - h_off))
    if not (0 <= h_off and h_count >= 0 and h_off + h_count <= n_heads
            and h_off % rep == 0 and h_count % rep == 0):
        raise ValidationError(f"attention head range h_off={h_off}, h_count={h_count} must lie "
                              f"in [0, {n_heads}) and cover whole kv groups of {rep} q heads")
    return h_off, h_count


def _cache_dims(c: torch.Tensor, n_kv: int, hd: int) -> tuple[int, int]:
    """(B, max_seq) of a cache [B, max_seq, n_kv, hd] or a single-sequence [max_seq, ...]."""
    _dense(c, "KV cache")
    if c.dim() == 4:
        return c.shape[0], c.shape[1]
    return 1, c.numel() // (n_kv * hd)


def _attention_tile(inputs, outputs, params):
    if int(params.get("flags", 0)) & NEW_KV:
        raise ValidationError("attention: flags NEW_KV (the new row read from k_new/v_new) is a "
                              "CUDA megakernel schedule; the triton backend runs the cache append "
                              "first (PassOptions(defer_kv_append=False), its default)")
    if "b_off" in params or "b_count" in params:    # views of the task's own sequences
        inputs, outputs, params = own_sequences(inputs, outputs, params)
    hd = int(params["head_dim"])
    q = _dense(inputs[0], "q")
    n_heads = int(params.get("n_heads", q.shape[-2] if q.dim() >= 2 and q.shape[-1] == hd
                             else q.shape[-1] // hd))
    n_kv = int(params.get("n_kv_heads", n_heads))
    if n_kv <= 0 or n_heads % n_kv:
        raise ValidationError(f"attention: n_heads={n_heads} is not a multiple of "
                              f"n_kv_heads={n_kv}")
    rep = n_heads // n_kv
    k, v = inputs[1], inputs[2]
    B, max_seq = _cache_dims(k, n_kv, hd)
    pos = inputs[3] if len(inputs) > 3 and inputs[3] is not None else None
    block = pos is not None and pos.numel() > 1     # a prompt block: row r at pos[r], one cache
    if block and (k.dim() == 4 or pos.numel() * n_heads * hd != q.numel()):
        raise ValidationError(f"attention: a block of {pos.numel()} positions needs one per "
                              f"query row and a single-sequence cache; q {tuple(q.shape)}, k "
                              f"{tuple(k.shape)}")
    if block:
        B = pos.numel()                 # one program row per query row, cache stride 0
    if _cache_dims(v, n_kv, hd)[1] != max_seq or q.numel() != B * n_heads * hd:
        raise ValidationError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)} and v "
                              f"{tuple(v.shape)} do not agree on B, n_heads={n_heads}, "
                              f"n_kv_heads={n_kv}, head_dim={hd}")
    h_off, h_count = _head_range(params, n_heads, rep)
    if h_count == 0:
        return
    lo = int(params.get("kv_start", 0))
    kv_end = lo + int(params.get("kv_len", max_seq - lo))
    partial = bool(int(params.get("flags", 0)) & PARTIAL_WRITE)
    out = _dense(outputs[0], "attention output")
    want = B * n_heads * (hd + 2 if partial else hd)
    if out.numel() != want:
        raise ValidationError(f"attention: output has {out.numel()} elements, expected {want} "
                              f"({'[acc|m|l] partials' if partial else 'heads'} of B={B})")
    block_h, block_d = _pow2(rep, lo=1), _pow2(hd)
    row = n_kv * hd
    if block and not partial and int(params.get("kv_shards", 1)) == 1:
        _block_attention(q, k, v, pos, out, params, hd, n_heads, rep, max_seq, lo, kv_end,
                         h_off, h_count, row)
        return
    block_n = max(8, min(64, 8192 // (block_h * block_d)))
    # A long window is split over several programs (flash-decoding) and merged by the combine
    # kernel: one program per kv group scanning 4096 rows alone would idle the GPU.
    splits = 1 if partial else triton.cdiv(max(kv_end - lo, 1), SPLIT_ROWS)
    target = out if splits == 1 else _split_scratch(splits, B * n_heads * (hd + 2), out.device)
    ka.attention_kernel[(h_count // rep, B, splits)](
        q, k, v, pos if pos is not None else q, target,
        hd, n_heads, rep, max_seq, lo, kv_end, h_off // rep,
        float(params.get("scale", 1.0 / hd ** 0.5)), int(params.get("window", 0)),
        float(params.get("softcap", 0.0)),
        max_seq * row if k.dim() == 4 else 0, row,
        SPLIT_ROWS if splits > 1 else max(kv_end - lo, 1), target.stride(0) if splits > 1 else 0,
        int(params.get("kv_shard", 0)), int(params.get("kv_shards", 1)),
        int(params.get("kv_shard_rows", 0)), 1 if block else 0,
        HAS_POS=pos is not None, PARTIAL=partial or splits > 1,
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d)
    if splits > 1:
        ka.combine_stacked_kernel[(h_count, B)](out, target, splits, target.stride(0), hd,
                                                n_heads, h_off, *_no_live_count(target),
                                                BLOCK_D=block_d)


def _block_attention(q, k, v, pos, out, params, hd, n_heads, rep, max_seq, lo, kv_end,
                     h_off, h_count, row):
    """A prompt block's whole attention (one cache, no split-KV shard): BLOCK_M query rows
    times the rep q heads of a kv head are one Q tile of at most 128 (64 for head_dim > 128)."""
    upcast = q.device.type != "cuda" or k.element_size() >= 4 or q.element_size() >= 4
    R = pos.numel()
    block_h, block_d = _pow2(rep, lo=1), _pow2(hd)
    tile = 128 if block_d <= 128 else 64
    block_m = max(1, min(tile // block_h, triton.next_power_of_2(R)))
    block_m = max(block_m, triton.cdiv(16, block_h))         # tl.dot's smallest M: 16
    block_n = 64 if block_d <= 64 else 32
    big = block_m * block_h * block_d >= 128 * 128
    kba.block_attention_kernel[(triton.cdiv(R, block_m), h_count // rep)](
        q, k, v, pos, out, R, hd, n_heads, rep, max_seq, lo, kv_end, h_off // rep,
        float(params.get("scale", 1.0 / hd ** 0.5)), int(params.get("window", 0)),
        float(params.get("softcap", 0.0)), row, UPCAST=upcast,
        BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=8 if big else 4, num_stages=2)


SPLIT_ROWS = 256                      # cache rows per program in a split (non-partial) attention
_SPLIT_SCRATCH: dict[tuple, torch.Tensor] = {}


def _split_scratch(splits: int, width: int, device: torch.device) -> torch.Tensor:
    """[splits, width] fp32 partials, allocated once per shape and device (a captured CUDA
    graph keeps pointing at it)."""
    key = (splits, width, str(device))
    t = _SPLIT_SCRATCH.get(key)
    if t is None:
        t = _SPLIT_SCRATCH[key] = torch.empty(splits, width, dtype=torch.float32, device=device)
    return t


def _attention_combine(inputs, outputs, params):
    hd = int(params["head_dim"])
    out = _dense(outputs[0], "out")
    n_heads = int(params.get("n_heads", out.numel() // hd if out.dim() <= 1
                             else out.shape[-1] // hd))
    B = out.numel() // (n_heads * hd)
    h_off, h_count = _head_range(params, n_heads, 1)
    n_parts = combine_partials(params, len(inputs))
    parts = [_dense(p, f"partial {i}") for i, p in enumerate(inputs[:n_parts])]
    for i, p in enumerate(parts):
        if p.numel() != B * n_heads * (hd + 2):
            raise ValidationError(f"ATTENTION_COMBINE: partial {i} has {p.numel()} elements, "
                                  f"expected B*n_heads*(head_dim+2) = {B * n_heads * (hd + 2)}")
    if h_count == 0 or not parts:
        return
    if n_parts < len(inputs):           # the live count (regions.combine_live): pos is last
        pos = _dense(inputs[-1], "pos")
        if pos.numel() not in (1, B):
            raise ValidationError(f"ATTENTION_COMBINE: {pos.numel()} positions for {B} rows")
        start = int(params.get("kv_start", 0))
        live = (pos, 1 if pos.numel() > 1 else 0, int(params["kv_shard_rows"]), start,
                start + int(params["kv_len"]), int(params.get("window", 0)))
    else:
        live = _no_live_count(parts[0])
    grid = (h_count, B)
    if len(parts) <= 8:
        ptrs = parts + [parts[0]] * (8 - len(parts))
        ka.combine_kernel[grid](out, *ptrs, hd, n_heads, h_off, *live, NUM=len(parts),
                                BLOCK_D=_pow2(hd))
    else:
        stacked = torch.stack([p.reshape(-1) for p in parts])
        ka.combine_stacked_kernel[grid](out, stacked, len(parts), stacked.stride(0), hd, n_heads,
                                        h_off, *live, BLOCK_D=_pow2(hd))


def _no_live_count(any_tensor: torch.Tensor) -> tuple:
    """The combine kernels' live-count arguments when every partial is merged (pos unread)."""
    return (any_tensor, 0, 0, 0, 0, 0)


# --------------------------------------------------------------------------------------------
# Rope, embed, argmax, KV append
# --------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def _theta_inv_freq(half: int, theta: float, device: str) -> torch.Tensor:
    # the reference's expression, evaluated by torch, so both use identical frequencies
    return 1.0 / (theta ** (torch.arange(0, half, device=device, dtype=torch.float32) / half))


def _rope(inputs, outputs, params):
    hd = int(params["head_dim"])
    out = _dense(outputs[0], "out")
    x = _dense(inputs[0], "x")
    if x.numel() != out.numel():
        raise ValidationError(f"ROPE: x has {x.numel()} elements, the output {out.numel()}")
    lo, hi = _column_range(params, out)
    if lo % hd or (hi - lo) % hd or hd % 2:
        raise ValidationError(f"rope column tile [{lo}, {hi}) must cover whole heads of {hd}")
    pos = _dense(inputs[1], "pos")
    if len(inputs) > 2 and inputs[2] is not None:
        freq = inputs[2].reshape(-1).to(torch.float32)
    else:
        freq = _theta_inv_freq(hd // 2, float(params.get("theta", 10000.0)), str(out.device))
    if hi == lo:
        return
    C = _cols(out)
    block = _pow2(hi - lo, hi=1024)
    km.rope_kernel[(triton.cdiv(hi - lo, block), out.numel() // C)](
        x, pos, freq, out, C, lo, hi, hd, out.numel() // pos.numel(), BLOCK=block)


def _embed(inputs, outputs, params):
    ids, table, out = _dense(inputs[0], "ids"), _dense(inputs[1], "table"), outputs[0]
    H = _cols(table)
    B = ids.numel()
    if _dense(out, "out").numel() != B * H:
        raise ValidationError(f"EMBED: output has {out.numel()} elements, expected {B}x{H}")
    block = _pow2(H, hi=1024)
    km.embed_kernel[(triton.cdiv(H, block), B)](ids, table, out, H, BLOCK=block)


def _argmax(inputs, outputs, params):
    x = _dense(inputs[0], "logits")
    V = _cols(x)
    out = _dense(outputs[0], "ids")
    km.argmax_kernel[(x.numel() // V,)](x, out, V, BLOCK=_pow2(V, hi=2048))


def _kv_append(inputs, outputs, params):
    cache, new = _dense(outputs[0], "KV cache"), _dense(inputs[0], "new")
    if cache.dim() == 4:
        B, max_seq = cache.shape[0], cache.shape[1]
    else:
        B, max_seq = 1, cache.shape[0]
    D = cache.numel() // (B * max_seq)
    if new.numel() % (B * D):
        raise ValidationError(f"KV_APPEND: new {tuple(new.shape)} is not rows of the cache "
                              f"{tuple(cache.shape)}")
    n = new.numel() // (B * D)
    has_pos = "pos" not in params
    pos = inputs[1] if has_pos else new
    block = _pow2(D, hi=1024)
    pos_step = 1 if has_pos and pos.numel() > 1 else 0     # a prompt block: row j at pos[j]
    if pos_step and (B != 1 or pos.numel() != n):
        raise ValidationError(f"KV_APPEND: a block of {pos.numel()} positions needs one per new "
                              f"row ({n}) and a single-sequence cache, got {tuple(cache.shape)}")
    km.kv_append_kernel[(triton.cdiv(D, block), B * n)](
        new, pos, cache, int(params.get("pos", 0)), D, n, max_seq, pos_step, HAS_POS=has_pos,
        BLOCK=block)


# --------------------------------------------------------------------------------------------
# FUSED: the recipe step by step with the same kernels, over scratch
# --------------------------------------------------------------------------------------------
def _fused(inputs, outputs, params):
    recipe = checked_recipe(params.get("recipe"), len(inputs), len(outputs))
    scratch: dict[int, torch.Tensor] = {}
    for st in recipe.steps:
        args = [inputs[a.index] if a.kind == INPUT else scratch[a.index] for a in st.args]
        if st.out.kind == OUTPUT:
            dst = outputs[st.out.index]
        else:
            dtype = st.out_dtype.torch if st.out_dtype is not None else args[0].dtype
            shape = st.out_shape if st.out_shape is not None else tuple(args[0].shape)
            dst = scratch.get(st.out.index)
            if dst is None or tuple(dst.shape) != shape or dst.dtype != dtype:
                # zero-filled like the reference, so even a partial write is deterministic; a
                # slot of the same shape and dtype is written into (sibling column tiles)
                dst = torch.zeros(shape, dtype=dtype, device=args[0].device)
                scratch[st.out.index] = dst
        launch_op(st.op, args, [dst], st.params)


# --------------------------------------------------------------------------------------------
LAUNCHERS: dict[K, Callable[[Sequence, Sequence, Mapping[str, Any]], None]] = {
    K.NOP: lambda i, o, p: None,
    K.COPY: lambda i, o, p: _elementwise(ke.EW_COPY, i[:1], o, p),
    K.EMBED: _embed,
    K.RMSNORM: _rmsnorm,
    K.LAYERNORM: _layernorm,
    K.GEMV_TILE: _matmul_tile,
    K.GEMM_TILE: _matmul_tile,
    K.ATTENTION_TILE: _attention_tile,
    K.ATTENTION_COMBINE: _attention_combine,
    K.ROPE: _rope,
    K.SILU_MUL: lambda i, o, p: _elementwise(ke.EW_SILU_MUL, i[:2], o, p),
    K.GELU: lambda i, o, p: _elementwise(ke.EW_GELU_TANH if int(p.get("tanh", 0)) else ke.EW_GELU,
                                         i[:1], o, p),
    K.SOFTCAP: lambda i, o, p: _elementwise(ke.EW_SOFTCAP, i[:1], o, p, float(p["cap"])),
    K.ADD: lambda i, o, p: _elementwise(ke.EW_ADD, i[:2], o, p),
    K.MUL: _mul,
    K.DEQUANT: _dequant,
    K.SOFTMAX: _softmax,
    K.KV_APPEND: _kv_append,
    K.SAMPLE_ARGMAX: _argmax,
    K.ALLREDUCE_SHARD: _allreduce_shard,
    K.FUSED: _fused,
}


def launch_op(op, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
              params: Mapping[str, Any]) -> None:
    """Run opcode ``op`` on bound tensors (outputs written in place)."""
    try:
        fn = LAUNCHERS[K(int(op))]
    except (ValueError, KeyError):
        raise ValidationError(f"triton backend has no kernel for opcode {op!r}") from None
    fn(list(inputs), list(outputs), params)


def launch(task: Task, tensors) -> None:
    """Run one task; ``tensors[buffer_id]`` is the tensor bound to each buffer."""
    try:
        launch_op(task.op, [tensors[b] for b in task.inputs],
                  [tensors[b] for b in task.outputs], task.params)
    except ValidationError as e:
        raise ValidationError(f"task {task.id} {task.op.name} '{task.name}': {e}") from e
