"""lower: graph IR -> Program. One task per op, one buffer per value, one counter per task.

Each task waits (threshold 1) on the tasks that wrote the buffers it reads. A reshape is a COPY
into a buffer of the new shape (a buffer's last axis is what tasks tile and the validator
reasons about); kv_update writes the donated cache in place (a non-donated cache is first copied,
so the function stays functional).
"""
from __future__ import annotations

from typing import Callable

from amk.errors import TraceError
from amk.graph import Eqn, Graph, Var
from amk.program.ir import (Buffer, BufferKind, Counter, DType, InstructionKind as K, Program,
                            Task, Wait)

I4, I8 = int(DType.I4), int(DType.I8)


def _qdtype(bits: int, q: Var) -> int:
    """The GEMV/DEQUANT qdtype of a QuantizedWeight: I4, I8, or F8E4M3 for an fp8 q."""
    return int(DType.F8E4M3) if q.aval.dtype is DType.F8E4M3 else I4 if bits == 4 else I8


def _linear(e: Eqn, ins: list[Var]) -> tuple[K, dict]:
    x, w = ins[0].aval, ins[1].aval
    op = K.GEMV_TILE if x.shape[0] == 1 else K.GEMM_TILE
    return op, {"n_off": 0, "N_tile": w.shape[0], "K": w.shape[1]}


def _qlinear(e: Eqn, ins: list[Var]) -> tuple[K, dict]:
    p = e.p
    x, q = ins[0].aval, ins[1].aval
    op = K.GEMV_TILE if x.shape[0] == 1 else K.GEMM_TILE
    return op, {"n_off": 0, "N_tile": q.shape[0], "K": x.shape[1],
                "qdtype": _qdtype(p["bits"], ins[1]), "group": p["group"],
                **({"bias": 1} if p.get("bias") else {})}


def _dequant(e: Eqn, ins: list[Var]) -> tuple[K, dict]:
    p = e.p
    k = e.outputs[0].aval.shape[1]
    return K.DEQUANT, {"qdtype": _qdtype(p["bits"], ins[0]), "group": p["group"], "K": k}


def _attention(e: Eqn, ins: list[Var]) -> tuple[K, dict]:
    p = e.p
    max_seq = ins[1].aval.shape[-3]
    extra = {k: p[k] for k in ("window", "softcap") if k in p}    # sliding window, soft-cap
    return K.ATTENTION_TILE, {"head_dim": p["head_dim"], "n_heads": p["n_heads"],
                              "n_kv_heads": p["n_kv_heads"], "scale": p["scale"],
                              "kv_start": 0, "kv_len": max_seq, "flags": 0, **extra}


def _slice(e: Eqn, ins: list[Var]) -> tuple[K, dict]:
    # COPY's x_off (ext): out[..., 0:w] = x[..., start:start+w]
    p = e.p
    return K.COPY, {"x_off": p["start"], "n_off": 0, "N_tile": p["stop"] - p["start"]}


def _argmax(e: Eqn, ins: list[Var]) -> tuple[K, dict]:
    # with a rank group: the cross-rank MAXLOC all-reduce (amk/program/collectives.py)
    p = e.p
    if "world" in p:
        return K.ALLREDUCE_SHARD, {"rank": p["rank"], "world": p["world"], "reduce": "maxloc"}
    return K.SAMPLE_ARGMAX, {}


def _simple(op: K, keep: tuple[str, ...] = ()) -> Callable:
    return lambda e, ins: (op, {k: v for k, v in e.params if k in keep})


# prim -> (Eqn, input vars) -> (opcode, params). Input order is the opcode's (docs/PROGRAM.md).
LOWERING: dict[str, Callable[[Eqn, list[Var]], tuple[K, dict]]] = {
    "embed": _simple(K.EMBED),
    "rmsnorm": _simple(K.RMSNORM, ("eps",)),
    "layernorm": _simple(K.LAYERNORM, ("eps",)),
    "linear": _linear,
    "qlinear": _qlinear,
    "dequant": _dequant,
    "rope": _simple(K.ROPE, ("head_dim", "theta")),
    "attention": _attention,
    "silu_mul": _simple(K.SILU_MUL),
    "gelu": _simple(K.GELU, ("tanh",)),
    "softcap": _simple(K.SOFTCAP, ("cap",)),
    "slice": _slice,
    "add": _simple(K.ADD),
    "mul": _simple(K.MUL, ("scale",)),
    "softmax": _simple(K.SOFTMAX),
    "argmax": _argmax,
    "allreduce": _simple(K.ALLREDUCE_SHARD, ("rank", "world")),
    "cast": _simple(K.COPY),
    "reshape": _simple(K.COPY),     # columns change meaning, so the new shape gets its own buffer
}


def operand_order(e: Eqn) -> list[Var]:
    """The equation's inputs in its opcode's operand order (the graph interpreter uses it too).
    EMBED takes (ids, table) in the seed's order; the op API takes (table, ids)."""
    if e.prim == "embed":
        return [e.inputs[1], e.inputs[0]]
    return list(e.inputs)


