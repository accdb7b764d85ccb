"""stamp: the local passes of a step whose blocks repeat, run on three blocks and stamped.

The passes up to `fuse` decide each task from the tasks near it: a decoder layer's tiles,
shards and fusions depend on that layer and its two neighbours, never on how many layers there
are. So for a graph with a Repeat (passes/repeat.py) they run on the small graph of the first,
one middle and the last block; the middle block's tasks, buffers and counters are copied for
every other middle block, and the result is the program the passes give the whole graph, task
for task (tests/passes/test_stamp.py checks it against the plain pipeline, every field).

How the copy is found: the small program is lowered with each task's and buffer's name replaced
by its index (MARK), and the passes only append to names ("[tile 2/16]", " +rmsnorm",
".part3"), so every task and buffer after `fuse` names the lowered task or buffer it came from,
hence its equation and block. Block b's copy of a middle-block object is the lowered graph's
object at the same place in block b, with the same suffix. A middle-block task refers to
  * its own block's objects: block b's copies;
  * the block before's (block 0 in the small program): block b-1's copies, block 0 for b = 1;
  * block 1's private inputs (weights, caches): block b's; anything else: itself, renumbered.
Buffers and counters keep the small program's order, each run of middle-block ones repeated
block by block (the passes number both in program order, buffers that split_kv adds last).
Anything that does not fit (a middle task naming the last block, a first-block object with no
middle twin, a counter of two blocks) raises NoStamp, and the plain pipeline runs.
"""
from __future__ import annotations

import warnings
from typing import Callable

from amk.graph import Graph
from amk.passes.lower import lower_with_origins
from amk.passes.repeat import Repeat, find_repeat, small_graph
from amk.passes.stamp_check import stamp_mismatches
from amk.program.ir import Buffer, Counter, Program, Wait, new_task

MARK = "\x1f"
PRO, FIRST, MID, LAST, EPI = range(5)       # where an object of the small program sits
INPUT = -1


class NoStamp(Exception):
    """The small program's middle block cannot be copied: run the plain pipeline."""


def stamped(graph: Graph, opts, passes: list[Callable]) -> Program | None:
    """The program `passes` (lower first) give `graph`, from its small graph; None where the
    graph has no Repeat or the copy does not fit (the caller runs the plain pipeline). A copy
    that touches a graph input its origin does not (stamp_check.py) is a bug: warned, not used."""
    made = stamp_parts(graph, opts, passes)
    if made is None:
        return None
    stamp, program = made
    bad = stamp_mismatches(program, stamp.full, stamp.origins, len(graph.inputs))
    if bad:
        warnings.warn(f"amk: the stamped program of {graph.name} touches other graph inputs "
                      f"than the graph (an AMK bug, please report it); the plain pipeline runs:\n"
                      + "\n".join(bad[:10]), RuntimeWarning, stacklevel=2)
        return None
    return program


def stamp_parts(graph: Graph, opts, passes: list[Callable]) -> tuple[_Stamp, Program] | None:
    """The stamp (its whole lowered graph and each task's origin there) and its program,
    unchecked; None as stamped's."""
    rep = find_repeat(graph)
    if rep is None:
        return None
    small, task_eqn, buffer_eqn = lower_with_origins(small_graph(graph, rep))
    program = _marked(small)
    for fn in passes[1:]:
        program = fn(program, opts)
    try:
        stamp = _Stamp(graph, rep, program, task_eqn, buffer_eqn)
        return stamp, stamp.program()
    except NoStamp:
        return None


def _marked(p: Program) -> Program:
    tasks = tuple(new_task(t.id, t.op, t.inputs, t.outputs, t.params, t.waits, t.out_counter,
                           f"{t.id}{MARK}") for t in p.tasks)
    buffers = tuple(Buffer(b.id, f"{b.id}{MARK}", b.kind, b.dtype, b.shape, b.source)
                    for b in p.buffers)
    return p.with_(tasks=tasks, buffers=buffers)


def _origin(name: str) -> tuple[int, str]:
    k, _, suffix = name.partition(MARK)
    return int(k), suffix


