"""Dependencies at scale, and `resync`: recompute every task's waits from its data dependencies.

The edges are `amk.program.deps.scan`'s (RAW on the last writer, WAR on the readers since, else
WAW). A decode program after tiling and fusion has ~20k tasks whose direct edges are all-to-all
between consecutive tiled ops (~2M edges), so they stay in scan's shared groups (frozensets) and
are never listed one by one; the transitive reduction uses ancestor bitsets (Python ints) per
distinct group.

`resync` is the simple scheme a restructuring pass ends with: tasks that share an out_counter
and sit next to each other in program order (the tiles of one op) are one group with one counter;
a consumer waits for the whole group (threshold = group size). `allocate_counters` refines this.
`rethreshold` is the cheap form for passes that only split tasks (tile, split_kv): each piece
keeps its op's waits and counter, so only thresholds change. Passes run with the cyclic GC
paused (`without_gc`): they make no cycles, and collections over a big heap cost seconds.
"""
from __future__ import annotations

from typing import Sequence

from amk.gcpause import without_gc
from amk.program.ir import Buffer, Counter, Program, Task, Wait, new_task
from amk.program.deps import forget_last_scan, scan_all
from amk.program.regions import Region, forget_fused_regions, task_regions

_EMPTY: frozenset[int] = frozenset()


# task_regions is the one table of what an op touches, but it costs microseconds a call and
# every pass needs all ~20k tasks' regions. Passes rebuild tasks with the same params object
# (new waits, counters, ids), so regions are memoised by that object plus the operands.
_REGIONS: dict[tuple, tuple[object, Sequence[Buffer], tuple[list[Region], list[Region]]]] = {}
_REGIONS_MAX = 400_000


def _region_key(task: Task, buffers: Sequence[Buffer]) -> tuple:
    # One params object belongs to one task lineage (passes rebuild a task around the same
    # object). The key has no buffers: a pass that renames buffers may seed the renamed
    # regions (remember_regions); an entry of another buffers sequence serves where the task's
    # operands have the same shapes in both (a region depends on nothing else of a buffer).
    return (id(task.params), task.op, task.inputs, task.outputs)


def _same_shapes(task: Task, a: Sequence[Buffer], b: Sequence[Buffer]) -> bool:
    return a is b or all(a[x].shape == b[x].shape for x in task.inputs + task.outputs)


def regions_of(task: Task, buffers: Sequence[Buffer]) -> tuple[list[Region], list[Region]]:
    """task_regions(task, buffers), memoised (see above)."""
    key = _region_key(task, buffers)
    hit = _REGIONS.get(key)
    if hit is not None and hit[0] is task.params and _same_shapes(task, hit[1], buffers):
        return hit[2]
    r = task_regions(task, buffers)
    remember_regions(task, buffers, r)
    return r


def remember_regions(task: Task, buffers: Sequence[Buffer], regions) -> None:
    """Seed the memo (a pass that renames buffers knows the new regions without recomputing)."""
    if len(_REGIONS) > _REGIONS_MAX:
        _REGIONS.clear()
    _REGIONS[_region_key(task, buffers)] = (task.params, buffers, regions)


def task_region_list(program: Program) -> list[tuple[list[Region], list[Region]]]:
    return [regions_of(t, program.buffers) for t in program.tasks]


# The last program's dependencies: allocate_counters sees the program plan_memory just
# resynced, with new waits but the same tasks, and needs the same edges again.
_LAST: dict = {"key": None, "parts": None, "params": None}


def forget() -> None:
    """Drop the memos of one pipeline run (regions, the last dependencies, the last scan, the
    FUSED regions): they serve only its passes, and the ~10^6 small objects they hold (the 8B
    shape) would make every later collection of the garbage collector scan them (0.76 -> 0.22 s
    a full collection)."""
    _REGIONS.clear()
    _LAST.update(key=None, parts=None, params=None)
    forget_last_scan()
    forget_fused_regions()


