"""The CUDA backend on random decode steps, without a GPU: `amk.jit(fn, backend="cuda")` lowers
each step with the cuda backend's own pass options (an H200's shape here), folds and packs it,
and the kernel it renders compiles with NVRTC for sm_90a; a step the backend cannot run is a
CompileError that names the task, never another exception. tests/gpu/test_property_cuda.py runs
the same strategy on a GPU against the reference VM; this is the part any CI can check.
NVRTC takes ~2 s an example, so every profile draws at most 12."""
from __future__ import annotations

import pytest
from hypothesis import given, note, settings

import amk
from amk.errors import CompileError
from amk.program.text import program_to_text
from amk.testing import BLOCKS, decode_steps

pytest.importorskip("cuda.bindings")

from amk.backends.cuda import compile_source  # noqa: E402
from amk.backends.cuda.codegen import render_lowered  # noqa: E402
from amk.backends.cuda.lower import lower_program  # noqa: E402


@settings(max_examples=min(settings.default.max_examples, 12))
@given(case=decode_steps(donate=True, kinds=BLOCKS))
def test_random_steps_lower_and_compile_for_sm90a_or_name_what_they_cannot_run(case):
    note(f"decode step:\n{case.describe()}")
    step = amk.jit(case.fn, donate=case.donate, backend="cuda")
    try:
        low = step.lower(*case.args)
        note(f"program:\n{program_to_text(low.program)}")
        lowered = lower_program(low.program)
    except CompileError as e:
        assert "task " in str(e) or "program" in str(e), f"a CompileError that names nothing: {e}"
        return
    queued = sorted(j for q in lowered.queues for j in q)
    assert queued == list(range(len(low.program.tasks))), "a task in no queue, or in two"
    res = compile_source(render_lowered(lowered), "sm_90a")     # these tables: no second lowering
    assert res.cubin, "NVRTC gave no cubin"
