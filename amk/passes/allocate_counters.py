"""allocate_counters: the fewest counters that keep every dependency at its finest grain.

Each task's dependencies are its direct hazards minus those implied through another dependency
(transitive reduction, amk/passes/sync.py). Producers are grouped by the exact set of consumers
that wait on them; each group gets one counter, threshold = group size, and every consumer
waits on the groups of its dependencies, which by construction it depends on entirely. So the
split-KV task of kv group g waits only for the q tiles holding its heads (one counter), while
the o-proj tiles wait for all combines (another). Tasks nobody waits on share one counter.
Every wait names a group that lies wholly before the waiter in program order: acyclic, so any
placement that keeps program order per queue cannot deadlock. Counters are never reset.
"""
from __future__ import annotations

from amk.passes.options import PassOptions
from amk.gcpause import without_gc
from amk.passes.sync import reduced_dependencies, renumber, waits_from_groups, with_waits
from amk.program.ir import Program


@without_gc
def allocate_counters(program: Program, opts: PassOptions | None = None) -> Program:
    tasks = renumber(program.tasks)
    queues = program.queues if tasks == program.tasks else ()
    program = program.with_(tasks=tasks, queues=queues)
    deps = reduced_dependencies(program)
    n = len(tasks)
    # consumer signature of each producer: which distinct dependency sets contain it
    sets: dict[int, int] = {}
    sig: list[list[int]] = [[] for _ in range(n)]
    for d in deps:
        if d and id(d) not in sets:
            k = sets[id(d)] = len(sets)
            for p in d:
                sig[p].append(k)
    group_of_sig: dict[tuple[int, ...], int] = {}
    group = [0] * n
    size: list[int] = []
    for t in range(n):
        key = tuple(sig[t])
        g = group_of_sig.get(key)
        if g is None:
            g = group_of_sig[key] = len(size)
            size.append(0)
        group[t] = g
        size[g] += 1
    parts = [[d] if d else [] for d in deps]
    return with_waits(program, waits_from_groups(parts, group, size), group, len(size))