def direct_dependency_parts(program: Program, regions=None) -> list[list[frozenset[int]]]:
    """For each task (program order = task index), its direct dependencies as a few frozensets
    whose union is exactly `amk.program.deps.dependencies(program)[t]`."""
    if regions is not None:
        return _direct_parts(program, regions)
    key = (program.buffers, tuple((id(t.params), t.op, t.inputs, t.outputs)
                                  for t in program.tasks))
    if _LAST["key"] == key:
        return _LAST["parts"]
    parts = _direct_parts(program, None)
    # the params objects are held so that their ids in the key cannot be reused meanwhile
    _LAST.update(key=key, parts=parts, params=[t.params for t in program.tasks])
    return parts


def _direct_parts(program: Program, regions=None) -> list[list[frozenset[int]]]:
    if regions is None:
        regions = task_region_list(program)
    found, _ = scan_all(program.buffers, program.tasks, regions)
    return [[c.earlier for c in conflicts] for conflicts in found]


def direct_dependencies(program: Program, regions=None) -> list[tuple[int, ...]]:
    """Sorted direct dependencies per task (the same edges as amk.program.deps)."""
    return [tuple(sorted(frozenset().union(*p))) if p else ()
            for p in direct_dependency_parts(program, regions)]


def reduced_dependencies(program: Program, regions=None) -> list[frozenset[int]]:
    """For each task, its direct dependencies minus those implied through another dependency
    (the transitive reduction). Equal sets are the same object, so callers can memoise by id."""
    parts_all = direct_dependency_parts(program, regions)
    anc: list[int] = [0] * len(parts_all)      # strict ancestors of each task, as a bitset
    part_info: dict[frozenset[int], tuple[int, int]] = {}
    filtered: dict[tuple[frozenset[int], int], frozenset[int]] = {}
    unions: dict[tuple[frozenset[int], ...], frozenset[int]] = {}
    out: list[frozenset[int]] = []
    # the same parts (objects, in order), the same ancestors and result: the tiles of one op
    # often share theirs (the parts are held by parts_all, so their ids stay theirs)
    same: dict[tuple[int, ...], tuple[int, frozenset[int]]] = {}
    for t, parts in enumerate(parts_all):
        if not parts:
            out.append(_EMPTY)
            continue
        key_parts = tuple(map(id, parts))
        hit = same.get(key_parts)
        if hit is not None:
            anc[t] = hit[0]
            out.append(hit[1])
            continue
        implied = 0      # ancestors of my dependencies: a dependency in here is redundant
        mine = 0         # my dependencies
        for p in parts:
            info = part_info.get(p)
            if info is None:
                a = b = 0
                for q in p:
                    a |= anc[q]
                    b |= 1 << q
                info = part_info[p] = (a, b)
            implied |= info[0]
            mine |= info[1]
        anc[t] = implied | mine
        kept = []
        for p in parts:
            if not part_info[p][1] & implied:       # none of p is implied: p itself
                kept.append(p)
                continue
            key = (p, implied)
            f = filtered.get(key)
            if f is None:
                f = filtered[key] = frozenset(q for q in p if not (implied >> q) & 1)
            if f:
                kept.append(f)
        k = tuple(kept)
        d = unions.get(k)
        if d is None:
            d = unions[k] = frozenset().union(*kept) if len(kept) != 1 else kept[0]
        same[key_parts] = (anc[t], d)
        out.append(d)
    return out


def renumber(tasks: Sequence[Task]) -> tuple[Task, ...]:
    """Task ids = positions in program order (every pass relies on it)."""
    return tuple(t if t.id == i else rebuilt(t, id=i) for i, t in enumerate(tasks))


def rebuilt(t: Task, *, id: int | None = None, waits=None, out_counter: int | None = None,
            inputs=None, outputs=None) -> Task:
    """Task with some fields replaced (dataclasses.replace costs ~10x more; 20k tasks a pass)."""
    return new_task(t.id if id is None else id, t.op, t.inputs if inputs is None else inputs,
                t.outputs if outputs is None else outputs, t.params,
                t.waits if waits is None else waits,
                t.out_counter if out_counter is None else out_counter, t.name)


