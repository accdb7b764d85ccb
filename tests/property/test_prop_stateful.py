"""A state machine over the passes: start from a random decode step's plain lowering, apply the
pipeline's passes in random order with random options. The invariant: the program validates.
The model: the graph interpreted op by op; after every step the VM (program order and a random
order) must reproduce it. A pass that cannot take its input must say so with an AmkError."""
from __future__ import annotations

import torch
from hypothesis import event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

import amk
from amk.errors import AmkError
from amk.passes import pipeline
from amk.passes.lower import lower
from amk.program.text import parse_program, program_to_text
from amk.testing import (interpret_case, outputs_differ, pass_options, run_vm, tolerance,
                         trace_case)

import prop_support as ps
from test_prop_pipeline import steps


def later_passes() -> list[str]:
    return [name for name, _ in pipeline.PIPELINE if name != "lower"]


class PassOrderMachine(RuleBasedStateMachine):
    @initialize(case=steps, opts=pass_options())
    def start(self, case, opts):
        ps.note_case(case, opts)
        self.case = case
        self.graph = trace_case(case)
        self.model = interpret_case(self.graph, case)
        self.tol = tolerance(case.plan.dims.dtype)
        self.program = lower(self.graph, opts)
        self.applied: list[str] = ["lower"]
        self.result = run_vm(self.program, case)
        diff = outputs_differ(self.result, self.model, exact=True)
        assert diff is None, f"lowering differs from the graph: {diff}"

    @precondition(lambda self: hasattr(self, "program") and later_passes())
    @rule(data=st.data(), opts=pass_options())
    def apply_passes(self, data, opts):
        names = data.draw(st.lists(st.sampled_from(later_passes()), min_size=1, max_size=3),
                          label="passes")
        for name in names:
            self.apply(name, opts)

    def apply(self, name, opts):
        fn = dict(pipeline.PIPELINE)[name]
        note(f"apply {name} after {self.applied} with {opts}")
        try:
            out = fn(self.program, opts)
        except AmkError as e:                     # a clear refusal is allowed, a crash is not
            event(f"{name} refused its input: {type(e).__name__}")
            return
        event(f"applied {name}")
        self.applied.append(name)
        ps.note_program(" -> ".join(self.applied), out)
        res = amk.validate(out)
        assert res.ok, f"{name} after {self.applied[:-1]} gives an invalid program:\n{res.report()}"
        got = run_vm(out, self.case)
        diff = outputs_differ(got, self.model, exact=False, tol=self.tol)
        assert diff is None, f"{' -> '.join(self.applied)} changes the result: {diff}"
        if name in ps.EXACT_PASSES and self.case.plan.dims.dtype == torch.float32:
            diff = outputs_differ(got, self.result, exact=True)
            assert diff is None, f"{name} should not change a bit (f32), but: {diff}"
        self.program, self.result = out, got

    @precondition(lambda self: hasattr(self, "program"))
    @rule(seed=st.integers(0, 2 ** 31))
    def any_interleaving_gives_the_same_bits(self, seed):
        diff = outputs_differ(run_vm(self.program, self.case, order="random", seed=seed),
                              self.result, exact=True)
        assert diff is None, f"random order seed {seed} after {self.applied}: {diff}"

    @precondition(lambda self: hasattr(self, "program"))
    @rule()
    def text_round_trips(self):
        assert parse_program(program_to_text(self.program)) == self.program

    @invariant()
    def program_validates(self):
        if hasattr(self, "program"):
            res = amk.validate(self.program)
            assert res.ok, res.report()


PassOrderMachine.TestCase.settings = settings(settings.default,
                                              max_examples=max(5, settings.default.max_examples // 2),
                                              stateful_step_count=8)
test_passes_in_random_order = PassOrderMachine.TestCase
