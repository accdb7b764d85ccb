"""place: assign tasks to per-SM static queues, balanced by the cost model (amk/passes/cost.py).

Tasks are taken in program order, each to the queue with the least cost so far (ties: lowest
queue). Every queue therefore lists its tasks in increasing program order, and every wait names
tasks earlier in program order, so the placement cannot deadlock: the earliest unfinished task
is always at the head of its queue with all its waits met. Taking tasks in program order also
spreads each op's tiles over all SMs, so every SM streams weights in every phase.
"""
from __future__ import annotations

import heapq

from amk.passes.cost import cost_ns
from amk.passes.sync import without_gc
from amk.passes.options import H200, PassOptions, Target
from amk.program.ir import Program


@without_gc
def place(program: Program, opts: PassOptions | None = None) -> Program:
    opts = opts or PassOptions()
    if not opts.place:
        return program
    target = opts.target
    nq = max(1, min(target.num_sms, len(program.tasks)))
    heap = [(0.0, q) for q in range(nq)]
    queues: list[list[int]] = [[] for _ in range(nq)]
    for t in program.tasks:
        load, q = heapq.heappop(heap)
        queues[q].append(t.id)
        heapq.heappush(heap, (load + cost_ns(t, program.buffers, target), q))
    return program.with_(queues=tuple(tuple(q) for q in queues))


def queue_costs(program: Program, target: Target = H200) -> list[float]:
    by_id = {t.id: t for t in program.tasks}
    return [sum(cost_ns(by_id[i], program.buffers, target) for i in q) for q in program.queues]


def placement_balance(program: Program, target: Target = H200) -> float:
    """max / mean queue cost (1.0 = perfect); 0.0 for an unplaced program."""
    costs = queue_costs(program, target)
    if not costs or sum(costs) == 0:
        return 0.0
    return max(costs) / (sum(costs) / len(costs))
