"""defer_kv_append: the attention reads the step's new K/V row from the projections, and the
KV_APPEND that writes it into the cache runs after the attention, off the critical path.

A decode layer computes k and v, appends them to the caches at pos, then attends over the
caches: the append is a hand-off between the projections and the attention (on an H200 a task
of ~2 us plus a counter hop, NOTES v10). Here an ATTENTION_TILE whose caches were last written
by two KV_APPENDs (one per cache, same pos input) gets their new rows as inputs k_new, v_new
and flags bit NEW_KV (docs/PROGRAM.md: row pos is read from them, cast to the caches' dtypes),
and both appends move to just after the last such attention. The attention then depends only
on the projections (per kv head, after split_kv), and the append, writing a row the attention
read as a whole cache, waits for the attention (a write-after-read edge): same values, one hop
less on the way to the output.

Only when nothing else touches the caches between the appends and the attention, and nothing
writes the appends' inputs (new rows, pos) before their new place. Runs before split_kv, so
every shard inherits the new inputs.

The waits are patched where the edges moved, not recomputed from every task's data (a scan of
the whole program, ~0.25 s for Qwen3-0.6B; fuse and allocate_counters recompute them anyway):
an attention waits for what its appends waited for (the producers of the new rows) instead of
the appends, and each append waits for its attentions too (it overwrites a row they read).
"""
from __future__ import annotations

from amk.passes.options import PassOptions
from amk.gcpause import without_gc
from amk.passes.sync import rebuilt, regions_of, resync, with_waits
from amk.program.ir import InstructionKind as K, Program, Task, Wait
from amk.program.regions import NEW_KV


def _plain_append(t: Task, bufs) -> bool:
    """A KV_APPEND of one row per sequence at a runtime pos (not the seed's params['pos'])."""
    if t.op is not K.KV_APPEND or len(t.inputs) != 2 or "pos" in t.params:
        return False
    new, cache = bufs[t.inputs[0]], bufs[t.outputs[0]]
    lead = cache.shape[1] if len(cache.shape) == 4 else cache.shape[0]
    return new.numel * lead == cache.numel


def _candidate(t: Task) -> bool:
    return (t.op is K.ATTENTION_TILE and len(t.inputs) == 4
            and not int(t.params.get("flags", 0)) & NEW_KV)


@without_gc
def defer_kv_append(program: Program, opts: PassOptions | None = None) -> Program:
    opts = opts or PassOptions()
    if not opts.defer_kv_append:
        return program
    bufs = program.buffers
    tasks = list(program.tasks)
    regions = [regions_of(t, bufs) for t in tasks]
    last_append: dict[int, int] = {}        # cache buffer -> index of its latest plain append
    plans: dict[tuple[int, int], list[int]] = {}   # (k append, v append) -> attention indices
    for i, t in enumerate(tasks):
        if _candidate(t):
            ak, av = last_append.get(t.inputs[1]), last_append.get(t.inputs[2])
            if (ak is not None and av is not None and ak != av
                    and tasks[ak].inputs[1] == tasks[av].inputs[1] == t.inputs[3]):
                plans.setdefault((ak, av), []).append(i)
        for w in regions[i][1]:
            if _plain_append(t, bufs) and w.buffer == t.outputs[0]:
                last_append[w.buffer] = i
            elif w.buffer in last_append and i != last_append[w.buffer]:
                del last_append[w.buffer]          # another writer: that append is not the last
    moved: dict[int, int] = {}                     # append index -> attention index it follows
    readers_of: dict[int, list[int]] = {}          # append index -> its attentions
    for (ak, av), readers in plans.items():
        lo, hi = min(ak, av), readers[-1]
        caches = {tasks[ak].outputs[0], tasks[av].outputs[0]}
        inputs = set(tasks[ak].inputs) | set(tasks[av].inputs)
        ok = all(j in (ak, av) or j in readers or not any(
            r.buffer in caches for r in regions[j][0] + regions[j][1])
            for j in range(lo, hi + 1))
        ok = ok and not any(w.buffer in inputs for j in range(lo, hi + 1) for w in regions[j][1]
                            if j not in (ak, av))
        if not ok:
            continue
        for j in readers:
            t = tasks[j]
            tasks[j] = Task(t.id, t.op, t.inputs + (tasks[ak].inputs[0], tasks[av].inputs[0]),
                            t.outputs, {**t.params, "flags": int(t.params.get("flags", 0)) | NEW_KV},
                            t.waits, t.out_counter, t.name)
        moved[ak] = moved[av] = hi
        readers_of[ak] = readers_of[av] = readers
    if not moved:
        return program
    patched = _patched_waits(tasks, moved, readers_of, len(program.counters))
    out = _moved(patched or tasks, moved)
    if patched is None:                  # a wait this patch does not know how to move
        return resync(program.with_(tasks=tuple(out), queues=()))
    return _in_order(program, out)


