"""`validate(program)`: a structural proof that a Program is race- and deadlock-free.

What is proved, from the program's structure alone (no execution):
  1. coverage: every column a task reads of an ACTIVATION or IO_OUTPUT buffer was written by a
     task it is guaranteed to follow;
  2. no races: two tasks that touch overlapping columns, one of them writing, are ordered;
  3. every wait threshold is reachable, at every decode step;
  4. the wait graph (and the per-SM queues, if any) admit a topological order: no deadlock;
  5. ids, arities, params, shapes and dtypes fit each opcode; read-only buffers are not written.

"B is guaranteed to follow A" means B waits on A's out-counter with a threshold that only the
completion of every incrementer can reach (threshold == init + incrementers); a smaller threshold
says nothing about which incrementers ran. Happens-before is the transitive closure of that,
kept as one ancestor bitset (a Python int) per task, built in topological order.

Races are checked on the hazard edges of amk.program.deps, computed over one sequential order
that contains happens-before: each conflicting pair is joined by a chain of those edges, so
checking the edges checks every pair. The edges come in shared groups, each checked with one
bitset operation (group & ~ancestors), so all-to-all tile patterns cost no per-edge work. Program order must also be a legal sequential execution
(ir.py's convention); that is checked separately.

Steps are serialised (one launch or VM run per step) and counters are monotonic, so a hazard
between two steps cannot happen: only hazards within one step are checked.
"""
from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from amk.errors import ValidationError
from amk.program.deps import RAW, WAR, WAW, scan
from amk.program.ir import Buffer, BufferKind, DType, InstructionKind as K, Program, Task
from amk.program.regions import PARTIAL_WRITE, Region, task_regions


@dataclass(frozen=True)
class ValidationIssue:
    kind: str
    message: str
    task: int | None = None
    buffer: int | None = None
    counter: int | None = None

    def __str__(self) -> str:
        return f"[{self.kind}] {self.message}"


@dataclass
class ValidationResult:
    program: str = "program"
    errors: list[ValidationIssue] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def report(self) -> str:
        if self.ok:
            return f"program '{self.program}': valid"
        lines = [f"program '{self.program}': {len(self.errors)} error(s)"]
        lines += [f"  {i + 1}. {e}" for i, e in enumerate(self.errors)]
        return "\n".join(lines)

    def raise_if_invalid(self) -> None:
        if not self.ok:
            raise ValidationError(self.report() + "\nfix the pass that built this program "
                                  "(dump it with AMK_DUMP_IR=DIR to see every stage)", self)

    def __str__(self) -> str:
        return self.report()


READ_ONLY = (BufferKind.WEIGHT, BufferKind.CONST, BufferKind.IO_INPUT)
MUST_BE_WRITTEN = (BufferKind.ACTIVATION, BufferKind.IO_OUTPUT)   # no value before the step
FLOATS = (DType.F32, DType.F16, DType.BF16, DType.F8E4M3, DType.F8E5M2)
INTS = (DType.I32, DType.I64)


def _t(task: Task) -> str:
    return f"t{task.id} {task.op.name}" + (f" ({task.name})" if task.name else "")


def _b(buf: Buffer) -> str:
    return f"b{buf.id} '{buf.name}'"


# ---------------------------------------------------------------------------------------------
# Per-opcode checks: arity, params, shapes, dtypes. Each check raises _Bad or returns messages.
# ---------------------------------------------------------------------------------------------
class _Bad(Exception):
    pass


