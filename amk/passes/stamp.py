"""stamp: the local passes of a step whose blocks repeat, run on three blocks and stamped.

The passes up to `fuse` decide each task from the tasks near it: a decoder layer's tiles,
shards and fusions depend on that layer and its two neighbours, never on how many layers there
are. So for a graph with a Repeat (passes/repeat.py) they run on the small graph of the first,
one middle and the last block; the middle block's tasks, buffers and counters are copied for
every other middle block, and the result is the program the passes give the whole graph, task
for task (tests/passes/test_stamp.py checks it against the plain pipeline, every field).
stamp_period.py copies a small program of more blocks the same way, after the passes that
share storage and counters between blocks.

How the copy is found: the small program is lowered with each task's and buffer's name replaced
by its index (MARK), and the passes only append to names ("[tile 2/16]", " +rmsnorm",
".part3"), so every task and buffer names the lowered task or buffer it came from, hence its
equation and block. Its key is (index among its block's lowered objects, suffix); a counter's
is its first incrementer's. The small program's blocks 0 .. K-2 are the whole program's; its
last `period` of them (the template) are copied, in turn, for the whole program's blocks
K-1 .. n-2, and its last block is the whole program's last. A copied task refers to
  * its block's private inputs (weights, caches): the copy's block's; other inputs: themselves;
  * an object `d` blocks before it (d >= 0): the object with the same key `d` blocks before
    the copy, or, where stamp_period.py found the reference fixed, the object itself;
  * the prologue's objects: themselves.
A task of the last block or after it refers to a block's object as one `d` blocks before it
(unless fixed). Buffers and counters keep the small program's order, each run of the blocks'
ones laid out block by block (the passes number both in program order, buffers that split_kv
adds last). Anything that does not fit (a reference to a later block, a key the copy's block
lacks, a counter whose incrementers change in number) raises NoStamp, and the plain pipeline runs.
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
INPUT = -2                                  # a graph input's block (the prologue's is -1)
ABS = None                                  # a reference to one fixed object
BUF, CTR = 0, 1


class NoStamp(Exception):
    """The small program's middle block cannot be copied: run the plain pipeline."""


def stamped(graph: Graph, opts, passes: list[Callable]) -> Program | None:
    """The program `passes` (lower first) give `graph`, from its small graph; None where the
    graph has no Repeat or the copy does not fit (the caller runs the plain pipeline). A copy
    that touches a graph input its origin does not (stamp_check.py) is a bug: warned, not used."""
    made = stamp_parts(graph, opts, passes)
    if made is None:
        return None
    return checked(graph, *made)


def checked(graph: Graph, stamp: Stamp, program: Program) -> Program | None:
    bad = stamp_mismatches(program, stamp.full, stamp.origins, len(graph.inputs))
    if bad:
        warnings.warn(f"amk: the stamped program of {graph.name} touches other graph inputs "
                      f"than the graph (an AMK bug, please report it); the plain pipeline runs:\n"
                      + "\n".join(bad[:10]), RuntimeWarning, stacklevel=3)
        return None
    return program


def stamp_parts(graph: Graph, opts, passes: list[Callable],
                marked: bool = False) -> tuple[Stamp, Program] | None:
    """The stamp (its whole lowered graph and each task's origin there) and its program,
    unchecked (marked: its names MARKed as the small program's, for stamp_period.py); None as
    stamped's."""
    rep = find_repeat(graph)
    if rep is None:
        return None
    small, task_eqn, buffer_eqn = lower_with_origins(small_graph(graph, rep))
    program = marked_names(small)
    for fn in passes[1:]:
        program = fn(program, opts)
    try:
        stamp = Stamp(graph, rep, program, task_eqn, buffer_eqn)
        stamp.read()
        return stamp, stamp.program(marked)
    except NoStamp:
        return None


def marked_names(p: Program) -> Program:
    tasks = tuple(new_task(t.id, t.op, t.inputs, t.outputs, t.params, t.waits, t.out_counter,
                           f"{t.id}{MARK}") for t in p.tasks)
    buffers = tuple(Buffer(b.id, f"{b.id}{MARK}", b.kind, b.dtype, b.shape, b.source)
                    for b in p.buffers)
    return p.with_(tasks=tasks, buffers=buffers)


def _origin(name: str) -> tuple[int, str]:
    k, _, suffix = name.partition(MARK)
    return int(k), suffix


def _places(eqn_of: list[int], where: Callable[[int], int]):
    """(each object's (block, index among its block's), first object of each block, count)."""
    count: dict[int, int] = {}
    first: dict[int, int] = {}
    out = []
    for k, e in enumerate(eqn_of):
        w = where(e)
        j = count.get(w, 0)
        count[w] = j + 1
        first.setdefault(w, k)
        out.append((w, j))
    return out, first, count


def _keyed(objs, places) -> tuple[list[int], list[tuple[int, str]]]:
    """Each marked object's block, and its key there (index of its origin, name suffix)."""
    blk, key = [], []
    for o in objs:
        k, suffix = _origin(o.name)
        b, j = places[k]
        blk.append(b)
        key.append((j, suffix))
    return blk, key


