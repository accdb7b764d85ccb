"""fuse: fold producer -> consumer chains into FUSED recipe tasks (docs/PROGRAM.md, FUSED).

One rewrite, applied to producers in program order: a producer A whose single output Y is a
private ACTIVATION is *inlined* into every task that reads Y, and then deleted:
  consumer' = FUSED[ A's steps writing a scratch shaped and typed like Y ; consumer's steps
              reading that scratch instead of Y ]
It is allowed when, for every reader B,
  * (root op of A, root op of B) is a fuse rule (opts.rules; a FUSED task's root op is the op of
    the step writing its first output), e.g. RMSNORM -> GEMV_TILE, GEMV_TILE -> ADD;
  * B reads only columns of Y that A writes (the scratch holds exactly those), and no task
    between A and B writes what A reads (A now runs at B's place);
  * A is cheap to recompute (norms, rope, elementwise) if it has several readers: an rmsnorm is
    recomputed by each q/k/v tile, a GEMV tile is never duplicated.
Chains follow from the order: norm -> gate tile, norm -> up tile, then gate tile' -> silu tile,
up tile' -> silu tile' (the duplicate norm step is merged by common-step elimination).
Every scratch carries the unfused buffer's shape and dtype, so the result is bit-identical.
Buffers nobody touches any more are dropped and ids renumbered densely; then `resync`.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from dataclasses import dataclass

from amk.gcpause import without_gc
from amk.identity_memo import IdentityMemo
from amk.passes.options import PassOptions
from amk.passes.sync import rebuilt, regions_of, remember_regions, resync
from amk.program.ir import (Buffer, BufferKind, DType, InstructionKind as K, Program, Task,
                            new_task)
from amk.program.recipe import INPUT, OUTPUT, SCRATCH, Recipe, Step, operand, recipe_of
from amk.program.regions import Region, merge

# Ops cheap enough to recompute in every reader (no weight matrix streamed). A combine reads
# every partial (P x heads x (hd+2) floats), still cheaper than a task hand-off on a GPU; it is
# only recomputed where a rule allows it (options.COMBINE_INTO_GEMV, the cuda backend's).
CHEAP = frozenset({K.RMSNORM, K.LAYERNORM, K.ROPE, K.ADD, K.MUL, K.SILU_MUL, K.GELU, K.COPY,
                   K.ATTENTION_COMBINE})
READ_ONLY = (BufferKind.WEIGHT, BufferKind.CONST, BufferKind.IO_INPUT)


# A step while fusing: a recipe Step whose operands are ("b", buffer id) or ("s", scratch id)
# (scratch ids unique across the whole pass); to_task turns them into the task's Operands.
@dataclass(frozen=True)
class _Step:
    op: K
    args: tuple[tuple[str, int], ...]
    out: tuple[str, int]
    params: dict
    out_shape: tuple[int, ...] | None = None
    out_dtype: DType | None = None


def steps_of(task: Task, fresh) -> list[_Step]:
    # params dicts are shared, not copied (the IR is immutable): _params_text's memo by object
    # then reprs each once, not once per task that a step is fused into
    if task.op is not K.FUSED:
        return [_Step(task.op, tuple(("b", b) for b in task.inputs), ("b", task.outputs[0]),
                      task.params)]
    local: dict[int, int] = {}
    steps = []
    for st in recipe_of(task).steps:
        args = tuple(("b", task.inputs[a.index]) if a.kind == INPUT else ("s", local[a.index])
                     for a in st.args)
        if st.out.kind == OUTPUT:
            out = ("b", task.outputs[st.out.index])
        else:
            local[st.out.index] = fresh()
            out = ("s", local[st.out.index])
        steps.append(_Step(st.op, args, out, st.params, st.out_shape, st.out_dtype))
    return steps


def root_op(task: Task, memo: IdentityMemo | None = None) -> K:
    """The op of the step writing the task's first output. memo (one pass's): each recipe
    object is checked and searched once per operand count (fuse shares equal recipes)."""
    if task.op is not K.FUSED:
        return task.op
    if memo is None:
        return recipe_of(task).root_op()
    return memo.get(task.params.get("recipe"), (len(task.inputs), len(task.outputs)),
                    lambda: recipe_of(task).root_op())


def step_ops(task: Task, memo: IdentityMemo) -> tuple[K, ...]:
    """The ops of steps_of(task), in order; memo (one pass's): once per recipe object."""
    if task.op is not K.FUSED:
        return (task.op,)
    return memo.get(task.params.get("recipe"), None,
                    lambda: tuple(st.op for st in recipe_of(task).steps))


def _cse(steps: list[_Step], params_text: dict[int, tuple[dict, str, str]]) -> list[_Step]:
    """Drop a step identical to an earlier scratch-writing one (same op, args, params, type).
    params_text: repr of each params dict by id (a head's steps recur in every reader)."""
    seen: dict[tuple, tuple] = {}
    alias: dict[tuple, tuple] = {}
    out = []
    for st in steps:
        if alias:
            args = tuple(alias.get(a, a) for a in st.args)
            if args != st.args:
                st = _Step(st.op, args, st.out, st.params, st.out_shape, st.out_dtype)
        if st.out[0] == "s":
            # args are (kind, int) pairs and shapes ints: equal exactly when their reprs are
            key = (int(st.op), st.args, _params_text(st.params, params_text, False),
                   st.out_shape, st.out_dtype)
            if key in seen:
                alias[st.out] = seen[key]
                continue
            seen[key] = st.out
        out.append(st)
    return out


def _params_text(params: dict, memo: dict[int, tuple[dict, str, str]], ordered: bool) -> str:
    """repr of a params dict (ordered: as it is, else its sorted items), memoised by object
    (held, so its id stays unique)."""
    held = memo.get(id(params))
    if held is None or held[0] is not params:
        held = memo[id(params)] = (params, repr(sorted(params.items())), repr(params))
    return held[2] if ordered else held[1]


def _kind(task: Task, params_text: dict, held: list) -> tuple:
    """What steps_of(task) depends on besides its buffer ids: the recipe object (held, so its
    id stays unique; fuse shares equal recipes) or the op and its params' text."""
    if task.op is K.FUSED:
        recipe = task.params.get("recipe")
        held.append(recipe)
        return (id(recipe),)
    return (task.op, _params_text(task.params, params_text, True))


def to_task(steps: list[_Step], like: Task, name: str, recipes: dict[tuple, Recipe],
            params_text: dict[int, tuple[dict, str, str]]) -> Task:
    """A FUSED task writing like.outputs, from global-ref steps. Equal recipes are one shared
    object in `recipes` (a decoder's layers repeat: the 8B shape builds 41k recipes, ~850
    distinct), so each is checked and pickled once."""
    inputs: list[int] = []
    pos: dict[int, int] = {}
    scratch: dict[int, int] = {}
    out_index = {b: k for k, b in enumerate(like.outputs)}
    # Each step as (op, args, out, params text, shape, dtype), operands as (kind, index): the
    # key of the recipe, whose Steps are only built the first time it is seen
    key = []
    for st in steps:
        args = []
        for kind, v in st.args:
            if kind == "b":
                k = pos.get(v)
                if k is None:
                    k = pos[v] = len(inputs)
                    inputs.append(v)
                args.append((INPUT, k))
            else:
                args.append((SCRATCH, scratch[v]))
        kind, v = st.out
        out = ((OUTPUT, out_index[v]) if kind == "b"
               else (SCRATCH, scratch.setdefault(v, len(scratch))))
        # the params by repr in their own order (the program's repr, its canonical form, keeps it)
        key.append((st.op, tuple(args), out, _params_text(st.params, params_text, True),
                    st.out_shape, st.out_dtype))
    key_t = tuple(key)
    recipe = recipes.get(key_t)
    if recipe is None:
        recipe = recipes[key_t] = Recipe(tuple(
            Step(op, tuple(operand(*a) for a in args), operand(*out), st.params, shape, dtype)
            for st, (op, args, out, _, shape, dtype) in zip(steps, key_t)))
    return new_task(like.id, K.FUSED, tuple(inputs), like.outputs, {"recipe": recipe},
                    like.waits, like.out_counter, name)


class _Touches:
    """Which tasks touch which column ranges of each buffer (kept current while fusing).
    Whole-buffer ranges are kept apart, so a lookup scans only the narrow ranges near it.
    A Region's rows are not kept: a lookup over-approximates (the safe side for fusing)."""

    def __init__(self, bufs):
        self.bufs = bufs
        self.whole: dict[int, set[int]] = {}
        self.keys: dict[int, list[tuple[int, int]]] = {}
        self.sets: dict[tuple[int, int, int], set[int]] = {}
        self.maxw: dict[int, int] = {}

    def add(self, t: int, regions: list[Region]) -> None:
        for r in regions:
            if r.lo <= 0 and r.hi >= self.bufs[r.buffer].cols:
                self.whole.setdefault(r.buffer, set()).add(t)
                continue
            k = (r.buffer, r.lo, r.hi)
            s = self.sets.get(k)
            if s is None:
                s = self.sets[k] = set()
                insort(self.keys.setdefault(r.buffer, []), (r.lo, r.hi))
                self.maxw[r.buffer] = max(self.maxw.get(r.buffer, 0), r.hi - r.lo)
            s.add(t)

    def remove(self, t: int, regions: list[Region]) -> None:
        for r in regions:
            if r.lo <= 0 and r.hi >= self.bufs[r.buffer].cols:
                self.whole[r.buffer].discard(t)
            else:
                self.sets[(r.buffer, r.lo, r.hi)].discard(t)

    def overlapping(self, r: Region) -> set[int]:
        out = set(self.whole.get(r.buffer, ()))
        keys = self.keys.get(r.buffer)
        if keys:
            i = bisect_left(keys, (r.lo - self.maxw[r.buffer] + 1, -1))
            j = bisect_left(keys, (r.hi, -1))
            for lo, hi in keys[i:j]:
                if hi > r.lo:
                    out |= self.sets[(r.buffer, lo, hi)]
        return out


def drop_unused_buffers(program: Program) -> Program:
    """Remove ACTIVATION buffers no task touches; renumber buffer ids densely."""
    used = set(program.outputs)
    for t in program.tasks:
        used.update(t.inputs)
        used.update(t.outputs)
    keep = [b for b in program.buffers if b.kind is not BufferKind.ACTIVATION or b.id in used]
    if len(keep) == len(program.buffers):
        return program
    return remap_buffers(program, {b.id: i for i, b in enumerate(keep)},
                         [b for b in keep])


def remap_buffers(program: Program, new_id: dict[int, int], keep: list[Buffer]) -> Program:
    """Buffers `keep` (old objects) get ids 0..; every task/output reference goes via new_id."""
    buffers = tuple(Buffer(i, b.name, b.kind, b.dtype, b.shape, b.source)
                    for i, b in enumerate(keep))
    # the tiles of one op share their operand tuples: each renamed once
    ids: dict[tuple[int, ...], tuple[int, ...]] = {}

    def renamed_ids(bs: tuple[int, ...]) -> tuple[int, ...]:
        got = ids.get(bs)
        if got is None:
            got = ids[bs] = tuple(new_id[b] for b in bs)
        return got

    tasks = tuple(rebuilt(t, inputs=renamed_ids(t.inputs), outputs=renamed_ids(t.outputs))
                  for t in program.tasks)
    return program.with_(buffers=buffers, tasks=tasks,
                         outputs=tuple(new_id[b] for b in program.outputs))


@without_gc
def fuse(program: Program, opts: PassOptions | None = None) -> Program:
    opts = opts or PassOptions()
    if not opts.fuse:
        return program
    rules = {(K[a], K[b]) for a, b in opts.rules}
    producer_ops = {a for a, _ in rules}
    bufs = program.buffers
    outputs = set(program.outputs)
    tasks: list[Task | None] = list(program.tasks)
    regions = [regions_of(t, bufs) for t in tasks]
    readers = _Touches(bufs)
    writers = _Touches(bufs)      # the original writers: a conservative "written between"
    for i, (r, w) in enumerate(regions):
        readers.add(i, r)
        writers.add(i, w)
    counter = [0]
    params_text: dict[int, tuple[dict, str, str]] = {}    # _params_text's memo
    recipes: dict[tuple, Recipe] = {}
    roots = IdentityMemo()                                 # root_op's memo
    step_kinds = IdentityMemo()                            # step_ops' memo
    # (producer kind, reader kind, operand counts, pattern of repeated buffer ids) -> (recipe,
    # where each input of the fused task is in (y,) + A.inputs + B.inputs + B.outputs): a
    # decoder's layers repeat each pair over other buffers (8B: 41k fused tasks, 1363 kinds)
    pairs: dict[tuple, tuple[Recipe, tuple[int, ...]]] = {}
    held: list = []                                        # _kind's recipes

    def fresh() -> int:
        counter[0] += 1
        return counter[0]

    writer_pos: dict[int, list[int]] = {}
    for i, (_, w) in enumerate(regions):
        for x in w:
            writer_pos.setdefault(x.buffer, []).append(i)

    def written_between(r: Region, a: int, b: int) -> bool:
        ws = writer_pos.get(r.buffer, ())
        i = bisect_right(ws, a)
        if i == len(ws) or ws[i] >= b:      # the common case: no writer of the buffer between
            return False
        return any(a < w < b for w in writers.overlapping(r))

    for a in range(len(tasks)):
        A = tasks[a]
        if A is None or len(A.outputs) != 1 or root_op(A, roots) not in producer_ops:
            continue
        y = A.outputs[0]
        if bufs[y].kind is not BufferKind.ACTIVATION or y in outputs:
            continue
        a_reads, a_writes = regions[a]
        wy = [r for r in a_writes if r.buffer == y]
        if len(wy) != 1 or len(a_writes) != 1:
            continue
        wy0 = wy[0]
        users = sorted(readers.overlapping(wy0) - {a})
        if not users or users[0] < a:
            continue
        a_ops = step_ops(A, step_kinds)
        if len(users) > 1 and not all(op in CHEAP for op in a_ops):
            continue
        ra = root_op(A, roots)
        last = users[-1]
        ok = all((ra, root_op(tasks[b], roots)) in rules
                 and all(r.buffer != y or (wy0.lo <= r.lo and r.hi <= wy0.hi
                                               and wy0.r0 <= r.r0 and r.r1 <= wy0.r1)
                         for r in regions[b][0]) for b in users)
        # A moves to its readers: nothing it reads (or writes) may change in between
        if not ok or written_between(wy0, a, last) or any(
                bufs[r.buffer].kind not in READ_ONLY and written_between(r, a, last)
                for r in a_reads):
            continue
        sid = fresh()
        yb = bufs[y]
        head = None          # A's steps writing scratch sid, built for the first new pair
        tag = "+".join(op.name.lower() for op in a_ops)
        a_kind = (_kind(A, params_text, held), len(A.inputs), yb.shape, yb.dtype)
        for b in users:
            B = tasks[b]
            operands = (y,) + A.inputs + B.inputs + B.outputs
            first: dict[int, int] = {}
            key = (a_kind, _kind(B, params_text, held), len(B.inputs),
                   tuple(first.setdefault(x, len(first)) for x in operands))
            hit = pairs.get(key)
            if hit is None:
                if head is None:
                    head = [_Step(s.op, s.args, ("s", sid), s.params, yb.shape, yb.dtype)
                            if s.out == ("b", y) else s for s in steps_of(A, fresh)]
                tail = [_Step(s.op, tuple(("s", sid) if x == ("b", y) else x for x in s.args),
                              s.out, s.params, s.out_shape, s.out_dtype)
                        for s in steps_of(B, fresh)]
                nb = to_task(_cse(head + tail, params_text), B, f"{B.name} +{tag}", recipes,
                             params_text)
                pairs[key] = (nb.params["recipe"], tuple(operands.index(x) for x in nb.inputs))
            else:
                recipe, where = hit
                nb = new_task(B.id, K.FUSED, tuple(operands[k] for k in where), B.outputs,
                              {"recipe": recipe}, B.waits, B.out_counter, f"{B.name} +{tag}")
            b_reads, b_writes = regions[b]
            readers.remove(b, b_reads)
            # what FUSED touches = the union over its steps' external operands
            regions[b] = (merge(a_reads + [r for r in b_reads if r.buffer != y]), b_writes)
            remember_regions(nb, bufs, regions[b])
            readers.add(b, regions[b][0])
            tasks[b] = nb
        readers.remove(a, a_reads)
        tasks[a] = None
    kept = tuple(t for t in tasks if t is not None)
    if len(kept) == len(program.tasks):
        return program
    return resync(drop_unused_buffers(program.with_(tasks=kept, queues=())))
