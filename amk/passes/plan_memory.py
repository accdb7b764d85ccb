"""plan_memory: reuse ACTIVATION buffers across layers by liveness.

A buffer is live from the first task that touches it to the last (program order). Buffers of one
class (dtype, shape) share storage when their live ranges do not overlap; the free list of each
class is FIFO, so a buffer is reused as late as possible, which keeps the WAR/WAW waits the reuse
adds (computed by `resync`) off the critical path. A buffer a KV append reads (the new k / v
rows) shares only with others of its kind: defer_kv_append runs the appends after the
attention, off the critical path, and a later writer of the same storage would wait for them
(Qwen3-0.6B's o and down tiles, whose rows are as wide as its k and v rows, waited for the
layer's appends: NOTES v32). Program order stays a legal sequential execution, so the result
computes exactly what the input did. Program outputs and buffers that are read before they are
first written (they rely on zero-initialisation) are never shared.
"""
from __future__ import annotations

from collections import deque

from amk.passes.fuse import remap_buffers, root_op
from amk.passes.options import PassOptions
from amk.gcpause import without_gc
from amk.identity_memo import IdentityMemo
from amk.passes.sync import resync
from amk.program.ir import BufferKind, InstructionKind as K, Program
from amk.program.regions import task_regions


@without_gc
def plan_memory(program: Program, opts: PassOptions | None = None) -> Program:
    opts = opts or PassOptions()
    if not opts.plan_memory:
        return program
    bufs = program.buffers
    tasks = program.tasks
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    read_first: set[int] = set()
    # the tiles of one op touch the same buffers: a run of tasks with equal operands is seen
    # at its first task (first touches) and its last (last touches)
    for lo, hi in _runs(tasks):
        task = tasks[lo]
        for b in task.inputs:
            if b not in first:
                first[b] = lo
                read_first.add(b)
        for b in task.outputs:
            first.setdefault(b, lo)
        for b in task.inputs + task.outputs:
            last[b] = hi - 1
    # a buffer whose first toucher both reads and writes it may read stale columns: keep it
    for b, t in first.items():
        task = tasks[t]
        if b in task.outputs and b in task.inputs:
            reads, _ = task_regions(task, bufs)
            if any(r.buffer == b for r in reads):
                read_first.add(b)
    pinned = set(program.outputs) | read_first
    movable = [b for b in bufs if b.kind is BufferKind.ACTIVATION and b.id not in pinned
               and b.id in first]
    by_first: dict[int, list[int]] = {}
    for b in movable:
        by_first.setdefault(first[b.id], []).append(b.id)
    by_last: dict[int, list[int]] = {}
    for b in movable:
        by_last.setdefault(last[b.id], []).append(b.id)

    memo = IdentityMemo()                         # root_op's, once per recipe object
    appended = {b for task in program.tasks if root_op(task, memo) is K.KV_APPEND
                for b in task.inputs}
    home: dict[int, int] = {}                     # buffer -> the buffer whose storage it uses
    free: dict[tuple, deque[int]] = {}
    for t in range(len(program.tasks)):
        for b in by_first.get(t, ()):
            cls = (bufs[b].dtype, bufs[b].shape, b in appended)
            pool = free.get(cls)
            home[b] = pool.popleft() if pool else b
        for b in by_last.get(t, ()):
            cls = (bufs[b].dtype, bufs[b].shape, b in appended)
            free.setdefault(cls, deque()).append(home[b])
    if all(home[b] == b for b in home):
        return program
    keep = [b for b in bufs if home.get(b.id, b.id) == b.id]
    new_id = {b.id: i for i, b in enumerate(keep)}
    for b, h in home.items():
        new_id[b] = new_id[h]
    return resync(remap_buffers(program.with_(queues=()), new_id, keep))


def _runs(tasks) -> list[tuple[int, int]]:
    """(first, end) of each run of consecutive tasks with equal inputs and outputs."""
    runs = []
    lo = 0
    for t in range(1, len(tasks) + 1):
        if t == len(tasks) or tasks[t].inputs != tasks[lo].inputs or \
                tasks[t].outputs != tasks[lo].outputs:
            runs.append((lo, t))
            lo = t
    return runs
