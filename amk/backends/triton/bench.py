"""Timing of the multi-kernel Triton baseline (for bench/decode.py): one decode step captured
in a CUDA graph and replayed, timed with CUDA events. Replaying the same step is idempotent
(the KV append rewrites the same row with the same values), so repeats measure one step."""
from __future__ import annotations

from typing import Mapping

import torch

from amk.program.ir import Program


def bench_triton(program: Program, bindings: Mapping[str, torch.Tensor], warmup: int = 10,
                 iters: int = 100) -> float:
    """Milliseconds per decode step of ``program`` on the triton backend (CUDA graph replay)."""
    from amk.backends.triton.backend import TritonProgram
    prog = TritonProgram(program, device="cuda", capture_graph=True)
    prog.run(bindings)                  # eager step (compiles every kernel), then capture
    for _ in range(warmup):
        prog.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        prog.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters
