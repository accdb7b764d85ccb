"""What the property tests share: stage runs, failure notes (program text and a one-line repro
command), schedule mutations and the kill-rate tally printed at the end of the session."""
from __future__ import annotations

import collections
import os
import shlex

from hypothesis import event, note
from hypothesis import strategies as st

import amk
from amk.passes import pipeline
from amk.program.ir import BufferKind, Counter, Program, Task, Wait
from amk.program.text import program_to_text
from amk.testing import Case, outputs_differ, run_vm, tolerance

PROFILE = "ci"          # set by conftest
SEED: int | None = None

# Passes that must not change any result bit in f32: they move, merge or place work, never
# reorder an accumulation. (FUSED is bit-identical to the unfused sequence by contract.)
# Passes not listed here (tile, split_kv, anything new) are checked within tolerance.
EXACT_PASSES = {"lower", "fuse", "plan_memory", "allocate_counters", "place"}


# ---------------------------------------------------------------------------------------------
# failure notes
# ---------------------------------------------------------------------------------------------
def repro_command() -> str:
    node = os.environ.get("PYTEST_CURRENT_TEST", "tests/property").rsplit(" (", 1)[0]
    cmd = f"AMK_HYPOTHESIS_PROFILE={PROFILE} python -m pytest {shlex.quote(node)}"
    if SEED is not None:
        cmd += f" --hypothesis-seed={SEED}"
    return cmd + "   (or add the @reproduce_failure line printed below to the test)"


def note_case(case: Case, opts=None) -> None:
    note(f"reproduce: {repro_command()}")
    note(f"decode step:\n{case.describe()}")
    if opts is not None:
        note(f"pass options: {opts}")


def note_program(label: str, program: Program) -> None:
    note(f"--- program after {label} ({len(program.tasks)} tasks) ---\n{program_to_text(program)}")


def size_event(program: Program) -> None:
    n = len(program.tasks)
    event(f"tasks: {'1-4' if n <= 4 else '5-16' if n <= 16 else '17-64' if n <= 64 else '65+'}")


# ---------------------------------------------------------------------------------------------
# stages
# ---------------------------------------------------------------------------------------------
def check_stages(case: Case, stages: dict[str, Program], reference: list, exact_dtype: bool):
    """Each stage validates and its VM result equals the lowering's (bitwise for EXACT_PASSES
    after an exact stage, in f32; within tolerance otherwise). Returns {stage: outputs}."""
    tol = tolerance(case.plan.dims.dtype)
    results = {}
    prev, prev_exact = None, True
    for name, prog in stages.items():
        note_program(name, prog)
        res = amk.validate(prog)
        assert res.ok, f"the program after pass '{name}' does not validate:\n{res.report()}"
        out = run_vm(prog, case)
        results[name] = out
        exact = exact_dtype and prev_exact and name in EXACT_PASSES
        want = reference if prev is None else prev
        diff = outputs_differ(out, want, exact=exact, tol=tol)
        assert diff is None, (f"stage '{name}' changes the result "
                              f"({'bitwise' if exact else 'beyond tolerance'}): {diff}")
        if prev is not None:
            diff = outputs_differ(out, results["lower"], exact=False, tol=tol)
            assert diff is None, f"stage '{name}' drifts from the plain lowering: {diff}"
        prev, prev_exact = out, exact
    return results


# ---------------------------------------------------------------------------------------------
# schedule mutations: each returns a mutated Program, or None if it does not apply
# ---------------------------------------------------------------------------------------------
def _incrementers(p: Program) -> list[int]:
    n = [0] * len(p.counters)
    for t in p.tasks:
        n[t.out_counter] += 1
    return n


def _set_task(p: Program, t: Task) -> Program:
    tasks = list(p.tasks)
    tasks[t.id] = t
    return p.with_(tasks=tuple(tasks))


def drop_wait(p: Program, data) -> Program | None:
    cands = [(t, i) for t in p.tasks for i in range(len(t.waits))]
    if not cands:
        return None
    t, i = data.draw(st.sampled_from(cands), label="drop wait (task, index)")
    return _set_task(p, t.with_(waits=t.waits[:i] + t.waits[i + 1:]))


def lower_threshold(p: Program, data) -> Program | None:
    cands = [(t, i) for t in p.tasks for i in range(len(t.waits))]
    if not cands:
        return None
    t, i = data.draw(st.sampled_from(cands), label="lower threshold (task, index)")
    w = t.waits[i]
    waits = t.waits[:i] + (Wait(w.counter, w.threshold - 1),) + t.waits[i + 1:]
    return _set_task(p, t.with_(waits=waits))


def raise_threshold(p: Program, data) -> Program | None:
    """Past what the counter's incrementers can reach: a guaranteed deadlock."""
    cands = [(t, i) for t in p.tasks for i in range(len(t.waits))]
    if not cands:
        return None
    t, i = data.draw(st.sampled_from(cands), label="raise threshold (task, index)")
    w = t.waits[i]
    need = p.counters[w.counter].init + _incrementers(p)[w.counter] + 1
    waits = t.waits[:i] + (Wait(w.counter, need),) + t.waits[i + 1:]
    return _set_task(p, t.with_(waits=waits))


def duplicate_writer(p: Program, data) -> Program | None:
    """A second copy of a task that writes something, appended; it shares the original's
    counter (its waiters no longer know which copy finished) or gets a fresh one."""
    cands = [t for t in p.tasks if t.outputs]
    if not cands:
        return None
    t = data.draw(st.sampled_from(cands), label="duplicate writer")
    shared = data.draw(st.booleans(), label="share its out-counter")
    counters = p.counters
    out = t.out_counter
    if not shared:
        out = len(counters)
        counters = counters + (Counter(out),)
    dup = t.with_(id=len(p.tasks), out_counter=out, name=f"duplicate of t{t.id}")
    return p.with_(tasks=p.tasks + (dup,), counters=counters)


