"""stamp_period: plan_memory and allocate_counters stamped too, from a small program of six blocks.

Those passes share storage and counters across blocks: plan_memory's free lists hand a layer's
activations the buffers of an earlier one (from block 1 on, the same ones in every block on the
1B and Qwen3, two sets in turn on the 8B: NOTES v34d), and allocate_counters' group of the
tasks nobody waits on spans the program. Their state repeats with the blocks, with a period of
one or two. So the small graph keeps blocks 0-4 and the last (0-5 where the block count is odd,
so that the last block follows a block of the same phase); passes/stamp.py's three-block stamp
gives its fused program, the passes run on it, and its last `period` middle blocks, the
template, are copied for the whole program's blocks 5 .. n-2.

Which references of a copy name one fixed object (a shared buffer, the group nobody waits on)
and which name the same object of an earlier block is read off the small program: each
template block is compared, task by task, with the block one period before it. Equal objects:
fixed; objects with the same key one period apart: d blocks back; anything else, or a
template block unlike the one before (op, params, keys, the blocks' buffers and counters):
NoStamp, and the caller stamps the local passes only. tests/passes/test_stamp_period.py checks
the result against the plain pipeline, every field.
"""
from __future__ import annotations

from typing import Callable

from amk.graph import Graph
from amk.passes.lower import lower_with_origins
from amk.passes.repeat import find_repeat, small_graph
from amk.passes.stamp import ABS, BUF, CTR, INPUT, NoStamp, Stamp, checked, stamp_parts
from amk.program.ir import Program

BLOCKS = 6          # the small graph's blocks: the first, four middle ones (two periods of two), the last
PERIODS = (1, 2)


def stamped_periodic(graph: Graph, opts, local: list[Callable],
                     periodic: list[Callable]) -> Program | None:
    """The program `local` then `periodic` give `graph`, from its small graph of BLOCKS (or
    BLOCKS + 1) blocks; None where the graph has no Repeat of at least two more blocks or the
    small program does not repeat with a period in PERIODS. Checked as stamp.stamped's."""
    made = periodic_parts(graph, opts, local, periodic)
    return None if made is None else checked(graph, *made)


def periodic_parts(graph: Graph, opts, local: list[Callable],
                   periodic: list[Callable]) -> tuple[Stamp, Program] | None:
    """The stamp and its program, unchecked; None as stamped_periodic's."""
    rep = find_repeat(graph)
    if rep is None:
        return None
    blocks = BLOCKS + (rep.count - BLOCKS) % 2
    if rep.count < blocks + 2:
        return None
    made = stamp_parts(small_graph(graph, rep, blocks), opts, local, marked=True)
    if made is None:
        return None
    first, program = made
    for fn in periodic:
        program = fn(program, opts)
    lowered = lower_with_origins(graph)
    for period in PERIODS:
        try:
            stamp = Stamp(graph, rep, program, *first.f_eqns, blocks, period, lowered)
            stamp.read()
            _classify(stamp)
            return stamp, stamp.program()
        except NoStamp:
            continue
    return None


def _classify(st: Stamp) -> None:
    """st.modes and st.fixed from the template blocks and the blocks one period before them."""
    p, small = st.p, st.small
    modes: dict[tuple[int, int, int], int | None] = {}
    fixed: tuple[set[int], set[int]] = (set(), set())

    def pair(kind: int, t: int, o: int, o2: int) -> None:
        c, c2 = st.blk[kind][o], st.blk[kind][o2]
        if c == INPUT:                          # a shared input, or block t's and t-p's own
            if o != o2 and (st.inv[t].get(o) is None or st.inv[t].get(o) != st.inv[t - p].get(o2)):
                raise NoStamp
            return
        if o == o2:
            m = ABS
            fixed[kind].add(o)
        elif c - c2 == p and st.key[kind][o] == st.key[kind][o2] and c <= t:
            m = t - c
        else:
            raise NoStamp
        if modes.setdefault((kind, t, o), m) != m:
            raise NoStamp

    for t in range(st.K - 1 - p, st.K - 1):
        u = t - p
        for kind in (BUF, CTR):                 # the blocks' own objects, alike
            if [k for b, k in zip(st.blk[kind], st.key[kind]) if b == t] != \
                    [k for b, k in zip(st.blk[kind], st.key[kind]) if b == u]:
                raise NoStamp
        (lo, hi), (lo2, hi2) = st.t_range[t], st.t_range[u]
        if hi - lo != hi2 - lo2:
            raise NoStamp
        for i, i2 in zip(range(lo, hi), range(lo2, hi2)):
            a, b = small.tasks[i], small.tasks[i2]
            if st.t_key[i] != st.t_key[i2] or a.op is not b.op or len(a.waits) != len(b.waits) \
                    or len(a.inputs) != len(b.inputs) or len(a.outputs) != len(b.outputs) \
                    or not (a.params is b.params or a.params == b.params):
                raise NoStamp
            for o, o2 in zip(a.inputs + a.outputs, b.inputs + b.outputs):
                pair(BUF, t, o, o2)
            for x, y in zip(a.waits, b.waits):
                pair(CTR, t, x.counter, y.counter)
            pair(CTR, t, a.out_counter, b.out_counter)
    st.modes, st.fixed = modes, fixed
