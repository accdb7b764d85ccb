"""The megakernel's fault word, mirrored into pinned host memory so a step needs no host sync.

After every launch a stream-ordered copy brings the kernel state (epoch, abort, fault, its task
and value; 32 bytes) into a pinned host buffer. The next call reads that buffer as plain host
memory: no synchronisation, no wait. A fault is sticky in the device state until the program is
reset, so a fault of step k shows in the mirror of every later step: it is raised at the first
call (or sync) after the copy landed, never lost. The mirror only says *that* something went
wrong; CudaProgram.check() then synchronises and reads the device state for the full report
(task name, values, the stuck tasks of a deadlock). The watchdog inside the kernel still turns
a stuck schedule into a fault, so a step can never hang the process.
"""
from __future__ import annotations

import torch

from amk.backends.cuda import abi


class FaultMirror:
    def __init__(self, state: torch.Tensor):
        self.state = state
        self.host = torch.zeros(state.shape, dtype=state.dtype, pin_memory=True)
        # the fault and abort words, read through one numpy view (no per-call conversions)
        self._words = self.host.numpy()
        f = abi.STATE_DTYPE.fields
        self._fault, self._abort = f["fault"][1] // 4, f["abort"][1] // 4

    def after_launch(self) -> None:
        """Enqueue the copy on the current stream, behind the launch (CUDA-graph capturable)."""
        self.host.copy_(self.state, non_blocking=True)

    def faulted(self) -> bool:
        """Whether a mirrored state shows a fault or an abort (reads host memory only)."""
        w = self._words
        return bool(w[self._fault]) or bool(w[self._abort])

    def clear(self) -> None:
        self.host.zero_()

