"""Schedule mutation testing of `validate`: a mutated schedule (a dropped wait, a lowered
threshold, a duplicated writer, two aliased buffers, a wait cycle, a tile bound off by one, two
queue entries swapped) must be rejected, or else be what validate claims it is: run on the VM in
several random orders (and its per-SM queues) it gives the same bits every time. A mutant that
only changes synchronisation (ps.SCHEDULE_ONLY) must moreover give the original's bits; one that
changes data flow (aliasing, a duplicated writer, a moved tile bound) may compute something else
without any race, which structure alone cannot tell from intent: counted as "dataflow", not as a
kill. The kill rate is printed at the end of the session (conftest.py)."""
from __future__ import annotations

import re

import pytest
from hypothesis import event, given, note, settings
from hypothesis import strategies as st

import amk
from amk.backends.reference.vm import ReferenceVM
from amk.errors import AmkError, DeadlockError
from amk.testing import bindings, outputs_differ, pass_options, run_vm

import prop_support as ps
from test_prop_pipeline import steps

ORDERS = (("program", 0), ("random", 1), ("random", 2), ("random", 3))


# cheap per example, and every mutation kind should show up in the tally: 6x the profile's count
@settings(settings.default, max_examples=6 * settings.default.max_examples)
@given(case=steps, opts=pass_options(), mutation=st.sampled_from(sorted(ps.MUTATIONS)),
       data=st.data())
def test_validate_rejects_harmful_schedule_mutations(case, opts, mutation, data):
    ps.note_case(case, opts)
    stages, _ = ps.final_stage(case, opts)
    # queues exist only after `place` (the last pass); other mutations take any stage
    stage = (next(reversed(stages)) if mutation == "swap_in_queue"
             else data.draw(st.sampled_from(list(stages)), label="stage"))
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
    # validate accepts it, so it claims: every legal interleaving computes the same bits.
    want = run_vm(prog, case)
    runs = []
    for order, seed in ORDERS + ((("queues", 0),) if mutant.queues else ()):
        try:
            runs.append((order, seed, run_vm(mutant, case, order=order, seed=seed)))
        except AmkError as e:
            ps.record(mutation, "wrong")
            raise AssertionError(f"validate accepted a {mutation} mutant that fails on the VM "
                                 f"({order} order, seed {seed}): {e}") from e
    base = runs[0][2]
    for order, seed, got in runs[1:]:
        diff = outputs_differ(got, base, exact=True)
        if diff is not None:
            ps.record(mutation, "wrong")
            raise AssertionError(f"validate accepted a {mutation} mutant whose result depends on "
                                 f"the interleaving ({order} order, seed {seed}): {diff}")
    diff = outputs_differ(base, want, exact=True)
    if diff is None:
        ps.record(mutation, "equivalent")
    elif mutation in ps.SCHEDULE_ONLY:
        # same tasks, same program order: an accepted schedule change cannot change a bit
        ps.record(mutation, "wrong")
        raise AssertionError(f"validate accepted a {mutation} mutant that changes the result: {diff}")
    else:
        # race-free, deterministic, but it computes something else (a reader now sees another
        # version of a buffer): a change of meaning, which no structural proof can tell from intent
        ps.record(mutation, "dataflow")


@given(case=steps, opts=pass_options(), data=st.data(),
       how=st.sampled_from(["add_wait_cycle", "raise_threshold"]),
       order=st.sampled_from(["program", "random", "queues"]))
def test_a_deadlocking_program_raises_deadlock_error_naming_the_stuck_tasks(case, opts, data, how,
                                                                             order):
    ps.note_case(case, opts)
    stages, _ = ps.final_stage(case, opts)
    prog = next(reversed(stages.values()))
    mutant = (ps.add_wait_cycle if how == "add_wait_cycle" else ps.raise_threshold)(prog, data)
    if mutant is None:
        return
    ps.note_program(how, mutant)
    assert not amk.validate(mutant).ok
    with pytest.raises(amk.ValidationError):            # the VM refuses it by default
        ReferenceVM(mutant)
    if order == "queues" and not mutant.queues:
        order = "random"
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
