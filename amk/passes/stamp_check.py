"""stamp_check: the stamped program reads and writes each graph input where the graph does.

`validate` proves a program's structure, not which layer's weights or cache a task touches: a
stamped task renumbered to the wrong block would pass it and compute the wrong function. So
every stamped program is checked against the whole graph's lowering (which the stamp makes
anyway), from its own data, before it is used:
  * each buffer of a graph input keeps the lowered buffer's id, name, kind, dtype, shape, source;
  * each task touches only graph inputs that its origin (the lowered task it came from: tiles
    and shards narrow it, `fuse` adds its producers, named in the task's " +op" tags, and
    defer_kv_append the producers of an attention's appends) touches;
  * the program touches every graph input the lowered graph touches.
Any mismatch: the stamp is not used (passes/stamp.py runs the plain pipeline).
"""
from __future__ import annotations

from amk.program.ir import InstructionKind as K, Program, Task


# a step's op -> the lowered op it came from (split_kv makes the combine of an attention)
_LOWERED_AS = {"attention_combine": "attention_tile"}


def _fused_ops(name: str) -> frozenset[str]:
    """The lowered ops (lowercase) of the steps fuse's " +a+b" tags add to a task's name: its
    producers'."""
    ops: set[str] = set()
    for tag in name.split(" +")[1:]:
        ops.update(_LOWERED_AS.get(op, op) for op in tag.split("[", 1)[0].split("+"))
    return frozenset(ops)


def _inputs_of(t: Task, n: int) -> frozenset[int]:
    return frozenset(b for b in (*t.inputs, *t.outputs) if b < n)


def stamp_mismatches(program: Program, lowered: Program, origins: list[int],
                     n_inputs: int) -> list[str]:
    """What the stamped `program` gets wrong against the whole graph's `lowered` program (its
    first n_inputs buffers are the graph inputs); origins: each task's lowered task. [] if
    nothing."""
    bad = []
    for a, b in zip(program.buffers[:n_inputs], lowered.buffers[:n_inputs]):
        if a != b:
            bad.append(f"buffer {a.id} {a.name!r} is not the graph input {b}")
    if len(program.buffers) < n_inputs:
        bad.append(f"{len(program.buffers)} buffers, fewer than the {n_inputs} graph inputs")
    low = lowered.tasks
    own = [_inputs_of(t, n_inputs) for t in low]
    op_names = [t.op.name.lower() for t in low]
    allowed: dict[tuple[int, frozenset], frozenset[int]] = {}

    def allowed_for(k: int, ops: frozenset[str]) -> frozenset[int]:
        # task k's graph inputs, and those of the producers (waited for, of a fused op) that
        # fuse may have folded in, each chain at most len(ops) deep
        got = allowed.get((k, ops))
        if got is None:
            got, front = set(own[k]), [k]
            for _ in range(len(ops)):
                # through an append (defer_kv_append: an attention reads its new row instead)
                ws = [w.counter for i in front for w in low[i].waits]
                ws += [w.counter for i in ws if low[i].op is K.KV_APPEND for w in low[i].waits]
                front = [i for i in ws if op_names[i] in ops]
                for i in front:
                    got |= own[i]
            got = allowed[(k, ops)] = frozenset(got)
        return got

    # the tiles of one op share operands and origin: checked once (the same graph inputs)
    checked: set[tuple] = set()
    touched: set[int] = set()
    for t, k in zip(program.tasks, origins):
        key = (t.inputs, t.outputs, k)
        if key in checked:
            continue
        checked.add(key)
        mine = _inputs_of(t, n_inputs)
        touched |= mine
        extra = mine - allowed_for(k, _fused_ops(t.name))
        if extra:
            bad.append(f"task {t.id} {t.name!r} touches graph inputs "
                       f"{sorted(program.buffers[b].name for b in extra)} that its origin, "
                       f"lowered task {k} {low[k].name!r}, does not")
    missing = set().union(*own) - touched
    if missing:
        bad.append(f"graph inputs {sorted(lowered.buffers[b].name for b in missing)} "
                   f"are touched by no task")
    return bad