def _moved(tasks: list[Task], moved: dict[int, int]) -> list[Task]:
    """Program order with each moved append just after the attention it follows."""
    after: dict[int, list[Task]] = {}
    for a in sorted(moved):
        after.setdefault(moved[a], []).append(tasks[a])
    out: list[Task] = []
    for i, t in enumerate(tasks):
        if i not in moved:
            out.append(t)
            out.extend(after.get(i, ()))
    return out


def _patched_waits(tasks: list[Task], moved: dict[int, int], readers_of: dict[int, list[int]],
                   n_counters: int) -> list[Task] | None:
    """tasks (in their old order) with the moved edges' waits (the module docstring), or None
    where a task other than the attentions waits for an append and would come before it."""
    size = [0] * n_counters
    for t in tasks:
        size[t.out_counter] += 1
    appends_of = {tasks[a].out_counter: a for a in moved}
    if len(appends_of) != len(moved):
        return None
    for i, t in enumerate(tasks):
        for w in t.waits:
            a = appends_of.get(w.counter)
            if a is not None and i <= moved[a] and i not in readers_of[a]:
                return None
    full = lambda c: Wait(c, size[c])                               # noqa: E731
    out = list(tasks)
    by_reader: dict[int, list[int]] = {}
    for a, readers in readers_of.items():
        for j in readers:
            by_reader.setdefault(j, []).append(a)
        # the append overwrites a row its attentions read: it waits for them too
        extra = {tasks[j].out_counter for j in readers}
        out[a] = rebuilt(tasks[a], waits=_merged(tasks[a].waits, map(full, extra)))
    for j, appends in by_reader.items():
        gone = {tasks[a].out_counter for a in appends}
        kept = tuple(w for w in tasks[j].waits if w.counter not in gone)
        out[j] = rebuilt(tasks[j], waits=_merged(kept, (w for a in appends for w in tasks[a].waits)))
    return out


def _merged(waits, more) -> tuple[Wait, ...]:
    """waits and more, one wait a counter (thresholds are whole groups: equal for a counter)."""
    got = {w.counter: w for w in waits}
    for w in more:
        got.setdefault(w.counter, w)
    return tuple(got[c] for c in sorted(got))


def _in_order(program: Program, tasks: list[Task]) -> Program:
    """program with tasks (in their new order), ids = positions and counters renumbered by
    first increment in program order, as resync numbers them (sync.with_waits)."""
    new: dict[int, int] = {}
    for t in tasks:
        new.setdefault(t.out_counter, len(new))
    memo: dict[tuple[Wait, ...], tuple[Wait, ...]] = {}      # tiles of one op share their waits
    waits = []
    for t in tasks:
        w = memo.get(t.waits)
        if w is None:
            w = memo[t.waits] = tuple(sorted((Wait(new[x.counter], x.threshold) for x in t.waits),
                                             key=lambda x: x.counter))
        waits.append(w)
    return with_waits(program.with_(tasks=tuple(tasks), queues=()), waits,
                      [new[t.out_counter] for t in tasks], len(new))
