"""Hand-built cases run on the CUDA megakernel and on the reference semantics, for the GPU tests
that compare them: every case's task in one program (one compile), outputs poisoned with NaN on
both sides first, so a tile that writes too little or too much shows."""
from __future__ import annotations

import torch

from amk.program.ir import BufferKind, Program
from amk.testing.cuda_examples import Case, combined_program


def run_cases(cases: list[Case], seed: int) -> tuple[Program, dict, dict]:
    """(program, reference outputs by buffer id, CUDA outputs by buffer id) for fresh inputs
    drawn with `seed`."""
    from amk.backends.cuda.runtime import CudaProgram
    from amk.backends.reference.semantics import RefCtx, semantics_for
    prog = combined_program(cases)
    cp = CudaProgram(prog, "cuda", validate=False)
    binds = {f"{c.name}.{k}": v for c in cases for k, v in c.bindings(seed=seed).items()}
    ref = {}
    for b in prog.buffers:
        if b.kind == BufferKind.IO_OUTPUT:
            cp.buffers[b.id].fill_(float("nan"))
            ref[b.id] = torch.full(b.shape, float("nan"), dtype=b.dtype.torch)
        else:
            ref[b.id] = binds[b.source]
    for t in prog.tasks:
        semantics_for(t.op)([ref[i] for i in t.inputs], [ref[o] for o in t.outputs], t.params, RefCtx())
    cp.run({k: v.cuda() for k, v in binds.items()})
    got = {b.id: cp._bound.get(b.id, cp.buffers.get(b.id)).clone() for b in prog.buffers}
    return prog, ref, got
