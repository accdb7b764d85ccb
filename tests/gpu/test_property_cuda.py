"""CUDA conformance on random decode steps: the strategies of tests/property drive
`amk.jit(fn, backend="cuda")` on CUDA tensors, and the reference VM runs the very program the CUDA
backend compiled (same stages, same options) on the CPU as the oracle. 20 examples, derandomized;
a failure prints the decode step, the program text and the @reproduce_failure blob."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings

import amk
from amk import pytree
from amk.program.text import program_to_text
from amk.testing import BLOCKS, decode_steps, outputs_differ, run_vm, tolerance

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if not hasattr(pytest.importorskip("amk.backends.cuda"), "CudaProgram"):
    pytest.skip("amk.backends.cuda has no CudaProgram yet", allow_module_level=True)

KINDS = BLOCKS


def flat_outputs(result) -> list[torch.Tensor]:
    leaves, _, _ = pytree.flatten(result, "output")
    return [t.detach().cpu().reshape(-1) for t in leaves]


@settings(max_examples=20, deadline=None, derandomize=True, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=decode_steps(donate=True, kinds=KINDS))
def test_random_programs_on_cuda_match_the_reference_vm(case):
    check_against_vm(case)


def check_against_vm(case):
    note(f"decode step:\n{case.describe()}")
    step = amk.jit(case.fn, donate=case.donate, backend="cuda")
    gpu = case.to("cuda")
    low = step.lower(*gpu.args)
    note(f"program:\n{program_to_text(low.program)}")
    assert amk.validate(low.program).ok
    got = flat_outputs(step(*gpu.args))
    torch.cuda.synchronize()
    want = run_vm(low.program, case)          # the same program, on the CPU reference VM
    diff = outputs_differ(got, want, exact=False, tol=tolerance(case.plan.dims.dtype))
    assert diff is None, f"CUDA backend vs reference VM: {diff}"
    # a second step on fresh inputs reuses the compiled kernel and still agrees
    gpu2 = case.to("cuda")
    diff = outputs_differ(flat_outputs(step(*gpu2.args)), want, exact=False,
                          tol=tolerance(case.plan.dims.dtype))
    assert diff is None, f"second run of the compiled step: {diff}"
