"""Reference semantics of every opcode: what each instruction computes (the project's oracle).

Every function is ``op(inputs, outputs, params, ctx)``: it reads ``inputs`` (tensors), writes
into the preallocated ``outputs`` in place and returns None. Numerics follow the customer's seed
exactly: compute in fp32, cast to the output dtype once. The table in docs/PROGRAM.md is the
contract; extensions beyond the seed (marked **ext** there) reduce to the seed when unused.

Attention, rope and the KV cache live in ``semantics_attention.py``; FUSED recipes in
``semantics_fused.py``. This module owns the registry ``SEMANTICS``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from amk.errors import TraceError, ValidationError
from amk.program.ir import DType, InstructionKind
from amk.program.regions import k_range

from amk.backends.reference.semantics_attention import (
    attention_combine, attention_tile, kv_append, rope,
)
from amk.backends.reference.semantics_fused import run_recipe
from amk.backends.reference.semantics_common import column_range, f32, tile_view

__all__ = ["RefCtx", "SEMANTICS", "semantics_for", "dequant_rows"]

Semantics = Callable[[list, list, Any, "RefCtx"], None]


@dataclass
class RefCtx:
    """Side state the ops may consult. ``host_ints`` maps a tensor's data_ptr to its value for
    scalar runtime inputs (the decode position) the VM already read once per run, so attention
    does not sync the device per task. ``validated`` caches FUSED recipes already checked."""

    host_ints: dict[int, int] = field(default_factory=dict)
    validated: dict[int, Any] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------
# Elementwise / movement. n_off/N_tile (ext): compute only out[..., n_off:n_off+N_tile] and read
# only those columns of same-width inputs; an input with the output's numel but another shape
# is viewed as the output (a reshape in the user's function is free).
# ------------------------------------------------------------------------------------------
def _elementwise(inputs, outputs, params, compute, whole_rows: bool = False) -> None:
    """``whole_rows``: compute every column, keep the tile's. torch's CPU exp/erf give different
    last bits in SIMD lanes and scalar tails, so a tile computed alone could differ from the
    untiled op by an ulp; computing whole rows keeps the oracle bit-identical under any tiling."""
    out = outputs[0]
    lo, hi = column_range(params, out)
    tiled = (lo, hi) != (0, out.shape[-1])
    if tiled and whole_rows:
        args = [f32(tile_view(x, out, 0, out.shape[-1])) for x in inputs]
        r = compute(*args)
        r = r.reshape(out.shape) if r.numel() == out.numel() else r.expand(out.shape)
        out[..., lo:hi] = r[..., lo:hi].to(out.dtype)
        return
    args = [f32(tile_view(x, out, lo, hi)) for x in inputs]
    y = out[..., lo:hi] if tiled else out
    r = compute(*args).to(y.dtype)
    y.copy_(r.reshape(y.shape) if r.numel() == y.numel() else r)


def op_nop(inputs, outputs, params, ctx):
    return None


def op_copy(inputs, outputs, params, ctx):
    out = outputs[0]
    lo, hi = column_range(params, out)
    if "x_off" in params:            # ext: a column move (slice / concat)
        x_off = int(params["x_off"])
        x = inputs[0].reshape(-1, inputs[0].shape[-1])
        y = out.view(-1, out.shape[-1])
        if x_off + hi - lo > x.shape[-1]:
            raise ValidationError(f"COPY: x_off={x_off} + {hi - lo} columns exceeds the input's "
                                  f"{x.shape[-1]}")
        y[:, lo:hi] = x[:, x_off:x_off + hi - lo].to(y.dtype)
        return
    x = tile_view(inputs[0], out, lo, hi)          # no fp32 detour: a copy is a plain cast
    y = out[..., lo:hi] if (lo, hi) != (0, out.shape[-1]) else out
    y.copy_(x.to(y.dtype).reshape(y.shape))


def op_add(inputs, outputs, params, ctx):
    _elementwise(inputs, outputs, params, lambda a, b: a + b)


def op_sum(inputs, outputs, params, ctx):
    """y = x_0 + x_1 + ... summed in fp32 in input order, then cast (ext: a K-split GEMV's
    partials, tile.py)."""
    def total(*xs):
        s = xs[0]
        for x in xs[1:]:
            s = s + x
        return s
    _elementwise(inputs, outputs, params, total)


def op_mul(inputs, outputs, params, ctx):
    if len(inputs) >= 2:
        _elementwise(inputs[:2], outputs, params, lambda a, b: a * b)
    else:
        scale = float(params.get("scale", 1.0))
        _elementwise(inputs[:1], outputs, params, lambda a: a * scale)


def op_gelu(inputs, outputs, params, ctx):
    """Exact (erf) gelu; params tanh=1 (ext): the tanh approximation (F.gelu's "tanh")."""
    approx = "tanh" if int(params.get("tanh", 0)) else "none"
    _elementwise(inputs[:1], outputs, params, lambda x: F.gelu(x, approximate=approx), whole_rows=True)


def op_softcap(inputs, outputs, params, ctx):
    """cap * tanh(x / cap), in that order (transformers' Gemma 2 soft-capping)."""
    cap = float(params["cap"])
    _elementwise(inputs[:1], outputs, params, lambda x: torch.tanh(x / cap) * cap, whole_rows=True)


def op_silu_mul(inputs, outputs, params, ctx):
    """SwiGLU: silu(gate) * up; inputs = [gate, up]."""
    _elementwise(inputs[:2], outputs, params, lambda g, u: F.silu(g) * u, whole_rows=True)


def op_softmax(inputs, outputs, params, ctx):
    dim = int(params.get("dim", -1))
    out = outputs[0]
    x = f32(inputs[0]).reshape(out.shape)
    out.copy_(torch.softmax(x, dim=dim).to(out.dtype))


def op_allreduce_shard(inputs, outputs, params, ctx):
    """Sum of the shards (the single-device identity of a tensor-parallel all-reduce). A
    cross-rank one (params rank/world, amk/program/collectives.py) needs its peers: only a
    world of one runs here; more run under the rank simulator (reference/ranks.py)."""
    if "world" in params:
        world = int(params["world"])
        if world != 1:
            raise ValidationError(
                f"ALLREDUCE_SHARD of rank {params.get('rank')} in a world of {world} ranks needs "
                f"its peers' parts: run the {world} rank programs together with "
                f"amk.backends.reference.ranks.run_ranks (ShardedModel does)")
        from amk.backends.reference.semantics_collective import reduce_ranks
        reduce_ranks(params.get("reduce", "sum"), inputs, outputs)
        return
    out = outputs[0]
    acc = f32(inputs[0]).reshape(out.shape).clone()
    for t in inputs[1:]:
        acc += f32(t).reshape(out.shape)
    out.copy_(acc.to(out.dtype))


# ------------------------------------------------------------------------------------------
# Norms: x viewed as rows of H = weight.numel() elements.
# ------------------------------------------------------------------------------------------
def op_rmsnorm(inputs, outputs, params, ctx):
    """x * rsqrt(mean(x^2) + eps) * w over rows of H; inputs = [x, w]."""
    w = f32(inputs[1]).reshape(-1)
    x = f32(inputs[0]).reshape(-1, w.numel())
    eps = float(params.get("eps", 1e-6))
    rms = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    out = outputs[0]
    out.copy_((x * rms * w).to(out.dtype).reshape(out.shape))


def op_layernorm(inputs, outputs, params, ctx):
    """F.layer_norm over rows of H; inputs = [x, w, b?]."""
    w = f32(inputs[1]).reshape(-1)
    b = f32(inputs[2]).reshape(-1) if len(inputs) > 2 and inputs[2] is not None else None
    hidden = int(params.get("hidden", w.numel()))
    x = f32(inputs[0]).reshape(-1, hidden)
    eps = float(params.get("eps", 1e-5))
    out = outputs[0]
    out.copy_(F.layer_norm(x, (hidden,), w, b, eps).to(out.dtype).reshape(out.shape))


# ------------------------------------------------------------------------------------------
# Embedding / sampling
# ------------------------------------------------------------------------------------------
def op_embed(inputs, outputs, params, ctx):
    """out[B, H] = table[ids]; inputs = [ids i32[B], table[V, H]]."""
    ids = inputs[0].reshape(-1).to(torch.long)
    vocab = inputs[1].shape[0]
    bad = (ids < 0) | (ids >= vocab)
    if bool(bad.any()):
        raise TraceError(f"EMBED (amk.ops.embed): argument 'ids' holds token id "
                         f"{int(ids[bad][0])}, outside the table's {vocab} rows; token ids must "
                         f"be in [0, {vocab})")
    rows = inputs[1].index_select(0, ids)
    out = outputs[0]
    out.copy_(rows.to(out.dtype).reshape(out.shape))


def op_sample_argmax(inputs, outputs, params, ctx):
    """Greedy: ids[B] = argmax over the last axis of logits[B, V] (first max on ties)."""
    logits = inputs[0]
    rows = f32(logits.reshape(-1, logits.shape[-1]))
    out = outputs[0]
    out.reshape(-1).copy_(torch.argmax(rows, dim=-1).to(out.dtype))


# ------------------------------------------------------------------------------------------
# Matmuls (tiled by output columns) and weight-only dequantization
# ------------------------------------------------------------------------------------------
_I8, _I4, _F8 = int(DType.I8), int(DType.I4), int(DType.F8E4M3)
QDTYPES = (_I8, _I4, _F8)           # weight-only formats; F8E4M3 (ext): real = q * scale


def dequant_rows(qw: torch.Tensor, scales: torch.Tensor, qdtype: int, group: int,
                 zeros: torch.Tensor | None, K: int) -> torch.Tensor:
    """Dequantize weight rows to fp32 ``[N, K]`` (the seed's frozen storage layout).

    I8: ``qw`` int8 ``[N, K]``, real = q * scale; F8E4M3 (ext) likewise with ``qw`` float8_e4m3fn. I4: ``qw`` uint8 ``[N, K/2]``, byte b holds
    column 2b in the low nibble and 2b+1 in the high nibble, each stored as q+8 (q in [-8, 7]).
    scales ``[N, ceil(K/group)]`` (column k uses group k // group); optional integer-valued
    zeros of the same shape give real = (q - zero) * scale."""
    N = qw.shape[0]
    if qdtype == _I4:
        packed = qw.to(torch.int32)
        q = torch.stack([packed & 0xF, (packed >> 4) & 0xF], dim=-1).reshape(N, -1)
        q = q[:, :K].to(torch.float32) - 8.0
    else:
        q = qw[:, :K].to(torch.float32)

    def per_column(g: torch.Tensor) -> torch.Tensor:      # [N, n_groups] -> [N, K]
        full = g.repeat_interleave(group, dim=-1)[:, :K]
        if full.shape[-1] < K:                            # fewer groups than K needs: last repeats
            full = torch.cat([full, g[:, -1:].expand(N, K - full.shape[-1])], dim=-1)
        return full

    if zeros is not None:
        q = q - per_column(f32(zeros))
    return q * per_column(f32(scales))


def _matmul_tile(inputs, outputs, params):
    """out[..., n_off:n_off+N_tile] = x @ W[n_off:n_off+N_tile].T (+ bias tile); with k_off /
    K_tile (ext: one K slice of a split GEMV, tile.py) only K columns [k_off, k_off+K_tile) of
    x and W take part.

    FP weight: inputs = [x, W[N, K], bias?]. Weight-only quantized when params['qdtype'] is I4/I8/F8E4M3
    and a scales input is present: inputs = [x, qW, scales, zeros?, bias?] (bias when params['bias']:
    ext). Only the tile's rows of W
    are converted (same values as converting all of W, far less work)."""
    x = f32(inputs[0])
    out = outputs[0]
    qdtype = int(params.get("qdtype", 0))
    n_off = int(params.get("n_off", 0))
    K = int(params.get("K", x.shape[-1]))
    ks = slice(*k_range(params, K))
    if qdtype in QDTYPES and len(inputs) >= 3:
        scales = inputs[2]
        bias = inputs[-1] if params.get("bias") else None       # ext: the last input
        zeros = inputs[3] if len(inputs) > 3 + (bias is not None) and inputs[3] is not None else None
        n_tile = int(params.get("N_tile", scales.shape[0]))
        rows = slice(n_off, n_off + n_tile)
        w = dequant_rows(inputs[1][rows], scales[rows], qdtype, int(params.get("group", K)),
                         zeros[rows] if zeros is not None else None, K)
        y = x[..., ks] @ w[:, ks].t()
        if bias is not None:
            y = y + f32(bias.reshape(-1)[n_off:n_off + n_tile])
    else:
        n_tile = int(params.get("N_tile", inputs[1].shape[0]))
        y = x[..., ks] @ f32(inputs[1][n_off:n_off + n_tile, ks]).t()
        if len(inputs) > 2 and inputs[2] is not None:
            y = y + f32(inputs[2].reshape(-1)[n_off:n_off + n_tile])
    out[..., n_off:n_off + n_tile] = y.to(out.dtype)


def op_gemv_tile(inputs, outputs, params, ctx):
    _matmul_tile(inputs, outputs, params)


def op_gemm_tile(inputs, outputs, params, ctx):
    _matmul_tile(inputs, outputs, params)


def op_dequant(inputs, outputs, params, ctx):
    """W[N, K] = dequantized qW; inputs = [qW, scales, zeros?]. A U8 qW with K/2 columns under
    qdtype I4 is packed (ext); anything else is the seed's already-unpacked integer values."""
    qw, out = inputs[0], outputs[0]
    K = int(params.get("K", out.shape[-1]))
    qdtype = int(params.get("qdtype", _I8))
    packed = qdtype == _I4 and qw.dtype == torch.uint8 and qw.shape[-1] * 2 >= K > qw.shape[-1]
    zeros = inputs[2] if len(inputs) > 2 and inputs[2] is not None else None
    w = dequant_rows(qw.reshape(-1, qw.shape[-1]), inputs[1].reshape(qw.shape[0], -1),
                     _I4 if packed else _I8, int(params.get("group", K)),
                     zeros.reshape(qw.shape[0], -1) if zeros is not None else None, K)
    out.copy_(w.to(out.dtype).reshape(out.shape))


# ------------------------------------------------------------------------------------------
# FUSED and the registry
# ------------------------------------------------------------------------------------------
def op_fused(inputs, outputs, params, ctx):
    """Run params['recipe'] over scratch (see semantics_fused); malformed -> ValidationError."""
    run_recipe(params.get("recipe"), inputs, outputs, ctx, semantics_for)


SEMANTICS: dict[InstructionKind, Semantics] = {
    InstructionKind.NOP: op_nop,
    InstructionKind.COPY: op_copy,
    InstructionKind.EMBED: op_embed,
    InstructionKind.RMSNORM: op_rmsnorm,
    InstructionKind.LAYERNORM: op_layernorm,
    InstructionKind.GEMV_TILE: op_gemv_tile,
    InstructionKind.GEMM_TILE: op_gemm_tile,
    InstructionKind.ATTENTION_TILE: attention_tile,
    InstructionKind.ATTENTION_COMBINE: attention_combine,
    InstructionKind.ROPE: rope,
    InstructionKind.SILU_MUL: op_silu_mul,
    InstructionKind.GELU: op_gelu,
    InstructionKind.ADD: op_add,
    InstructionKind.MUL: op_mul,
    InstructionKind.DEQUANT: op_dequant,
    InstructionKind.SOFTMAX: op_softmax,
    InstructionKind.KV_APPEND: kv_append,
    InstructionKind.SAMPLE_ARGMAX: op_sample_argmax,
    InstructionKind.ALLREDUCE_SHARD: op_allreduce_shard,
    InstructionKind.FUSED: op_fused,
    InstructionKind.SOFTCAP: op_softcap,
    InstructionKind.SUM: op_sum,
}


def semantics_for(op) -> Semantics:
    """The reference function of opcode ``op`` (an InstructionKind or its int code)."""
    try:
        return SEMANTICS[InstructionKind(int(op))]
    except (ValueError, KeyError, TypeError):
        raise ValidationError(
            f"no reference semantics for opcode {op!r}; known opcodes: "
            + ", ".join(k.name for k in SEMANTICS)) from None
