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
"""
from __future__ import annotations

from amk.passes.options import PassOptions
from amk.gcpause import without_gc
from amk.passes.sync import regions_of, resync
from amk.program.ir import InstructionKind as K, Program, Task
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
    if not moved:
        return program
    after: dict[int, list[Task]] = {}
    for a in sorted(moved):
        after.setdefault(moved[a], []).append(tasks[a])
    out: list[Task] = []
    for i, t in enumerate(tasks):
        if i not in moved:
            out.append(t)
            out.extend(after.get(i, ()))
    return resync(program.with_(tasks=tuple(out), queues=()))
