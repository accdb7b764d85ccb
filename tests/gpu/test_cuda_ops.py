"""Every CUDA instruction against the reference semantics, on fresh random inputs, with the
outputs poisoned with NaN first (so an unwritten element or a write outside the tile shows).
All cases run as one program: one NVRTC compile, independent tasks spread over the SMs."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cuda.bindings")

from amk.program.ir import BufferKind
from amk.testing import cuda_examples as examples
from amk.backends.cuda.runtime import CudaProgram
from amk.backends.reference.semantics import RefCtx, semantics_for

CASES = examples.cases()
TOL = {torch.float32: (2e-4, 2e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


@pytest.fixture(scope="module")
def runs():
    """Every case in one megakernel."""
    prog = examples.combined_program(CASES)
    cp = CudaProgram(prog, "cuda", validate=False)
    results = []
    for seed in (1, 2):                                    # two draws of fresh inputs
        binds = {}
        for c in CASES:
            for k, v in c.bindings(seed=seed).items():
                binds[f"{c.name}.{k}"] = v
        gpu_binds = {k: v.cuda() for k, v in binds.items()}
        ref = {}
        for b in prog.buffers:
            if b.kind in (BufferKind.IO_OUTPUT, BufferKind.ACTIVATION):
                if b.dtype.torch.is_floating_point:
                    cp.buffers[b.id].fill_(float("nan"))
                    ref[b.id] = torch.full(b.shape, float("nan"), dtype=b.dtype.torch)
                else:
                    cp.buffers[b.id].fill_(-7)
                    ref[b.id] = torch.full(b.shape, -7, dtype=b.dtype.torch)
            elif b.kind == BufferKind.KV_CACHE:
                ref[b.id] = binds[b.source].clone()
            else:
                ref[b.id] = binds[b.source]
        for t in prog.tasks:                               # oracle: program order, on the CPU
            semantics_for(t.op)([ref[i] for i in t.inputs], [ref[o] for o in t.outputs],
                                t.params, RefCtx())
        cp.run(gpu_binds)
        got = {b.id: cp._bound.get(b.id, cp.buffers.get(b.id)).clone()       # next run reuses buffers
               for b in prog.buffers}
        results.append((prog, ref, got))
    return results


@pytest.mark.parametrize("case", [c.name for c in CASES])
def test_instruction_matches_reference(runs, case):
    for prog, ref, got in runs:
        for t in prog.tasks:
            if t.name != case:
                continue
            for o in t.outputs:
                exp = ref[o]
                out = got[o].cpu()
                if not exp.dtype.is_floating_point:
                    assert torch.equal(out, exp), (case, out, exp)
                    continue
                rtol, atol = TOL[exp.dtype]
                torch.testing.assert_close(out.float(), exp.float(), rtol=rtol, atol=atol,
                                           equal_nan=True, msg=lambda m: f"{case}: {m}")
