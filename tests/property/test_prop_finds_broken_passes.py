"""The suite's own acceptance test: plant a broken pass and check that the stage property
(`check_stages`: validates, and computes what the graph computes) finds it and that Hypothesis
shrinks the counterexample to a program of a handful of tasks.

The broken passes wrap the plain lowering: `split_tiles` is a two-tile GEMV split (sibling tiles
share a counter, consumers wait for both), correct or with the second tile's bound off by one;
`drop_first_wait` drops one wait. The correct split must pass, so the harness has no false
positives."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, find, given, settings

from amk.program.ir import InstructionKind as K, Program, Wait
from amk.testing import Case, interpret_case, trace_case
from amk.passes.lower import lower

import prop_support as ps
from test_prop_pipeline import steps

GEMV = (K.GEMV_TILE, K.GEMM_TILE)


def split_tiles(program: Program, off_by_one: bool = False) -> Program:
    """Every GEMV of N >= 2 columns becomes tiles [0, h) and [h, N) (with the bug: [h+1, N),
    column h never written) sharing its counter; every waiter then needs threshold 2."""
    tasks, doubled = [], set()
    for t in program.tasks:
        n = t.params.get("N_tile", 0)
        if t.op in GEMV and n >= 2:
            h = n // 2
            lo = h + 1 if off_by_one else h
            tasks.append(t.with_(params={**t.params, "N_tile": h}, name=f"{t.name}[tile 0/2]"))
            tasks.append(t.with_(params={**t.params, "n_off": lo, "N_tile": n - lo},
                                 name=f"{t.name}[tile 1/2]"))
            doubled.add(t.out_counter)
        else:
            tasks.append(t)
    out = []
    for i, t in enumerate(tasks):
        waits = tuple(Wait(w.counter, w.threshold * 2 if w.counter in doubled else w.threshold)
                      for w in t.waits)
        out.append(t.with_(id=i, waits=waits))
    return program.with_(tasks=tuple(out))


def drop_first_wait(program: Program) -> Program:
    tasks = list(program.tasks)
    for t in tasks:
        if t.waits:
            tasks[t.id] = t.with_(waits=t.waits[1:])
            break
    return program.with_(tasks=tuple(tasks))


def stage_property_holds(case: Case, broken_pass) -> bool:
    """The pipeline property of test_prop_pipeline, with `broken_pass` as the only later pass."""
    graph = trace_case(case)
    low = lower(graph)
    try:
        ps.check_stages(case, {"lower": low, "broken": broken_pass(low)},
                        interpret_case(graph, case), exact_dtype=True)
    except AssertionError:
        return False
    return True


FIND = settings(database=None, derandomize=True, max_examples=300, deadline=None,
                suppress_health_check=list(HealthCheck))


@given(case=steps)
def test_the_correct_split_passes(case):
    ps.note_case(case)
    assert stage_property_holds(case, split_tiles)


@pytest.mark.parametrize("broken, max_tasks", [
    (lambda p: split_tiles(p, off_by_one=True), 2),   # one linear, split in two
    (drop_first_wait, 3),                             # two dependent tasks (and a spare)
], ids=["off_by_one_tile_bound", "dropped_wait"])
def test_the_property_finds_and_shrinks_a_broken_pass(broken, max_tasks):
    case = find(steps, lambda c: not stage_property_holds(c, broken), settings=FIND)
    program = broken(lower(trace_case(case)))
    print(f"shrunk to:\n{case.describe()}")
    assert len(program.tasks) <= max_tasks, (
        f"the counterexample did not shrink: {len(program.tasks)} tasks\n{case.describe()}")
    assert len(case.plan.layers) == 1 and len(case.plan.layers[0]) <= 2