class Stamp:
    """The whole program from the small program of `blocks` blocks (small_graph's), its last
    `period` middle blocks copied in turn. modes (stamp_period.py): for a reference of a
    template block t to object o of kind BUF / CTR, ABS (fixed) or d (d blocks back); None:
    every reference to a block's object is relative, and the last block names none of block 0."""

    def __init__(self, graph: Graph, rep: Repeat, small: Program, task_eqn, buffer_eqn,
                 blocks: int = 3, period: int = 1, lowered=None):
        self.rep, self.small, self.K, self.p = rep, small, blocks, period
        n = self.n = rep.count
        if n < blocks or (n - blocks) % period or blocks - 1 - period < 1:
            raise NoStamp
        full, f_task_eqn, f_buffer_eqn = lowered or lower_with_origins(graph)
        self.full, self.f_eqns = full, (f_task_eqn, f_buffer_eqn)
        s_rep = Repeat(rep.start, rep.size, blocks, ())
        self.s_task, _, s_tcount = _places(task_eqn, lambda e: INPUT if e < 0 else s_rep.block_of(e))
        self.s_buf, _, s_bcount = _places(buffer_eqn, lambda e: INPUT if e < 0 else s_rep.block_of(e))
        _, self.f_task, f_tcount = _places(f_task_eqn, lambda e: INPUT if e < 0 else rep.block_of(e))
        _, self.f_buf, f_bcount = _places(f_buffer_eqn, lambda e: INPUT if e < 0 else rep.block_of(e))
        for s_count, f_count in ((s_tcount, f_tcount), (s_bcount, f_bcount)):
            if any(f_count.get(w, 0) != s_count.get(self.sb(w), 0) for w in range(INPUT, n + 1)):
                raise NoStamp
        self.modes: dict | None = None         # stamp_period.py's
        self.fixed: tuple[set[int], set[int]] = (set(), set())
        # block t's private inputs -> block 1's (rep.private maps block 1's to block b's)
        self.inv = [{v: u for u, v in m.items()} for m in rep.private]

    # -- blocks: the small program's (s) and the whole one's (w) -------------------------------
    def sb(self, w: int) -> int:
        """The small program's block a whole program's block is a copy of."""
        K, n, p = self.K, self.n, self.p
        if w >= n - 1:
            return w - n + K
        if w <= K - 2:
            return w
        t0 = K - 1 - p
        return t0 + (w - t0) % p

    def wb(self, s: int) -> int:
        """The whole program's block of a small program's block (its first copy)."""
        return s if s <= self.K - 2 else s - self.K + self.n

    def template(self, s: int) -> bool:
        return self.K - 1 - self.p <= s <= self.K - 2

    # -- the small program's objects -----------------------------------------------------------
    def read(self):
        p = self.small
        self.blk, self.key = [[], []], [[], []]
        self.blk[BUF], self.key[BUF] = _keyed(p.buffers, self.s_buf)
        self.t_blk, self.t_key = _keyed(p.tasks, self.s_task)
        if any(a > b for a, b in zip(self.t_blk, self.t_blk[1:])):
            raise NoStamp                       # the blocks' tasks are not in block order
        first = [-1] * len(p.counters)
        self.c_size = [0] * len(p.counters)
        for i, t in enumerate(p.tasks):
            c = t.out_counter
            if first[c] < 0:
                first[c] = i
            self.c_size[c] += 1
        if any(c.id != i or c.init for i, c in enumerate(p.counters)) or -1 in first:
            raise NoStamp
        # a counter of two blocks: only stamp_period.py's modes say which block's it is
        self.spans = any(self.t_blk[first[t.out_counter]] != b for t, b in zip(p.tasks, self.t_blk))
        self.blk[CTR] = [self.t_blk[i] for i in first]
        self.key[CTR] = [self.t_key[i] for i in first]
        self.by_key: list[dict] = [{}, {}]
        for kind in (BUF, CTR):
            for o, (b, k) in enumerate(zip(self.blk[kind], self.key[kind])):
                if self.by_key[kind].setdefault((b, k), o) != o:
                    raise NoStamp
        self.t_range: dict[int, tuple[int, int]] = {}
        for i, b in enumerate(self.t_blk):
            lo, _ = self.t_range.get(b, (i, i))
            self.t_range[b] = (lo, i + 1)

    # -- the whole program's numbering ---------------------------------------------------------
    def _layout(self, blks: list[int]) -> tuple[list[tuple[int, int]], dict[tuple[int, int], int]]:
        """(object, whole block) in order: the small program's, each run of the middle blocks'
        objects laid out once per whole middle block."""
        K, n = self.K, self.n
        order: list[tuple[int, int]] = []
        i = 0
        while i < len(blks):
            if not 1 <= blks[i] <= K - 2:
                order.append((i, self.wb(blks[i])))
                i += 1
                continue
            j = i
            by_blk: dict[int, list[int]] = {}
            while j < len(blks) and 1 <= blks[j] <= K - 2:
                if blks[j] < blks[j - 1] and j > i:
                    raise NoStamp
                by_blk.setdefault(blks[j], []).append(j)
                j += 1
            for w in range(1, n - 1):
                order += [(o, w) for o in by_blk.get(self.sb(w), ())]
            i = j
        return order, {o: x for x, o in enumerate(order)}

    def _mode(self, kind: int, o: int, t: int):
        """ABS or the blocks back that task block t's reference to object o looks."""
        c = self.blk[kind][o]
        if c < 0:
            return ABS
        if self.modes is None:
            if t >= self.K - 1 and c == 0:
                raise NoStamp
            return t - c
        if t >= self.K - 1:
            if o in self.fixed[kind]:
                return ABS
            if c == 0:
                raise NoStamp
            return t - c
        try:
            return self.modes[(kind, t, o)]
        except KeyError:
            raise NoStamp from None

    def _ref(self, kind: int, o: int, t: int, w: int) -> int:
        """The whole program's id of object o named by a task of small block t, copied to w."""
        c = self.blk[kind][o]
        if c == INPUT:
            return self.rep.private[w].get(self.inv[t].get(o), o) if w != t and self.template(t) else o
        if c > t:
            raise NoStamp
        if w <= self.K - 2:                     # the whole program is the small one here
            return self.ids[kind][(o, self.wb(c))]
        d = self._mode(kind, o, t)
        if d is ABS:
            if self.template(c):
                raise NoStamp
            return self.ids[kind][(o, self.wb(c))]
        v = w - d
        got = self.by_key[kind].get((self.sb(v), self.key[kind][o]))
        if got is None:
            raise NoStamp
        return self.ids[kind][(got, v)]

    def program(self, marked: bool = False) -> Program:
        """The whole program (marked: names MARKed with the whole lowered program's indices),
        after read()."""
        if self.modes is None and self.spans:
            raise NoStamp
        p, full = self.small, self.full
        b_order, b_ids = self._layout(self.blk[BUF])
        c_order, c_ids = self._layout(self.blk[CTR])
        self.ids = (b_ids, c_ids)
        buffers = []
        lowered_to = {}                       # the whole lowered program's buffer -> its id here
        for i, (o, w) in enumerate(b_order):
            b = p.buffers[o]
            j, suffix = self.key[BUF][o]
            k = j if w == INPUT else self.f_buf[w] + j
            if not suffix:
                lowered_to[k] = i
            name = f"{k}{MARK}{suffix}" if marked else full.buffers[k].name + suffix
            buffers.append(Buffer(i, name, b.kind, b.dtype, b.shape, b.source))
        memo: dict[tuple, tuple] = {}

        def buffer_ids(bs: tuple[int, ...], t: int, w: int) -> tuple[int, ...]:
            key = (bs, t, w)
            got = memo.get(key)
            if got is None:
                got = memo[key] = tuple(self._ref(BUF, b, t, w) for b in bs)
            return got

        blocks = [w for w in range(-1, self.n + 1) if self.sb(w) in self.t_range]
        placed = []                            # (small task, whole block, out counter)
        for w in blocks:
            t = self.sb(w)
            lo, hi = self.t_range[t]
            c_of: dict[int, int] = {}
            for i in range(lo, hi):
                c = p.tasks[i].out_counter
                got = c_of.get(c)
                if got is None:
                    got = c_of[c] = self._ref(CTR, c, t, w)
                placed.append((i, w, got))
        count = [0] * len(c_order)             # each whole counter's incrementers
        for _, _, c in placed:
            count[c] += 1

        def waits(ws: tuple[Wait, ...], t: int, w: int) -> tuple[Wait, ...]:
            key = (ws, t, w)
            got = memo.get(key)
            if got is None:
                got = memo[key] = tuple(self._wait(x, t, w, count) for x in ws)
            return got

        tasks = []
        self.origins = []                      # each task's lowered task in self.full
        for i, w, c in placed:
            t = p.tasks[i]
            j, suffix = self.t_key[i]
            k = self.f_task[w] + j
            tasks.append(new_task(
                len(tasks), t.op, buffer_ids(t.inputs, self.t_blk[i], w),
                buffer_ids(t.outputs, self.t_blk[i], w), t.params, waits(t.waits, self.t_blk[i], w),
                c, f"{k}{MARK}{suffix}" if marked else full.tasks[k].name + suffix))
            self.origins.append(k)
        try:
            outputs = tuple(lowered_to[b] for b in full.outputs)
        except KeyError:
            raise NoStamp from None
        return Program(tuple(buffers), tuple(Counter(i) for i in range(len(c_order))),
                       tuple(tasks), (), p.name, outputs)

    def _wait(self, x: Wait, t: int, w: int, count: list[int]) -> Wait:
        """A wait copied: a counter with as many incrementers keeps its threshold; a fixed one
        with more in the whole program (a group that every block adds to), waited for whole in
        the small program, is waited for whole."""
        o = x.counter
        c = self._ref(CTR, o, t, w)
        size = self.c_size[o]
        if count[c] == size:
            return Wait(c, x.threshold)
        if x.threshold != size or c != self.ids[CTR].get((o, self.wb(self.blk[CTR][o]))):
            raise NoStamp
        return Wait(c, count[c])
