"""The cost model `place` balances: bytes moved (weights + activations) and flops, per task.

A task's time on one SM is max(bytes / per-SM bandwidth, flops / per-SM flop rate) plus a fixed
dispatch overhead (Target.task_overhead_ns). Decode is memory-bound, so bytes dominate: a GEMV
tile counts the weight rows it streams, its input vector and its output columns. Attention
counts the KV rows of its shard (the full shard: the model is sized for the longest context).
FUSED counts each step with scratch operands free (they stay on chip).
"""
from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

from amk.identity_memo import IdentityMemo
from amk.passes.options import H200, Target
from amk.program.ir import Buffer, DType, InstructionKind as K, Task
from amk.program.regions import k_range
from amk.program.recipe import INPUT, OUTPUT, recipe_of

GEMV = (K.GEMV_TILE, K.GEMM_TILE)
_ITEMSIZE = {d: d.itemsize for d in DType if d is not DType.I4}


def nbytes(b: Buffer) -> int:
    return b.numel * _ITEMSIZE[b.dtype]


class Cost(NamedTuple):
    bytes: float
    flops: float

    def __add__(self, o):  # type: ignore[override]
        return Cost(self.bytes + o.bytes, self.flops + o.flops)


def _tile_frac(params: Mapping, cols: int) -> float:
    if "N_tile" in params and cols:
        return min(1.0, int(params["N_tile"]) / cols)
    return 1.0


def step_cost(op: K, ins: Sequence[Buffer | None], out: Buffer | None, params: Mapping,
              out_cols: int | None) -> Cost:
    """Cost of one primitive op; None operands are on-chip scratch (free)."""
    if op in GEMV and len(ins) >= 2 and ins[1] is not None:
        w = ins[1]
        n = w.shape[0]
        frac = min(1.0, int(params.get("N_tile", n)) / max(n, 1))
        k = int(params.get("K", w.shape[-1]))
        lo, hi = k_range(params, k)
        kf = (hi - lo) / max(k, 1)                                   # a K slice's share of K
        nb = sum(nbytes(b) for b in ins[1:] if b is not None) * frac * kf
        x = ins[0]
        m = (x.numel // max(k, 1)) if x is not None else 1
        if x is not None:
            nb += nbytes(x) * kf
        if out is not None:
            nb += nbytes(out) * frac
        return Cost(nb, 2.0 * m * k * n * frac * kf)
    if op is K.ATTENTION_TILE and len(ins) >= 3 and ins[1] is not None:
        kc = ins[1]
        hd = int(params.get("head_dim", kc.shape[-1]))
        nkv = int(params.get("n_kv_heads", kc.shape[-2]))
        nh = int(params.get("n_heads", nkv))
        hc = int(params.get("h_count", nh))
        kvh = max(1, hc * nkv // max(nh, 1))
        # a shard reads its piece of the window (costed at a full window: the worst step)
        rows = -(-int(params.get("kv_len", kc.shape[-3])) // int(params.get("kv_shards", 1)))
        seqs = kc.numel // (kc.shape[-3] * kc.shape[-2] * kc.shape[-1])
        batch = int(params.get("b_count", seqs))         # a batched task's own sequences
        nb = 2.0 * batch * rows * kvh * hd * _ITEMSIZE[kc.dtype]
        share = hc / max(nh, 1) * batch / max(seqs, 1)
        nb += sum(nbytes(b) * share for b in (ins[0], out) if b is not None)
        return Cost(nb, 4.0 * batch * hc * rows * hd)
    if op is K.KV_APPEND:
        nb = 2.0 * nbytes(ins[0]) if ins and ins[0] is not None else 0.0
        return Cost(nb, 0.0)
    if op is K.EMBED:       # reads one table row per sequence, not the table
        nb = 2.0 * nbytes(out) if out is not None else 0.0
        return Cost(nb, 0.0)
    cols = out_cols or 0
    frac = _tile_frac(params, cols)
    if op is K.ATTENTION_COMBINE and "h_count" in params:
        frac = int(params["h_count"]) / max(int(params.get("n_heads", 1)), 1)
    nb = 0.0
    elems = 0.0
    for b in ins:
        if b is not None:
            f = frac if (b.cols == cols or op is K.ATTENTION_COMBINE) else 1.0
            nb += nbytes(b) * f
            elems += b.numel * f
    if out is not None:
        nb += nbytes(out) * frac
    return Cost(nb, 4.0 * elems)


def task_cost(task: Task, buffers: Sequence[Buffer]) -> Cost:
    if task.op is not K.FUSED:
        out = buffers[task.outputs[0]] if task.outputs else None
        return step_cost(task.op, [buffers[b] for b in task.inputs], out, task.params,
                         out.cols if out is not None else None)
    total = Cost(0.0, 0.0)
    for st in recipe_of(task).steps:
        ins = [buffers[task.inputs[a.index]] if a.kind == INPUT else None for a in st.args]
        out = buffers[task.outputs[st.out.index]] if st.out.kind == OUTPUT else None
        cols = out.cols if out is not None else (st.out_shape or (0,))[-1]
        total = total + step_cost(st.op, ins, out, st.params, cols)
    return total


def cost_ns(task: Task, buffers: Sequence[Buffer], target: Target = H200,
            memo: IdentityMemo | None = None) -> float:
    """Simulated nanoseconds of `task`. memo: one the caller keeps for one program; FUSED
    tasks with the same recipe object over operands of the same shapes and dtypes cost the same
    (a decoder's layers repeat: the 8B shape's 20.8k tasks have a few hundred costs)."""
    if memo is None or task.op is not K.FUSED:
        return _cost_ns(task, buffers, target)
    # each buffer's (shape, dtype) numbered once per buffers object (the memo holds it)
    numbers = memo.get(buffers, None, lambda: _numbered(buffers))
    shapes = tuple(map(numbers.__getitem__, task.inputs + task.outputs))
    return memo.get(task.params.get("recipe"), shapes, lambda: _cost_ns(task, buffers, target))


def _numbered(buffers: Sequence[Buffer]) -> list[int]:
    ids: dict[tuple, int] = {}
    return [ids.setdefault((b.shape, b.dtype), len(ids)) for b in buffers]


def _cost_ns(task: Task, buffers: Sequence[Buffer], target: Target) -> float:
    c = task_cost(task, buffers)
    sms = max(target.num_sms, 1)
    mem = c.bytes / (target.mem_bw / sms) * 1e9
    comp = c.flops / (target.flops / sms) * 1e9
    return max(mem, comp) + target.task_overhead_ns
