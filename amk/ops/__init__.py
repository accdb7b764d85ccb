"""amk.ops: the functional op API a decode step is written with.

Activations are [B, features] (B = 1 for batch-1 decode); token ids are int32 [B]; the decode
position is an int32 [1] tensor (a runtime value, one for the whole batch). A prompt block is
the same step with T rows of one sequence and positions int32 [T] (row t at pos[t]): rope,
kv_update and attention (causal) then treat each row at its own position. Ops are traced
inside `amk.jit`; each checks its arguments and records one graph equation.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from amk import trace as _trace
from amk.errors import TraceError
from amk.graph import Aval
from amk.ops import rules
from amk.ops.group import RankGroup
from amk.program.ir import DType
from amk.quant import QuantizedWeight

__all__ = ["embed", "rmsnorm", "layernorm", "linear", "rope", "attention", "kv_update",
           "silu_mul", "gelu", "add", "sub", "mul", "tanh", "softcap", "softmax", "argmax",
           "dequant", "allreduce", "reshape", "cast", "slice", "concat", "RankGroup"]


def _args(op: str, named: Sequence[tuple[str, Any]]):
    """Check that every argument is a traced value; return (checker, ctx, tracers)."""
    src = _trace.user_source_line()
    ctx = _trace.current()
    if ctx is None:
        raise TraceError(f"amk.ops.{op} called outside amk.jit (at {src}); wrap the function "
                         f"with amk.jit and call it with tensors")
    out = []
    for name, v in named:
        if v is None:
            out.append(None)
        elif isinstance(v, _trace.Tracer):
            out.append(v)
        elif isinstance(v, torch.Tensor):
            raise TraceError(f"amk.ops.{op}: argument '{name}' is a concrete tensor captured from "
                             f"outside the traced function (at {src}); pass it in as an argument")
        else:
            raise TraceError(f"amk.ops.{op}: argument '{name}' must be a tensor, got "
                             f"{type(v).__name__} (at {src})")
    return rules.Checker(op, src), ctx, out


def _bind(ctx, c, prim, inputs, params, aval):
    return ctx.bind(prim, [t for t in inputs if t is not None], params, [aval], c.src)[0]


def embed(table, ids):
    c, ctx, (t, i) = _args("embed", [("table", table), ("ids", ids)])
    return _bind(ctx, c, "embed", [t, i], {}, rules.embed(c, t.aval, i.aval))


def rmsnorm(x, weight, eps: float = 1e-6):
    c, ctx, (xt, wt) = _args("rmsnorm", [("x", x), ("weight", weight)])
    return _bind(ctx, c, "rmsnorm", [xt, wt], {"eps": float(eps)}, rules.norm(c, xt.aval, wt.aval, None))


def layernorm(x, weight, bias=None, eps: float = 1e-5):
    c, ctx, (xt, wt, bt) = _args("layernorm", [("x", x), ("weight", weight), ("bias", bias)])
    aval = rules.norm(c, xt.aval, wt.aval, bt.aval if bt is not None else None)
    return _bind(ctx, c, "layernorm", [xt, wt, bt], {"eps": float(eps)}, aval)


def linear(x, weight, bias=None):
    """y = x @ weight.T (+ bias). weight is [N_out, K_in] (nn.Linear) or an amk.QuantizedWeight."""
    if isinstance(weight, QuantizedWeight):
        c, ctx, (xt, q, s, z, bt) = _args("linear", [("x", x), ("weight.q", weight.q),
                                                     ("weight.scales", weight.scales),
                                                     ("weight.zeros", weight.zeros), ("bias", bias)])
        aval = rules.qlinear(c, xt.aval, q.aval, s.aval, z.aval if z is not None else None,
                             weight.bits, weight.group, bt.aval if bt is not None else None)
        # the bias is the last input, added in the GEMV's fp32 epilogue (one rounding, as a
        # float linear's); "bias" marks it, since zeros before it are optional
        extra = {"bias": True} if bt is not None else {}
        return _bind(ctx, c, "qlinear", [xt, q, s, z, bt],
                     {"bits": weight.bits, "group": weight.group, **extra}, aval)
    c, ctx, (xt, wt, bt) = _args("linear", [("x", x), ("weight", weight), ("bias", bias)])
    aval = rules.linear(c, xt.aval, wt.aval, bt.aval if bt is not None else None)
    return _bind(ctx, c, "linear", [xt, wt, bt], {}, aval)


def dequant(weight: QuantizedWeight):
    """The float [N, K] weight a QuantizedWeight stands for (dtype of its scales)."""
    if not isinstance(weight, QuantizedWeight):
        raise TraceError(f"amk.ops.dequant: argument 'weight' must be an amk.QuantizedWeight, "
                         f"got {type(weight).__name__}")
    c, ctx, (q, s, z) = _args("dequant", [("weight.q", weight.q), ("weight.scales", weight.scales),
                                          ("weight.zeros", weight.zeros)])
    n = q.aval.shape[0]
    k = q.aval.shape[1] * (2 if weight.bits == 4 else 1)
    x = Aval((1, k), s.aval.dtype)
    rules.qlinear(c, x, q.aval, s.aval, z.aval if z is not None else None, weight.bits, weight.group)
    return _bind(ctx, c, "dequant", [q, s, z], {"bits": weight.bits, "group": weight.group},
                 Aval((n, k), s.aval.dtype))


def rope(x, pos, head_dim: int, theta: float = 10000.0, inv_freq=None):
    """Rotary embedding (rotate-half) of x [B, n*head_dim] at position pos. inv_freq [head_dim//2]
    (float32) overrides theta, e.g. for Llama-3 scaled rope."""
    c, ctx, (xt, pt, ft) = _args("rope", [("x", x), ("pos", pos), ("inv_freq", inv_freq)])
    aval = rules.rope(c, xt.aval, pt.aval, ft.aval if ft is not None else None, int(head_dim))
    return _bind(ctx, c, "rope", [xt, pt, ft],
                 {"head_dim": int(head_dim), "theta": float(theta)}, aval)


def attention(q, k_cache, v_cache, pos, n_heads: int, n_kv_heads: int, head_dim: int,
              scale: float | None = None, window: int | None = None, softcap: float | None = None):
    """Decode attention of q [B, n_heads*head_dim] over cache rows 0..pos (inclusive); with pos
    [T] (a prompt block) row t attends to cache rows 0..pos[t].

    window: a sliding window, only the last `window` rows (pos-window, pos] (Mistral, Gemma's
    local layers). softcap: the scores become softcap * tanh(scores / softcap) before the
    softmax (Gemma 2's attn_logit_softcapping)."""
    c, ctx, (qt, kt, vt, pt) = _args("attention", [("q", q), ("k_cache", k_cache),
                                                   ("v_cache", v_cache), ("pos", pos)])
    aval = rules.attention(c, qt.aval, kt.aval, vt.aval, pt.aval, int(n_heads), int(n_kv_heads),
                           int(head_dim))
    sc = float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)
    params = {"n_heads": int(n_heads), "n_kv_heads": int(n_kv_heads), "head_dim": int(head_dim),
              "scale": sc}
    if window is not None:
        if int(window) < 1:
            c.fail("window", f"must be a positive number of rows, got {window}")
        params["window"] = int(window)
    if softcap is not None:
        if not float(softcap) > 0:
            c.fail("softcap", f"must be a positive float, got {softcap}")
        params["softcap"] = float(softcap)
    return _bind(ctx, c, "attention", [qt, kt, vt, pt], params, aval)


def kv_update(cache, new, pos):
    """Write new [B, n_kv*head_dim] into cache row pos (row t into pos[t] for pos [T]); returns
    the updated cache. In place when the cache argument is donated (amk.jit(..., donate=("kv",)))."""
    c, ctx, (ct, nt, pt) = _args("kv_update", [("cache", cache), ("new", new), ("pos", pos)])
    aval = rules.kv_update(c, ct.aval, nt.aval, pt.aval)
    return _bind(ctx, c, "kv_update", [ct, nt, pt], {}, aval)


def _elementwise(op: str, names: tuple[str, ...], vals: tuple, params: dict | None = None):
    c, ctx, ts = _args(op, list(zip(names, vals)))
    aval = rules.elementwise(c, names, *[t.aval for t in ts])
    return _bind(ctx, c, op, ts, params or {}, aval)


def silu_mul(gate, up):
    return _elementwise("silu_mul", ("gate", "up"), (gate, up))


def gelu(x, approximate: str = "none"):
    """GELU: exact (erf, approximate="none") or the tanh form (approximate="tanh", GPT-2's
    gelu_new and Gemma's gelu_pytorch_tanh)."""
    if approximate not in ("none", "tanh"):
        raise TraceError(f"amk.ops.gelu: argument 'approximate' must be 'none' or 'tanh', "
                         f"got {approximate!r} (at {_trace.user_source_line()})")
    return _elementwise("gelu", ("x",), (x,), {"tanh": 1} if approximate == "tanh" else None)


def _binary(op: str, a, b, params: dict | None = None):
    c, ctx, ts = _args(op, [("a", a), ("b", b)])
    aval = rules.broadcast_binary(c, ("a", "b"), ts[0].aval, ts[1].aval)
    if ts[0].aval.shape != aval.shape:      # the vector first: swap (+ and * commute exactly)
        ts = ts[::-1]
    return _bind(ctx, c, op, ts, params or {}, aval)


def add(a, b):
    """a + b; either may be a vector [N] / [1, N] broadcast over the other's rows [B, N]."""
    return _binary("add", a, b)


def sub(a, b):
    """a - b, as add(a, mul(b, -1.0)): IEEE subtraction IS addition of the negation, and a
    negation is exact in every float format, so this is bit-identical to a - b (no new opcode)."""
    return add(a, mul(b, -1.0))


def mul(a, b=None, scale: float | None = None):
    """a * b (b may be a vector broadcast over a's rows, as in add), or a * scale (a Python float)."""
    if isinstance(b, (int, float)) and scale is None:
        b, scale = None, float(b)
    if b is None:
        if scale is None:
            raise TraceError("amk.ops.mul: give a second tensor 'b' or a float 'scale'")
        return _elementwise("mul", ("a",), (a,), {"scale": float(scale)})
    return _binary("mul", a, b)


def softcap(x, cap: float):
    """cap * tanh(x / cap) (Gemma 2's logit soft-capping), computed in that order as HF does."""
    if not float(cap) > 0:
        raise TraceError(f"amk.ops.softcap: argument 'cap' must be a positive float, got {cap} "
                         f"(at {_trace.user_source_line()})")
    return _elementwise("softcap", ("x",), (x,), {"cap": float(cap)})


def tanh(x):
    """tanh(x): softcap with cap 1 (x / 1 and 1 * t are exact, so this is plain tanh)."""
    return softcap(x, 1.0)


def softmax(x):
    return _elementwise("softmax", ("x",), (x,))


def argmax(logits, group: RankGroup | None = None):
    """Greedy token: argmax over the last axis of logits [B, V] -> int32 [B].

    With a group, logits is this rank's vocab slice [B, V/world] (rank r holds columns
    [r*V/world, (r+1)*V/world)) and the result is the global argmax over every rank's slice,
    the same token on every rank, lowest index on ties (as unsharded). Only (max, index) pairs
    cross ranks: a MAXLOC all-reduce."""
    c, ctx, (lt,) = _args("argmax", [("logits", logits)])
    params = _group_params(c, group)
    return _bind(ctx, c, "argmax", [lt], params, rules.argmax(c, lt.aval))


def allreduce(shards, group: RankGroup | None = None):
    """Sum of tensor-parallel partial sums.

    allreduce([x0, x1, ...]): the shards are all on this device (the single-device identity).
    allreduce(x, group): x is this rank's partial sum; every rank of the group gets the sum of
    all ranks' x (summed in rank order, so every rank holds the same bits)."""
    if group is not None:
        c, ctx, (xt,) = _args("allreduce", [("x", shards)])
        params = _group_params(c, group)
        aval = rules.allreduce(c, [xt.aval])
        return _bind(ctx, c, "allreduce", [xt], params, aval)
    if isinstance(shards, _trace.Tracer):
        raise TraceError(f"amk.ops.allreduce: one tensor needs group=amk.ops.RankGroup(rank, "
                         f"world) (a cross-rank all-reduce); shards on one device come as a list "
                         f"(at {_trace.user_source_line()})")
    names = tuple(f"shards[{i}]" for i in range(len(shards)))
    c, ctx, ts = _args("allreduce", list(zip(names, shards)))
    aval = rules.allreduce(c, [t.aval for t in ts])
    return _bind(ctx, c, "allreduce", ts, {}, aval)


def _group_params(c, group) -> dict:
    if group is None:
        return {}
    if not isinstance(group, RankGroup):
        c.fail("group", f"must be an amk.ops.RankGroup(rank, world), got {type(group).__name__}")
    return group.params()


def reshape(x, shape: Sequence[int]):
    """A view with a new shape (free: no data moves)."""
    c, ctx, (xt,) = _args("reshape", [("x", x)])
    shape = tuple(int(s) for s in shape)
    return _bind(ctx, c, "reshape", [xt], {"shape": shape}, rules.reshape(c, xt.aval, shape))


def cast(x, dtype: torch.dtype):
    c, ctx, (xt,) = _args("cast", [("x", x)])
    try:
        dt = DType.of(dtype)
    except TypeError as e:
        raise TraceError(f"amk.ops.cast: {e} (at {c.src})") from None
    return _bind(ctx, c, "cast", [xt], {"dtype": dt.short}, Aval(xt.aval.shape, dt))


def slice(x, start: int, stop: int):
    """Columns [start, stop) of x [B, N] -> [B, stop - start] (a COPY reading from column start)."""
    c, ctx, (xt,) = _args("slice", [("x", x)])
    aval = rules.column_slice(c, xt.aval, int(start), int(stop))
    return _bind(ctx, c, "slice", [xt], {"start": int(start), "stop": int(stop)}, aval)


def concat(xs: Sequence):
    """[B, N1], [B, N2], ... -> [B, N1 + N2 + ...] along the feature axis (one COPY per part)."""
    names = tuple(f"xs[{i}]" for i in range(len(xs)))
    c, ctx, ts = _args("concat", list(zip(names, xs)))
    aval = rules.concat(c, names, [t.aval for t in ts])
    return _bind(ctx, c, "concat", ts, {}, aval)