class _Ctx:
    """One task's operands and params, with helpers that record what is wrong."""

    def __init__(self, task: Task, buffers: Sequence[Buffer]):
        self.task, self.p = task, task.params
        self.ins = [buffers[i] for i in task.inputs]
        self.outs = [buffers[o] for o in task.outputs]
        self.msgs: list[str] = []

    def bad(self, msg: str) -> None:
        self.msgs.append(msg)

    def int_(self, name: str, default: Any = None, lo: int | None = None) -> int:
        v = self.p.get(name, default)
        if v is None:
            self.bad(f"needs int param '{name}'")
            raise _Bad
        if isinstance(v, bool) or not isinstance(v, int):
            self.bad(f"param '{name}' must be an int, got {v!r}")
            raise _Bad
        if lo is not None and v < lo:
            self.bad(f"param '{name}'={v} must be >= {lo}")
            raise _Bad
        return v

    def dtype(self, buf: Buffer, allowed: Sequence[DType], role: str) -> None:
        if buf.dtype not in allowed:
            names = "/".join(d.short for d in allowed)
            self.bad(f"{role} {_b(buf)} has dtype {buf.dtype.short}, needs {names}")

    def numel(self, buf: Buffer, n: int, role: str) -> None:
        if buf.numel != n:
            self.bad(f"{role} {_b(buf)} has {buf.numel} elements {list(buf.shape)}, needs {n}")

    def tile(self, width: int | None = None) -> None:
        """n_off/N_tile (if given) lie inside the output's columns."""
        if "n_off" not in self.p and "N_tile" not in self.p:
            return
        cols = self.outs[0].cols if width is None else width
        n_off = self.int_("n_off", 0, lo=0)
        n_tile = self.int_("N_tile", cols - n_off, lo=1)
        if n_off + n_tile > cols:
            self.bad(f"tile n_off={n_off} + N_tile={n_tile} exceeds {cols} output columns")


def _same_numel(c: _Ctx, *idx: int) -> None:
    for i in idx:
        c.numel(c.ins[i], c.outs[0].numel, f"input {i}")


