"""A K-split GEMV's SUM run by the last of its slices to finish, not as a task of its own.

A SUM of a split GEMV's partials (passes/tile.split_k; the residual ADD folded in by
folds.sum_add, one op_sum) is a stage of its own: its slices release their counter, an SM
polls it, adds 16 KB of partials and releases the SUM's counter, which the next stage polls:
two hand-offs a layer for a few microseconds of work (NOTES v49). Here each slice releases
its counter with an acq_rel add instead; the slice whose add completes the count runs the SUM
right there and releases the SUM's counter itself. The program is unchanged: every counter
still gets the same adds, the SUM's after its inputs are complete, and op_sum adds the
partials in input order, so the bits do not depend on which slice is last.

Legal for any task that waits on one counter nobody else waits on (its producers' release is
then the only wait it has); taken for op_sum of one row alone (batch 1's split, AMK_K_SPLIT):
the one step small enough to be worth running serially after a slice (at batch 16 it was
level to slower than the SUM's stage, NOTES v50), and only where every producer is a plain
GEMV task (a K slice), whose ip THEN names it. The SUM leaves its queue (the task after it
there preloads from the task before it instead).
"""
from __future__ import annotations

from amk.program.ir import InstructionKind as K, Program
from amk.backends.cuda.steps import FoldedTask


GEMVS = (K.GEMV_TILE, K.GEMM_TILE)


def sum_by_last(program: Program, tasks: list[FoldedTask], queues: list[list[int]]) -> dict[int, int]:
    """{producer task id: the SUM task it runs when last}; removes those SUMs from ``queues``."""
    waiters = [0] * len(program.counters)
    producers: list[list[int]] = [[] for _ in program.counters]
    for t in program.tasks:
        for w in t.waits:
            waiters[w.counter] += 1
        if t.out_counter is not None and t.out_counter >= 0:
            producers[t.out_counter].append(t.id)
    runs: dict[int, list[int]] = {}           # SUM task id -> its producers
    for ft in tasks:
        t = ft.task
        if not (ft.one and ft.steps[0][0].is_fn("op_sum") and ft.steps[0][0].ip["ROWS"] == 1
                and len(t.waits) == 1):
            continue
        c, threshold = t.waits[0].counter, t.waits[0].threshold
        # the threshold is every producer's add (a step's target is threshold + epoch x count)
        if waiters[c] != 1 or threshold != len(producers[c]) or not producers[c]:
            continue
        if all(tasks[p].one and tasks[p].task.op in GEMVS for p in producers[c]):   # ip THEN
            runs[t.id] = producers[c]
    # a SUM whose producer is another such SUM stays a task (the runner releases with a plain add)
    then = {p: s for s, ps in runs.items() if not any(p in runs for p in ps) for p in ps}
    if then:
        gone = set(then.values())
        queues[:] = [[j for j in q if j not in gone] for q in queues]
    return then
