"""Schedule mutation testing of `validate`: a mutated schedule (a dropped wait, a lowered
threshold, a duplicated writer, two aliased buffers, a wait cycle) must be rejected, or else
provably harmless: the mutant, run on the VM in several random orders, gives the original's
result bit for bit. The kill rate is printed at the end of the session (conftest.py)."""
from __future__ import annotations

import re

import pytest
from hypothesis import event, given, note
from hypothesis import strategies as st

import amk
from amk.backends.reference.vm import ReferenceVM
from amk.errors import AmkError, DeadlockError
from amk.testing import bindings, outputs_differ, run_vm

import prop_support as ps
from test_prop_pipeline import steps

ORDERS = (("program", 0), ("random", 1), ("random", 2), ("random", 3))


@given(case=steps, mutation=st.sampled_from(sorted(ps.MUTATIONS)), data=st.data())
def test_validate_rejects_harmful_schedule_mutations(case, mutation, data):
    ps.note_case(case)
    stages, _ = ps.final_stage(case)
    stage = data.draw(st.sampled_from(sorted(stages)), label="stage")
    prog = stages[stage]
    mutant = ps.MUTATIONS[mutation](prog, data)
    if mutant is None:
        event(f"mutation {mutation}: not applicable")
        return
    ps.note_program(f"{stage} (original)", prog)
    ps.note_program(f"{stage} + {mutation}", mutant)
    res = amk.validate(mutant)
    if not res.ok:
        ps.record(mutation, "killed")
        return
    # validate accepts it: then it must be harmless in every interleaving
    want = run_vm(prog, case)
    for order, seed in ORDERS:
        try:
            got = run_vm(mutant, case, order=order, seed=seed)
        except AmkError as e:
            ps.record(mutation, "wrong")
            raise AssertionError(f"validate accepted a {mutation} mutant that fails on the VM "
                                 f"({order} order, seed {seed}): {e}") from e
        diff = outputs_differ(got, want, exact=True)
        if diff is not None:
            ps.record(mutation, "wrong")
            raise AssertionError(f"validate accepted a {mutation} mutant that changes the result "
                                 f"({order} order, seed {seed}): {diff}")
    ps.record(mutation, "equivalent")


@given(case=steps, data=st.data(), how=st.sampled_from(["add_wait_cycle", "raise_threshold"]),
       order=st.sampled_from(["program", "random"]))
def test_a_deadlocking_program_raises_deadlock_error_naming_the_stuck_tasks(case, data, how, order):
    ps.note_case(case)
    stages, _ = ps.final_stage(case)
    prog = next(reversed(stages.values()))
    mutant = (ps.add_wait_cycle if how == "add_wait_cycle" else ps.raise_threshold)(prog, data)
    if mutant is None:
        return
    ps.note_program(how, mutant)
    assert not amk.validate(mutant).ok
    with pytest.raises(amk.ValidationError):            # the VM refuses it by default
        ReferenceVM(mutant)
    vm = ReferenceVM(mutant, order=order, seed=7, check=False)
    with pytest.raises(DeadlockError) as info:
        vm.run(bindings(case))
    msg = str(info.value)
    note(msg)
    named = {int(t) for t in re.findall(r"^  task (\d+) ", msg, flags=re.M)}
    ran = set(vm.last_stats.exec_order)
    stuck = set(range(len(mutant.tasks))) - ran
    assert stuck, "a DeadlockError although every task ran"
    shown = min(len(stuck), 16)
    assert named <= stuck and len(named) == shown, \
        f"DeadlockError names tasks {sorted(named)}, the stuck ones are {sorted(stuck)}"
    # the root cause (the mutated task) is named first
    changed = [t.id for t, u in zip(mutant.tasks, prog.tasks) if t != u]
    first = int(re.search(r"^  task (\d+) ", msg, flags=re.M).group(1))
    if how == "raise_threshold":
        assert first in changed, f"the hopeless task {changed} should be named first:\n{msg}"