def alias_buffers(p: Program, data) -> Program | None:
    """Every use of activation b replaced by activation a of the same shape and dtype."""
    acts = [b for b in p.buffers if b.kind == BufferKind.ACTIVATION]
    pairs = [(a.id, b.id) for a in acts for b in acts
             if a.id != b.id and a.shape == b.shape and a.dtype == b.dtype]
    if not pairs:
        return None
    a, b = data.draw(st.sampled_from(pairs), label="alias (keep, replace)")
    sub = lambda ids: tuple(a if x == b else x for x in ids)
    tasks = tuple(t.with_(inputs=sub(t.inputs), outputs=sub(t.outputs)) for t in p.tasks)
    return p.with_(tasks=tasks, outputs=sub(p.outputs))


def add_wait_cycle(p: Program, data) -> Program | None:
    """Task a waits for one of its own waiters b: a cycle, nothing in it can ever start."""
    incr = _incrementers(p)
    pairs = [(a.id, b.id) for b in p.tasks for w in b.waits for a in p.tasks
             if a.out_counter == w.counter and a.id != b.id]
    if not pairs:
        return None
    a, b = data.draw(st.sampled_from(sorted(set(pairs))), label="cycle (a waits on its waiter b)")
    ta, tb = p.tasks[a], p.tasks[b]
    need = p.counters[tb.out_counter].init + incr[tb.out_counter]
    return _set_task(p, ta.with_(waits=ta.waits + (Wait(tb.out_counter, need),)))


def tile_off_by_one(p: Program, data) -> Program | None:
    """A column tile one too narrow, one too wide, or shifted by one: a hole, an overlap, or
    both. A hole in a reused buffer leaves the previous tenant's columns, which is race-free:
    the test counts that as a data-flow change, not a kill."""
    cands = [t for t in p.tasks if "N_tile" in t.params and len(t.outputs) == 1]
    if not cands:
        return None
    t = data.draw(st.sampled_from(cands), label="tile task")
    n_off, n = int(t.params.get("n_off", 0)), int(t.params["N_tile"])
    how = data.draw(st.sampled_from(["narrow", "widen", "shift"]), label="off by one")
    if how == "narrow" and n < 2:
        return None
    new = {"narrow": (n_off, n - 1), "widen": (n_off, n + 1), "shift": (n_off + 1, n)}[how]
    return _set_task(p, t.with_(params={**t.params, "n_off": new[0], "N_tile": new[1]}))


def swap_in_queue(p: Program, data) -> Program | None:
    """Two neighbours in one per-SM queue swapped: an SM runs its queue in order."""
    cands = [(q, i) for q, queue in enumerate(p.queues) for i in range(len(queue) - 1)]
    if not cands:
        return None
    q, i = data.draw(st.sampled_from(cands), label="swap (queue, position)")
    queue = list(p.queues[q])
    queue[i], queue[i + 1] = queue[i + 1], queue[i]
    return p.with_(queues=p.queues[:q] + (tuple(queue),) + p.queues[q + 1:])


MUTATIONS = {"drop_wait": drop_wait, "lower_threshold": lower_threshold,
             "duplicate_writer": duplicate_writer, "alias_buffers": alias_buffers,
             "add_wait_cycle": add_wait_cycle, "tile_off_by_one": tile_off_by_one,
             "swap_in_queue": swap_in_queue}


# ---------------------------------------------------------------------------------------------
# the kill-rate tally
# ---------------------------------------------------------------------------------------------
KILLS: collections.Counter = collections.Counter()     # (mutation, outcome) -> count
# rejected / accepted, same bits / accepted, race-free but computes something else / a false negative
OUTCOMES = ("killed", "equivalent", "dataflow", "wrong")
# mutations that change only synchronisation (tasks and program order stay): if validate accepts
# one, the result must be the original's, bit for bit
SCHEDULE_ONLY = {"drop_wait", "lower_threshold", "add_wait_cycle", "swap_in_queue"}


def record(mutation: str, outcome: str) -> None:
    KILLS[(mutation, outcome)] += 1
    event(f"mutation {mutation}: {outcome}")


def kill_report() -> str:
    if not KILLS:
        return ""
    lines = []
    tot = collections.Counter()
    for m in sorted({m for m, _ in KILLS}):
        c = {o: KILLS[(m, o)] for o in OUTCOMES}
        n = sum(c.values())
        for o in OUTCOMES:
            tot[o] += c[o]
        lines.append(f"  {m:<18} {c['killed']:4d}/{n:<4d} killed ({100 * c['killed'] / n:5.1f}%)"
                     f"  equivalent {c['equivalent']}  dataflow {c['dataflow']}  wrong {c['wrong']}")
    n = sum(tot.values())
    lines.append(f"  {'total':<18} {tot['killed']:4d}/{n:<4d} killed ({100 * tot['killed'] / n:5.1f}%)"
                 f"  equivalent {tot['equivalent']}  dataflow {tot['dataflow']}  wrong {tot['wrong']}"
                 f"   [profile {PROFILE}]")
    return "\n".join(lines)


def final_stage(case: Case, opts=None) -> tuple[dict[str, Program], object]:
    from amk.testing import trace_case
    graph = trace_case(case)
    return pipeline.run_pipeline(graph, opts), graph
