"""place: assign tasks to per-SM static queues by list scheduling on the cost model
(amk/passes/cost.py): a simulated clock per queue.

Tasks are taken in program order. A task is ready when its waits are met: for each wait, the
time its counter's incrementers (placed earlier, with simulated finish times) reach the
threshold. It goes to the queue that finishes it earliest (to within FINISH_TIE_NS), ties to the least
loaded queue. So the tiles of one stage spread over the SMs instead of piling two on one SM
while another idles, a task that must wait (a split-KV combine) lands where the wait costs
least, and the per-SM totals stay balanced.
Every queue lists its tasks in increasing program order, and every wait names tasks earlier in
program order, so the placement cannot deadlock: the earliest unfinished task is always at the
head of its queue with all its waits met.
"""
from __future__ import annotations

from heapq import heapify, heappop, heappush
from math import floor

import numpy as np

from amk.identity_memo import IdentityMemo
from amk.passes.cost import cost_ns
from amk.gcpause import without_gc
from amk.passes.options import H200, PassOptions, Target
from amk.program.ir import Program


# Finish times closer than this count as equal; the tie goes to the least-loaded queue, which
# keeps the per-SM totals balanced (max/mean 1.01 on Llama-1B) at no cost in simulated makespan.
FINISH_TIE_NS = 1000.0


@without_gc
def place(program: Program, opts: PassOptions | None = None) -> Program:
    opts = opts or PassOptions()
    if not opts.place:
        return program
    target = opts.target
    nq = max(1, min(target.num_sms, len(program.tasks)))
    free = [0.0] * nq                                # simulated time each queue frees
    load = [0.0] * nq                                # total cost placed on each queue
    queues: list[list[int]] = [[] for _ in range(nq)]
    init = {c.id: c.init for c in program.counters}
    done: dict[int, list[float]] = {}               # counter -> finish times of its incrementers
    latest: dict[int, float] = {}
    costs = IdentityMemo()                           # cost_ns's memo
    run = None                                       # (ready, cost, heap) of the current run
    for t in program.tasks:
        ready = 0.0
        for w in t.waits:
            fins = done.get(w.counter, ())
            need = w.threshold - init.get(w.counter, 0)
            if need <= 0 or not fins:
                continue
            at = latest[w.counter] if need >= len(fins) else sorted(fins)[need - 1]
            ready = max(ready, at)
        cost = cost_ns(t, program.buffers, target, costs)
        if run is None or run[0] != ready or run[1] != cost:
            run = (ready, cost, _keys(free, load, ready, cost))
        heap = run[2]
        # the queue that finishes it earliest (to FINISH_TIE_NS), then the least loaded, then
        # the first; its key is the only one this task changes
        _, _, q, end = heappop(heap)
        free[q] = end
        load[q] += cost
        finish = max(end, ready) + cost
        heappush(heap, (floor(finish / FINISH_TIE_NS), load[q], q, finish))
        queues[q].append(t.id)
        if t.out_counter is not None and t.out_counter >= 0:
            done.setdefault(t.out_counter, []).append(end)
            latest[t.out_counter] = max(latest.get(t.out_counter, 0.0), end)
    return program.with_(queues=tuple(tuple(q) for q in queues))


def _keys(free: list[float], load: list[float], ready: float, cost: float) -> list[tuple]:
    """A heap of each queue's (finish bucket, load, queue, finish) for a task ready at `ready`
    costing `cost`: the tiles of one op share both (Qwen3-0.6B: 450 runs over 18k tasks), so
    a run builds it once and each task changes one queue's key."""
    finish = np.maximum(np.array(free), ready) + cost
    heap = list(zip(np.floor(finish / FINISH_TIE_NS).tolist(), load, range(len(free)),
                    finish.tolist()))
    heapify(heap)
    return heap


def queue_costs(program: Program, target: Target = H200) -> list[float]:
    by_id = {t.id: t for t in program.tasks}
    return [sum(cost_ns(by_id[i], program.buffers, target) for i in q) for q in program.queues]


def placement_balance(program: Program, target: Target = H200) -> float:
    """max / mean queue cost (1.0 = perfect); 0.0 for an unplaced program."""
    costs = queue_costs(program, target)
    if not costs or sum(costs) == 0:
        return 0.0
    return max(costs) / (sum(costs) / len(costs))