def _gemv(c: _Ctx) -> None:
    K_ = c.int_("K", lo=1)
    qdtype = c.int_("qdtype", 0)
    x, w, out = c.ins[0], c.ins[1], c.outs[0]
    if len(w.shape) != 2:
        c.bad(f"weight {_b(w)} must be 2-d [N, K], got {list(w.shape)}")
        raise _Bad
    N = w.shape[0]
    if qdtype in (DType.I8, DType.I4):
        if len(c.ins) < 3:
            c.bad(f"quantized (qdtype={qdtype}) needs inputs x, qW, scales[, zeros]")
            raise _Bad
        group = c.int_("group", lo=1)
        packed = (K_ + 1) // 2 if qdtype == DType.I4 else K_
        c.dtype(w, (DType.U8,) if qdtype == DType.I4 else (DType.I8,), "quantized weight")
        if w.shape[1] != packed:
            c.bad(f"quantized weight {_b(w)} has {w.shape[1]} columns, needs {packed} for K={K_}")
        n_groups = -(-K_ // group)
        for i, role in ((2, "scales"), (3, "zeros")):
            if i < len(c.ins):
                c.dtype(c.ins[i], FLOATS, role)
                if tuple(c.ins[i].shape) != (N, n_groups):
                    c.bad(f"{role} {_b(c.ins[i])} is {list(c.ins[i].shape)}, needs [{N}, {n_groups}]")
    elif qdtype == 0:
        if len(c.ins) > 3:
            c.bad("unquantized GEMV takes x, W[, bias]")
        c.dtype(w, FLOATS, "weight")
        if w.shape[1] != K_:
            c.bad(f"weight {_b(w)} is {list(w.shape)}, needs [N, K={K_}]")
        if len(c.ins) == 3:
            c.numel(c.ins[2], N, "bias")
    else:
        c.bad(f"qdtype={qdtype} is not 0, {int(DType.I8)} (I8) or {int(DType.I4)} (I4)")
    c.dtype(x, FLOATS, "x")
    c.dtype(out, FLOATS, "output")
    if x.cols != K_:
        c.bad(f"x {_b(x)} has {x.cols} columns, K={K_}")
    if out.cols != N:
        c.bad(f"output {_b(out)} has {out.cols} columns, weight has N={N} rows")
    elif x.cols == K_ and x.numel // K_ != out.numel // N:
        c.bad(f"x has {x.numel // K_} rows, output has {out.numel // N}")
    c.int_("n_off", lo=0)
    c.int_("N_tile", lo=1)
    c.tile(N)


def _heads(c: _Ctx, row: int, buf: Buffer, role: str, n_heads: int) -> int:
    """The batch size B of a buffer holding B x n_heads rows of `row` elements."""
    if buf.numel % (n_heads * row):
        c.bad(f"{role} {_b(buf)} has {buf.numel} elements, not a multiple of "
              f"n_heads*{row}={n_heads * row}")
        raise _Bad
    return buf.numel // (n_heads * row)


def _head_range(c: _Ctx, n_heads: int, group: int, flat: Sequence[tuple[Buffer, int]]) -> None:
    if "h_off" not in c.p and "h_count" not in c.p:
        return
    h_off = c.int_("h_off", lo=0)
    h_count = c.int_("h_count", lo=1)
    if h_off + h_count > n_heads:
        c.bad(f"heads [{h_off}, {h_off + h_count}) exceed n_heads={n_heads}")
    if h_off % group or h_count % group:
        c.bad(f"heads [{h_off}, {h_off + h_count}) split a kv group of {group} q heads")
    for buf, row in flat:    # a head range is a column range only on a flat view
        if buf.cols != n_heads * row:
            c.bad(f"h_off/h_count need {_b(buf)} flat with {n_heads}*{row} columns, "
                  f"got shape {list(buf.shape)}")


def _attention(c: _Ctx) -> None:
    hd = c.int_("head_dim", lo=1)
    n_heads = c.int_("n_heads", lo=1)
    n_kv = c.int_("n_kv_heads", lo=1)
    c.int_("kv_start", 0, lo=0)
    c.int_("kv_len", 0, lo=0)
    flags = c.int_("flags", 0, lo=0)
    if n_heads % n_kv:
        c.bad(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv}")
        raise _Bad
    q, kc, vc, out = c.ins[0], c.ins[1], c.ins[2], c.outs[0]
    B = _heads(c, hd, q, "q", n_heads)
    for buf, role in ((kc, "k_cache"), (vc, "v_cache")):
        if len(buf.shape) not in (3, 4) or tuple(buf.shape[-2:]) != (n_kv, hd):
            c.bad(f"{role} {_b(buf)} is {list(buf.shape)}, needs [(B,) max_seq, {n_kv}, {hd}]")
    if kc.shape != vc.shape:
        c.bad(f"k_cache {list(kc.shape)} and v_cache {list(vc.shape)} differ")
    if len(c.ins) > 3:
        c.dtype(c.ins[3], INTS, "pos")
        c.numel(c.ins[3], 1, "pos")
    row = hd + 2 if flags & PARTIAL_WRITE else hd
    c.numel(out, B * n_heads * row, "output" + (" (partial [acc|m|l])" if row != hd else ""))
    _head_range(c, n_heads, n_heads // n_kv, ((q, hd), (out, row)))


def _combine(c: _Ctx) -> None:
    hd = c.int_("head_dim", lo=1)
    first = c.ins[0]
    n_heads = c.int_("n_heads", first.numel // (hd + 2) or 1, lo=1)
    B = _heads(c, hd + 2, first, "partial 0", n_heads)
    for i, p in enumerate(c.ins[1:], 1):
        c.numel(p, first.numel, f"partial {i}")
    c.numel(c.outs[0], B * n_heads * hd, "output")
    _head_range(c, n_heads, 1, [(p, hd + 2) for p in c.ins] + [(c.outs[0], hd)])


def _rope(c: _Ctx) -> None:
    hd = c.int_("head_dim", lo=2)
    if hd % 2:
        c.bad(f"head_dim={hd} must be even")
    x = c.ins[0]
    if x.numel % hd:
        c.bad(f"x {_b(x)} has {x.numel} elements, not a multiple of head_dim={hd}")
    _same_numel(c, 0)
    c.dtype(c.ins[1], INTS, "pos")
    if len(c.ins) > 2:
        c.numel(c.ins[2], hd // 2, "inv_freq")
    c.tile()
    if ("n_off" in c.p or "N_tile" in c.p) and (c.p.get("n_off", 0) % hd or
                                                  c.p.get("N_tile", hd) % hd):
        c.bad(f"a rope tile must cover whole heads (multiples of head_dim={hd})")


def _elementwise(c: _Ctx) -> None:
    _same_numel(c, *((0,) if c.task.op is K.MUL else range(len(c.ins))))
    if c.task.op is K.MUL and len(c.ins) == 2:
        b, out = c.ins[1], c.outs[0]
        if b.numel not in (1, out.numel, out.cols):
            c.bad(f"input 1 {_b(b)} has {b.numel} elements: needs 1, {out.cols} or {out.numel}")
    if c.task.op is K.MUL and len(c.ins) == 1 and "scale" not in c.p:
        c.bad("MUL with one input needs param 'scale'")
    c.tile()


def _norm(c: _Ctx) -> None:
    x, w = c.ins[0], c.ins[1]
    H = w.numel
    if H == 0 or x.numel % H:
        c.bad(f"x {_b(x)} ({x.numel} elements) is not rows of H={H} (the weight's size)")
    if len(c.ins) > 2:
        c.numel(c.ins[2], H, "bias")
    _same_numel(c, 0)
    eps = c.p.get("eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        c.bad(f"eps must be a positive number, got {eps!r}")


def _embed(c: _Ctx) -> None:
    ids, table, out = c.ins[0], c.ins[1], c.outs[0]
    c.dtype(ids, INTS, "ids")
    if len(table.shape) != 2:
        c.bad(f"table {_b(table)} must be [V, H], got {list(table.shape)}")
        raise _Bad
    c.numel(out, ids.numel * table.shape[1], "output")


def _kv_append(c: _Ctx) -> None:
    new, pos, cache = c.ins[0], c.ins[1], c.outs[0]
    c.dtype(pos, INTS, "pos")
    c.numel(pos, 1, "pos")
    if cache.kind in READ_ONLY:
        c.bad(f"output {_b(cache)} is a read-only {cache.kind.name} buffer; KV_APPEND writes a cache "
              f"in place (a KV_CACHE, or the copy a non-donated cache gets)")
    if len(cache.shape) not in (3, 4):
        c.bad(f"cache {_b(cache)} must be [(B,) max_seq, n_kv, head_dim], got {list(cache.shape)}")
        raise _Bad
    c.numel(new, cache.numel // cache.shape[-3], "new")


def _argmax(c: _Ctx) -> None:
    c.dtype(c.outs[0], INTS, "output")
    c.numel(c.outs[0], c.ins[0].numel // c.ins[0].cols, "output")


def _dequant(c: _Ctx) -> None:
    c.int_("group", lo=1)
    c.int_("K", c.outs[0].cols, lo=1)
    c.dtype(c.ins[1], FLOATS, "scales")
    c.dtype(c.outs[0], FLOATS, "output")


def _fused(c: _Ctx) -> None:
    from amk.backends.reference.semantics import validate_recipe   # lands with the reference VM
    recipe = c.p.get("recipe")
    for msg in validate_recipe(recipe, len(c.ins), len(c.outs)):
        c.bad(f"malformed recipe: {msg}")


def _nothing(c: _Ctx) -> None:
    pass


def _all_same(c: _Ctx) -> None:
    _same_numel(c, *range(len(c.ins)))


ANY = 1 << 30
# op -> ((min inputs, max inputs), (min outputs, max outputs), check)
OPCODES: dict[K, tuple[tuple[int, int], tuple[int, int], Callable[[_Ctx], None]]] = {
    K.NOP: ((0, 0), (0, 0), _nothing),
    K.COPY: ((1, 1), (1, 1), _elementwise),
    K.EMBED: ((2, 2), (1, 1), _embed),
    K.RMSNORM: ((2, 2), (1, 1), _norm),
    K.LAYERNORM: ((2, 3), (1, 1), _norm),
    K.GEMV_TILE: ((2, 4), (1, 1), _gemv),
    K.GEMM_TILE: ((2, 4), (1, 1), _gemv),
    K.ATTENTION_TILE: ((3, 4), (1, 1), _attention),
    K.ATTENTION_COMBINE: ((1, ANY), (1, 1), _combine),
    K.ROPE: ((2, 3), (1, 1), _rope),
    K.SILU_MUL: ((2, 2), (1, 1), _elementwise),
    K.GELU: ((1, 1), (1, 1), _elementwise),
    K.ADD: ((2, 2), (1, 1), _elementwise),
    K.MUL: ((1, 2), (1, 1), _elementwise),
    K.DEQUANT: ((2, 3), (1, 1), _dequant),
    K.SOFTMAX: ((1, 1), (1, 1), _all_same),
    K.KV_APPEND: ((2, 2), (1, 1), _kv_append),
    K.SAMPLE_ARGMAX: ((1, 1), (1, 1), _argmax),
    K.ALLREDUCE_SHARD: ((1, ANY), (1, 1), _all_same),
    K.FUSED: ((0, ANY), (1, ANY), _fused),
}


def _check_opcode(task: Task, buffers: Sequence[Buffer]) -> list[str]:
    (imin, imax), (omin, omax), check = OPCODES[task.op]
    n_in, n_out = len(task.inputs), len(task.outputs)
    msgs = []
    if not imin <= n_in <= imax:
        msgs.append(f"takes {imin}{'' if imax == imin else '+' if imax == ANY else f'..{imax}'} "
                    f"inputs, got {n_in}")
    if not omin <= n_out <= omax:
        msgs.append(f"takes {omin}{'' if omax == omin else '+' if omax == ANY else f'..{omax}'} "
                    f"outputs, got {n_out}")
    if msgs:
        return msgs
    if not isinstance(task.params, Mapping):
        return [f"params must be a mapping, got {type(task.params).__name__}"]
    c = _Ctx(task, buffers)
    try:
        check(c)
    except _Bad:
        pass
    return c.msgs


# ---------------------------------------------------------------------------------------------
# The proof
# ---------------------------------------------------------------------------------------------
def _check_ids(prog: Program, err) -> None:
    nb, nc, nt = len(prog.buffers), len(prog.counters), len(prog.tasks)
    for i, b in enumerate(prog.buffers):
        if b.id != i:
            err("ids", f"buffer at index {i} ('{b.name}') has id {b.id}; ids must be dense", buffer=i)
        if any(not isinstance(s, int) or s < 1 for s in b.shape):
            err("ids", f"buffer {_b(b)} has a bad shape {list(b.shape)}", buffer=i)
    for i, c in enumerate(prog.counters):
        if c.id != i:
            err("ids", f"counter at index {i} has id {c.id}; ids must be dense", counter=i)
    for i, t in enumerate(prog.tasks):
        if t.id != i:
            err("ids", f"task at index {i} ({t.op.name} {t.name}) has id {t.id}; ids must be "
                f"dense and equal to the position in program.tasks", task=i)
        for role, bids in (("input", t.inputs), ("output", t.outputs)):
            for b in bids:
                if not (isinstance(b, int) and 0 <= b < nb):
                    err("ids", f"{_t(t)} names {role} buffer {b!r}, which does not exist "
                        f"(program has {nb} buffers)", task=i)
        for w in t.waits:
            if not (isinstance(w.counter, int) and 0 <= w.counter < nc):
                err("ids", f"{_t(t)} waits on counter {w.counter!r}, which does not exist", task=i)
        if not (isinstance(t.out_counter, int) and 0 <= t.out_counter < nc):
            err("ids", f"{_t(t)} increments counter {t.out_counter!r}, which does not exist", task=i)
    for b in prog.outputs:
        if not (isinstance(b, int) and 0 <= b < nb):
            err("ids", f"program output {b!r} is not a buffer id")
    for q, queue in enumerate(prog.queues):
        for t in queue:
            if not (isinstance(t, int) and 0 <= t < nt):
                err("queue", f"queue {q} lists task {t!r}, which does not exist")


def _topological(n_tasks: int, n_counters: int, incr: list[list[int]], tasks: Sequence[Task],
                 extra_succ: dict[int, list[int]] | None = None):
    """Kahn's algorithm over tasks (0..n-1) and counters (n..n+m-1). Edges: incrementer ->
    counter -> waiter (+ extra task->task edges). Returns (order of task ids, set of stuck tasks)."""
    n = n_tasks
    indeg = [0] * (n + n_counters)
    for t in tasks:
        indeg[t.id] = len({w.counter for w in t.waits})
    waiters: list[list[int]] = [[] for _ in range(n_counters)]
    for t in tasks:
        for c in {w.counter for w in t.waits}:
            waiters[c].append(t.id)
    for c in range(n_counters):
        indeg[n + c] = len(incr[c])
    for a, succs in (extra_succ or {}).items():
        for s in succs:
            indeg[s] += 1
    ready = deque(i for i in range(n + n_counters) if indeg[i] == 0)
    order: list[int] = []
    while ready:
        v = ready.popleft()
        if v < n:
            order.append(v)
            succ = [n + tasks[v].out_counter] + (extra_succ or {}).get(v, [])
        else:
            succ = waiters[v - n]
        for s in succ:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    stuck = set(range(n)) - set(order)
    return order, stuck


def _cycles(stuck: set[int], tasks: Sequence[Task], incr: list[list[int]],
            extra_pred: dict[int, list[int]] | None = None) -> list[list[int]]:
    """Cycles among stuck tasks: walk back through stuck predecessors until a repeat."""
    seen: set[int] = set()
    cycles = []
    for start in sorted(stuck):
        if start in seen:
            continue
        path: list[int] = []
        on_path: dict[int, int] = {}
        v = start
        while v not in seen:
            seen.add(v)
            on_path[v] = len(path)
            path.append(v)
            preds = [u for w in tasks[v].waits for u in incr[w.counter] if u in stuck]
            preds += [u for u in (extra_pred or {}).get(v, []) if u in stuck]
            if not preds:
                break
            v = preds[0]
        if v in on_path:
            cyc = list(reversed(path[on_path[v]:]))     # in execution order: u waits for ...
            k = cyc.index(min(cyc))
            cycles.append(cyc[k:] + cyc[:k])            # start at the smallest id (stable text)
    return cycles


# Proofs already done, by program object: a Program is immutable, so the pipeline's final check
# also serves the backend that loads it (and a program read back from the disk cache, which was
# proved before it was written, is remembered as proved).
_PROVEN: dict[int, ValidationResult] = {}


def remember(program: Program, result: ValidationResult) -> None:
    key = id(program)
    if key not in _PROVEN:
        _PROVEN[key] = result
        weakref.finalize(program, _PROVEN.pop, key, None)


def validate(program: Program) -> ValidationResult:
    """Prove `program` race- and deadlock-free from its structure; every error is listed."""
    hit = _PROVEN.get(id(program))
    if hit is None:
        hit = _validate(program)
        remember(program, hit)
    return hit


def _validate(program: Program) -> ValidationResult:
    res = ValidationResult(program.name)

    def err(kind, message, task=None, buffer=None, counter=None):
        res.errors.append(ValidationIssue(kind, message, task, buffer, counter))

    _check_ids(program, err)
    if res.errors:      # later checks index by these ids
        err("ids", "structural analysis skipped until the ids above are fixed")
        return res
    bufs, tasks, counters = program.buffers, program.tasks, program.counters
    n, m = len(tasks), len(counters)

    # (5) opcodes, regions, read-only buffers
    regions: list[tuple[list[Region], list[Region]]] = []
    for t in tasks:
        for msg in _check_opcode(t, bufs):
            err("opcode", f"{_t(t)}: {msg}", task=t.id)
        try:
            rw = task_regions(t, bufs)
        except Exception as e:  # a malformed task already reported above; do not crash on it
            err("opcode", f"{_t(t)}: cannot tell which columns it touches ({e!r})", task=t.id)
            rw = ([], [])
        regions.append(rw)
        for r in rw[1]:
            b = bufs[r.buffer]
            if b.kind in READ_ONLY:
                err("readonly", f"{_t(t)} writes {b.kind.name} buffer {_b(b)}, which is read "
                    f"only", task=t.id, buffer=b.id)

    # (3) thresholds: reachable at step 1 (init + incrementers) and at every later step,
    # where the wait is counter >= threshold * epoch and the counter gains `incrementers` a step.
    incr: list[list[int]] = [[] for _ in range(m)]
    for t in tasks:
        incr[t.out_counter].append(t.id)
    for t in tasks:
        for w in t.waits:
            c, k = counters[w.counter], len(incr[w.counter])
            if w.threshold < 1:
                err("threshold", f"{_t(t)} waits c{c.id} >= {w.threshold}: thresholds must be "
                    f">= 1 (drop a wait that is always true)", task=t.id, counter=c.id)
            elif w.threshold > c.init + k:
                err("threshold", f"{_t(t)} waits c{c.id} >= {w.threshold}, but c{c.id} starts at "
                    f"{c.init} and only {k} task(s) increment it: never reached (deadlock)",
                    task=t.id, counter=c.id)
            elif w.threshold > k:
                err("threshold", f"{_t(t)} waits c{c.id} >= {w.threshold} with only {k} "
                    f"incrementer(s): reached at step 1 thanks to init={c.init}, but step e "
                    f"needs {w.threshold}*e and the counter gains only {k} a step (deadlock at "
                    f"step 2)", task=t.id, counter=c.id)

    # (4) the wait graph is acyclic
    order, stuck = _topological(n, m, incr, tasks)
    cycles = _cycles(stuck, tasks, incr)
    for cyc in cycles:
        names = " -> ".join(f"t{i}" for i in cyc + cyc[:1])
        err("cycle", f"wait cycle (deadlock): {names}; "
            + "; ".join(_t(tasks[i]) for i in cyc), task=cyc[0])
    if stuck and not cycles:
        err("cycle", f"{len(stuck)} task(s) can never start: {sorted(stuck)[:16]}")

    # program order must be a legal sequential execution (the race proof below relies on it)
    order_is_legal = not stuck
    if not stuck:
        value = [c.init for c in counters]
        for t in tasks:
            for w in t.waits:
                if value[w.counter] < w.threshold <= counters[w.counter].init + len(incr[w.counter]):
                    order_is_legal = False
                    err("order", f"{_t(t)} comes before enough incrementers of c{w.counter} in "
                        f"program order (waits >= {w.threshold}, {value[w.counter]} before it): "
                        f"program order must be a legal execution", task=t.id, counter=w.counter)
            value[t.out_counter] += 1

    # per-SM queues: each task exactly once, and all queues consistent with one topological order
    if program.queues:
        _check_queues(program, incr, stuck, err)

    # happens-before: ancestor bitsets in topological order (stuck tasks never run; skipped)
    anc = [0] * n
    full: list[int | None] = [None] * m     # everything that precedes c's last increment

    def counter_closure(c: int) -> int:
        v = full[c]
        if v is None:
            v = 0
            for i in incr[c]:
                v |= anc[i] | (1 << i)
            full[c] = v
        return v

    for t_id in order:
        t = tasks[t_id]
        a = 0
        for w in t.waits:
            if w.threshold >= counters[w.counter].init + len(incr[w.counter]):
                a |= counter_closure(w.counter)
        anc[t_id] = a

    # (1) + (2) coverage and races, over the hazard edges of a sequential order that contains
    # happens-before: program order if it is legal, else the topological order (stuck tasks
    # never run and are left out). Every conflicting pair is joined by a chain of hazard edges,
    # so if every edge is ordered by happens-before, so is every pair, whatever the order.
    scan_order = range(n) if order_is_legal else order
    unwritten: list[tuple[int, Region]] = []
    scanned = [tasks[i] for i in scan_order]
    mask_cache: dict[int, tuple[object, int]] = {}     # id(shared group) -> (group, bitset)

    def mask_of(group) -> int:
        hit = mask_cache.get(id(group))
        if hit is not None and hit[0] is group:
            return hit[1]
        m = 0
        for i in group:
            m |= 1 << i
        if isinstance(group, frozenset):
            mask_cache[id(group)] = (group, m)
        return m

    conflicts = scan(bufs, scanned, [regions[i] for i in scan_order], unwritten, masks=True)
    for b, found in zip(scanned, conflicts):
        not_anc = ~anc[b.id]
        for kind, buffer, lo, hi, group, mask in found:
            bad = (mask_of(group) if mask is None else mask) & not_anc
            if bad:
                _report_conflict(err, b, kind, bufs[buffer], lo, hi, bad, tasks, counters, incr)
    for t_id, r in unwritten:
        buf = bufs[r.buffer]
        if buf.kind in MUST_BE_WRITTEN:
            err("coverage", f"{_t(tasks[t_id])} reads {_b(buf)} cols [{r.lo}, {r.hi}) that no "
                f"earlier task writes ({buf.kind.name} holds nothing before the step)",
                task=t_id, buffer=buf.id)
    _check_outputs_written(program, regions, err)
    return res


def _check_outputs_written(program: Program, regions, err) -> None:
    """Every column of a returned ACTIVATION/IO_OUTPUT buffer is written by some task: the
    caller would otherwise read whatever the buffer held."""
    wanted = {b for b in program.outputs if program.buffers[b].kind in MUST_BE_WRITTEN}
    spans: dict[int, list[tuple[int, int]]] = {b: [] for b in wanted}
    for _, writes in regions:
        for r in writes:
            if r.buffer in spans:
                spans[r.buffer].append((r.lo, r.hi))
    for b in sorted(wanted):
        buf, covered, gap_end = program.buffers[b], 0, None
        for lo, hi in sorted(spans[b]):
            if lo > covered:
                gap_end = lo
                break
            covered = max(covered, hi)
        if covered < buf.cols:
            end = gap_end if gap_end is not None else buf.cols
            err("coverage", f"output {_b(buf)} cols [{covered}, {end}) are never written: "
                f"the caller would read stale memory", buffer=b)


def _report_conflict(err, b: Task, kind: str, buf: Buffer, lo: int, hi: int, bad: int,
                     tasks, counters, incr) -> None:
    """One error for task b and the earlier tasks (bits of `bad`) it is not ordered after."""
    offenders = []
    rest = bad
    while rest and len(offenders) < 4:
        low = rest & -rest
        offenders.append(low.bit_length() - 1)
        rest ^= low
    more = bin(rest).count("1")
    names = ", ".join(_t(tasks[i]) for i in offenders) + (f" and {more} more" if more else "")
    a = tasks[offenders[0]]
    cols = f"cols [{lo}, {hi})"
    hint = (f"make t{b.id} wait on c{a.out_counter} with threshold "
            f"{counters[a.out_counter].init + len(incr[a.out_counter])} (all its incrementers) "
            f"or on something that does")
    if kind == RAW and buf.kind in MUST_BE_WRITTEN:
        err("coverage", f"{_t(b)} reads {_b(buf)} {cols} written by {names}, which it is not "
            f"guaranteed to follow; {hint}", task=b.id, buffer=buf.id)
    else:
        what = {RAW: "reads {b} {c}, written by {a}", WAR: "overwrites {b} {c}, read by {a}",
                WAW: "overwrites {b} {c}, written by {a}"}[kind]
        err("race", f"{_t(b)} " + what.format(b=_b(buf), c=cols, a=names)
            + f", and they may run at the same time ({kind}); {hint}", task=b.id, buffer=buf.id)


def _check_queues(program: Program, incr, stuck, err) -> None:
    tasks = program.tasks
    where: dict[int, int] = {}
    for q, queue in enumerate(program.queues):
        for t in queue:
            if t in where:
                err("queue", f"t{t} is listed twice (queues {where[t]} and {q})", task=t)
            where[t] = q
    missing = [t.id for t in tasks if t.id not in where]
    if missing:
        err("queue", f"{len(missing)} task(s) are in no queue: {missing[:16]}", task=missing[0])
    if stuck:
        return
    succ: dict[int, list[int]] = {}
    pred: dict[int, list[int]] = {}
    for queue in program.queues:
        for a, b in zip(queue, queue[1:]):
            succ.setdefault(a, []).append(b)
            pred.setdefault(b, []).append(a)
    _, q_stuck = _topological(len(tasks), len(program.counters), incr, tasks, succ)
    for cyc in _cycles(q_stuck, tasks, incr, pred):
        names = " -> ".join(f"t{i}" for i in cyc + cyc[:1])
        err("queue", f"queue order contradicts the waits (per-SM deadlock): {names}; an SM "
            f"runs its queue in order, so t{cyc[0]} waits for a task queued behind it; "
            "order every queue by one topological order of the waits", task=cyc[0])