def _max_of(parts: Sequence[frozenset[int]], memo: dict[int, int]) -> int:
    m = -1
    for p in parts:
        v = memo.get(id(p))
        if v is None:
            v = memo[id(p)] = max(p)
        if v > m:
            m = v
    return m


def sibling_groups(program: Program, deps: Sequence[Sequence[frozenset[int]]]) -> list[int]:
    """Group index per task: runs of adjacent tasks sharing an out_counter; a run restarts at a
    task that depends on a member (so a group is always entirely before its consumers).
    deps[t] is a list of frozensets whose union is t's dependencies."""
    group = [0] * len(program.tasks)
    g = -1
    start = 0
    prev = None
    memo: dict[int, int] = {}
    for t, task in enumerate(program.tasks):
        if task.out_counter != prev or _max_of(deps[t], memo) >= start:
            g += 1
            start = t
            prev = task.out_counter
        group[t] = g
    return group


def waits_from_groups(deps: Sequence[Sequence[frozenset[int]]], group: Sequence[int],
                      size: Sequence[int]) -> list[tuple[Wait, ...]]:
    """Each task waits for every group holding one of its dependencies (threshold = size).
    deps[t] is a list of frozensets (shared objects are looked at once)."""
    per_part: dict[int, frozenset[int]] = {}
    memo: dict[tuple[int, ...], tuple[Wait, ...]] = {}
    # the same parts (objects, held by deps), the same waits: the tiles of one op share theirs
    same: dict[tuple[int, ...], tuple[Wait, ...]] = {}
    out = []
    for parts in deps:
        key_parts = tuple(map(id, parts))
        w = same.get(key_parts)
        if w is not None:
            out.append(w)
            continue
        gs: set[int] = set()
        for p in parts:
            s = per_part.get(id(p))
            if s is None:
                s = per_part[id(p)] = frozenset(map(group.__getitem__, p))
            gs |= s
        key = tuple(sorted(gs))
        w = memo.get(key)
        if w is None:
            w = memo[key] = tuple(Wait(g, size[g]) for g in key)
        same[key_parts] = w
        out.append(w)
    return out


def with_waits(program: Program, waits: Sequence[tuple[Wait, ...]], out_counter: Sequence[int],
               n_counters: int) -> Program:
    tasks = tuple(rebuilt(t, id=i, waits=w, out_counter=c)
                  for i, (t, w, c) in enumerate(zip(program.tasks, waits, out_counter)))
    return program.with_(tasks=tasks, counters=tuple(Counter(i) for i in range(n_counters)))


@without_gc
def resync(program: Program) -> Program:
    """Recompute waits and counters from data dependencies (sibling-group scheme, see above)."""
    tasks = renumber(program.tasks)
    queues = program.queues if tasks == program.tasks else ()
    program = program.with_(tasks=tasks, queues=queues)
    deps = direct_dependency_parts(program)
    group = sibling_groups(program, deps)
    n = (group[-1] + 1) if group else 0
    size = [0] * n
    for g in group:
        size[g] += 1
    return with_waits(program, waits_from_groups(deps, group, size), group, n)


def rethreshold(program: Program) -> Program:
    """After a pass that only split tasks (each piece keeps the waits and out_counter of the task
    it came from, consumers' waits name that counter): every wait's threshold becomes the
    number of tasks that now increment its counter; counters are renumbered densely."""
    count: dict[int, int] = {}
    for t in program.tasks:
        count[t.out_counter] = count.get(t.out_counter, 0) + 1
    dense = {c: i for i, c in enumerate(sorted(count))}
    memo: dict[tuple[Wait, ...], tuple[Wait, ...]] = {}
    tasks = []
    for i, t in enumerate(program.tasks):
        w = memo.get(t.waits)
        if w is None:
            w = memo[t.waits] = tuple(Wait(dense[x.counter], count[x.counter])
                                      for x in t.waits if x.counter in count)
        tasks.append(rebuilt(t, id=i, waits=w, out_counter=dense[t.out_counter]))
    return program.with_(tasks=tuple(tasks), counters=tuple(Counter(i) for i in range(len(dense))),
                         queues=())