def _task_name(e: Eqn, paths: dict[int, str]) -> str:
    weights = [paths[v.id] for v in e.inputs if v.id in paths and paths[v.id].startswith("params")]
    what = f"{e.prim}({weights[0]})" if weights else e.prim
    return f"{what} @ {e.src}" if e.src else what


class _Builder:
    def __init__(self, g: Graph):
        self.g = g
        self.buffers: list[Buffer] = []
        self.tasks: list[Task] = []
        self.buf_of: dict[int, int] = {}          # var id -> buffer id
        self.last_writer: dict[int, int] = {}     # buffer id -> task id
        self.paths = dict(zip((v.id for v in g.inputs), g.input_paths))
        self.outputs = {v.id for v in g.outputs}
        self.eqn = -1                             # the equation being lowered (-1: inputs)
        self.buffer_eqn: list[int] = []           # per buffer, the equation that made it
        self.task_eqn: list[int] = []             # per task, the equation it lowers

    def buffer(self, name: str, kind: BufferKind, var: Var, source: str = "") -> int:
        b = Buffer(len(self.buffers), name, kind, var.aval.dtype, var.aval.shape, source)
        self.buffers.append(b)
        self.buffer_eqn.append(self.eqn)
        return b.id

    def task(self, op: K, ins: list[int], outs: list[int], params: dict, name: str) -> int:
        tid = len(self.tasks)
        # Follow the last writer of every buffer read (RAW) or written (WAW: an in-place
        # update after a copy). Nothing is read before it is overwritten: no buffer is reused.
        deps = sorted({self.last_writer[b] for b in (*ins, *outs) if b in self.last_writer})
        waits = tuple(Wait(d, 1) for d in deps)
        self.tasks.append(Task(tid, op, tuple(ins), tuple(outs), params, waits, tid, name))
        self.task_eqn.append(self.eqn)
        for b in outs:
            self.last_writer[b] = tid
        return tid

    def out_buffer(self, v: Var) -> int:
        kind = BufferKind.IO_OUTPUT if v.id in self.outputs else BufferKind.ACTIVATION
        bid = self.buffer(f"v{v.id}", kind, v)
        self.buf_of[v.id] = bid
        return bid


def _last_uses(g: Graph) -> dict[int, int]:
    last: dict[int, int] = {}
    for i, e in enumerate(g.eqns):
        for v in e.inputs:
            last[v.id] = i
    for v in g.outputs:
        last[v.id] = len(g.eqns)
    return last


def lower(g: Graph, opts=None) -> Program:
    return lower_with_origins(g)[0]


def lower_with_origins(g: Graph) -> tuple[Program, list[int], list[int]]:
    """lower(g), and the index of the equation each task and each buffer came from (-1 for
    the inputs' buffers): passes/stamp.py maps a layer's tasks by them."""
    b = _Builder(g)
    for v, path, kind in zip(g.inputs, g.input_paths, g.input_kinds):
        b.buf_of[v.id] = b.buffer(path, kind, v, source=path)
    last_use = _last_uses(g)

    for i, e in enumerate(g.eqns):
        b.eqn = i
        name = _task_name(e, b.paths)
        if e.prim == "reshape" and e.outputs[0].aval.shape == e.inputs[0].aval.shape:
            b.buf_of[e.outputs[0].id] = b.buf_of[e.inputs[0].id]
            continue
        if e.prim == "kv_update":
            cache, new, pos = e.inputs
            if last_use.get(cache.id, -1) > i:
                raise TraceError(f"kv_update at {e.src}: the old cache ({b.paths.get(cache.id, cache)}) "
                                 f"is used again after it was updated; use the cache kv_update returns")
            cb = b.buf_of[cache.id]
            if b.buffers[cb].kind != BufferKind.KV_CACHE:
                # Not donated: copy, then update the copy (the caller's tensor stays unchanged).
                copy = b.out_buffer(e.outputs[0])
                b.task(K.COPY, [cb], [copy], {}, f"copy of {b.buffers[cb].name} @ {e.src}")
                cb = copy
            b.buf_of[e.outputs[0].id] = cb
            b.task(K.KV_APPEND, [b.buf_of[new.id], b.buf_of[pos.id]], [cb], {}, name)
            continue
        if e.prim == "concat":
            # one COPY per part into its columns; each waits for the last (WAW), so a reader
            # that waits for the last part has them all
            out, lo = b.out_buffer(e.outputs[0]), 0
            for v in e.inputs:
                w = v.aval.shape[1]
                b.task(K.COPY, [b.buf_of[v.id]], [out], {"n_off": lo, "N_tile": w, "x_off": 0}, name)
                lo += w
            continue
        rule = LOWERING.get(e.prim)
        if rule is None:
            raise TraceError(f"lower: no lowering for primitive {e.prim!r} (at {e.src})")
        op, params = rule(e, list(e.inputs))
        ins = [b.buf_of[v.id] for v in operand_order(e)]
        out = b.out_buffer(e.outputs[0])
        b.task(op, ins, [out], params, name)

    counters = tuple(Counter(t.id) for t in b.tasks)
    outputs = tuple(b.buf_of[v.id] for v in g.outputs)
    return (Program(tuple(b.buffers), counters, tuple(b.tasks), (), g.name, outputs),
            b.task_eqn, b.buffer_eqn)