def _placed(objs, places) -> tuple[list[int], list[tuple[int, str]]]:
    """Each marked object's segment, and its key there (index of its origin, name suffix)."""
    segs, keys = [], []
    for o in objs:
        k, suffix = _origin(o.name)
        seg, _, j = places[k]
        segs.append(seg)
        keys.append((j, suffix))
    return segs, keys


def _places(eqn_of: list[int], where: Callable[[int], tuple[int, int]]):
    """(place per object: (segment, instance, index within them), first object of each)."""
    count: dict[tuple[int, int], int] = {}
    first: dict[tuple[int, int], int] = {}
    out = []
    for k, e in enumerate(eqn_of):
        w = where(e)
        j = count.get(w, 0)
        count[w] = j + 1
        first.setdefault(w, k)
        out.append((w[0], w[1], j))
    return out, first, count


class _Stamp:
    def __init__(self, graph: Graph, rep: Repeat, small: Program, task_eqn, buffer_eqn):
        self.rep, self.small = rep, small
        n = rep.count
        full, f_task_eqn, f_buffer_eqn = lower_with_origins(graph)
        self.full = full

        def in_small(e: int) -> tuple[int, int]:
            if e < 0:
                return INPUT, 0
            b = rep.block_of(e)
            return (PRO if b < 0 else (FIRST, MID, LAST)[b] if b < 3 else EPI), 0

        def in_full(e: int) -> tuple[int, int]:
            if e < 0:
                return INPUT, 0
            b = rep.block_of(e)
            if b < 0 or b >= n:
                return (PRO if b < 0 else EPI), 0
            return (FIRST, 0) if b == 0 else (LAST, 0) if b == n - 1 else (MID, b)

        self.s_task, _, s_tcount = _places(task_eqn, in_small)
        self.s_buf, _, s_bcount = _places(buffer_eqn, in_small)
        _, self.f_task, f_tcount = _places(f_task_eqn, in_full)
        _, self.f_buf, f_bcount = _places(f_buffer_eqn, in_full)
        for s_count, f_count in ((s_tcount, f_tcount), (s_bcount, f_bcount)):
            if any(f_count.get((seg, i if seg == MID else 0), 0) != c
                   for (seg, _), c in s_count.items() for i in self.instances(seg)):
                raise NoStamp
        self.mids = range(1, n - 1)

    def instances(self, seg: int) -> range:
        return range(1, self.rep.count - 1) if seg == MID else range(1)

    # -- the small program's objects ---------------------------------------------------------
    def _read(self):
        p = self.small
        self.t_seg, self.t_key = _placed(p.tasks, self.s_task)
        if any(a > b for a, b in zip(self.t_seg, self.t_seg[1:])):
            raise NoStamp                       # the blocks' tasks are not in block order
        self.b_seg, self.b_key = _placed(p.buffers, self.s_buf)
        self.c_seg = [None] * len(p.counters)
        self.c_size = [0] * len(p.counters)
        for t, seg in zip(p.tasks, self.t_seg):
            c = t.out_counter
            if self.c_seg[c] not in (None, seg):
                raise NoStamp
            self.c_seg[c] = seg
            self.c_size[c] += 1
        if any(c.id != i or c.init for i, c in enumerate(p.counters)) or None in self.c_seg:
            raise NoStamp

    def _twins(self):
        """first block's object -> its middle block twin (the block before a middle one)."""
        def twins(segs, keys):
            mid = {}
            for i, (s, k) in enumerate(zip(segs, keys)):
                if s == MID:
                    if k in mid:
                        raise NoStamp
                    mid[k] = i
            return {i: mid[k] for i, (s, k) in enumerate(zip(segs, keys))
                    if s == FIRST and k in mid}
        self.b_twin = twins(self.b_seg, self.b_key)
        t_twin = twins(self.t_seg, self.t_key)
        tasks = self.small.tasks
        self.c_twin = {}
        for i, j in t_twin.items():
            a, b = tasks[i].out_counter, tasks[j].out_counter
            if self.c_twin.get(a, b) != b or self.c_size[a] != self.c_size[b]:
                raise NoStamp
            self.c_twin[a] = b

    # -- the whole program's numbering ---------------------------------------------------------
    def _layout(self, segs: list[int]) -> tuple[list[tuple[int, int]], dict[tuple[int, int], int]]:
        """Objects in the small program's order, each run of middle ones once per middle block."""
        order: list[tuple[int, int]] = []
        i = 0
        while i < len(segs):
            j = i
            while j < len(segs) and (segs[j] == MID) == (segs[i] == MID):
                j += 1
            if segs[i] == MID:
                order += [(k, m) for m in self.mids for k in range(i, j)]
            else:
                order += [(k, 0) for k in range(i, j)]
            i = j
        return order, {o: n for n, o in enumerate(order)}

    def _ref(self, ids: dict, twin: dict, segs: list[int], o: int, seg: int, m: int) -> int:
        """The whole program's id of object o (a buffer or counter) named by a task at (seg, m)."""
        s = segs[o]
        if s == MID:
            if seg == MID:
                return ids[(o, m)]
            if seg > MID:
                return ids[(o, self.rep.count - 2)]
            raise NoStamp
        if s == FIRST and seg == MID and m > 1:
            if o not in twin:
                raise NoStamp
            return ids[(twin[o], m - 1)]
        if s > seg or (s == FIRST and seg > MID):
            raise NoStamp
        return ids[(o, 0)]

    def program(self) -> Program:
        self._read()
        self._twins()
        p, full = self.small, self.full
        b_order, b_ids = self._layout(self.b_seg)
        c_order, c_ids = self._layout(self.c_seg)
        private = self.rep.private
        buffers = []
        lowered_to = {}                       # the whole lowered program's buffer -> its id here
        for i, (o, m) in enumerate(b_order):
            b = p.buffers[o]
            seg, (j, suffix) = self.b_seg[o], self.b_key[o]
            k = j if seg == INPUT else self.f_buf[(seg, m)] + j
            if not suffix:
                lowered_to[k] = i
            buffers.append(Buffer(i, full.buffers[k].name + suffix, b.kind, b.dtype, b.shape,
                                  b.source))
        memo: dict[tuple, tuple] = {}

        def buffer_ids(bs: tuple[int, ...], seg: int, m: int) -> tuple[int, ...]:
            key = (bs, seg, m)
            got = memo.get(key)
            if got is None:
                got = memo[key] = tuple(
                    private[m].get(b, b) if self.b_seg[b] == INPUT and seg == MID
                    else self._ref(b_ids, self.b_twin, self.b_seg, b, seg, m) for b in bs)
            return got

        def waits(ws: tuple[Wait, ...], seg: int, m: int) -> tuple[Wait, ...]:
            key = (ws, seg, m)
            got = memo.get(key)
            if got is None:
                got = memo[key] = tuple(
                    Wait(self._ref(c_ids, self.c_twin, self.c_seg, w.counter, seg, m), w.threshold)
                    for w in ws)
            return got

        tasks = []
        self.origins = []                      # each task's lowered task in self.full
        runs: list[tuple[int, int]] = []       # (first task, end) of each segment's run
        for i, seg in enumerate(self.t_seg):
            if runs and self.t_seg[runs[-1][0]] == seg:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
        for lo, hi in runs:
            seg = self.t_seg[lo]
            for m in self.instances(seg):
                first = self.f_task[(seg, m)]
                for t, (j, suffix) in zip(p.tasks[lo:hi], self.t_key[lo:hi]):
                    new = new_task(
                        len(tasks), t.op, buffer_ids(t.inputs, seg, m),
                        buffer_ids(t.outputs, seg, m), t.params, waits(t.waits, seg, m),
                        self._ref(c_ids, self.c_twin, self.c_seg, t.out_counter, seg, m),
                        full.tasks[first + j].name + suffix)
                    tasks.append(new)
                    self.origins.append(first + j)
        try:
            outputs = tuple(lowered_to[b] for b in full.outputs)
        except KeyError:
            raise NoStamp from None
        return Program(tuple(buffers), tuple(Counter(i) for i in range(len(c_order))),
                       tuple(tasks), (), p.name, outputs)
