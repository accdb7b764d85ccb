"""The multi-kernel Triton backend: one micro-kernel launch per task, in program order.

The baseline the megakernel must beat, and a second, independent implementation of every
opcode. Program order is a legal sequential execution (validated), and launches on one stream
run in order, so the counters are not needed here.

Binding contract (the same as the reference VM's): ``bindings`` maps the ``source`` of every
IO_INPUT, WEIGHT, CONST and KV_CACHE buffer to a tensor of the buffer's shape and dtype.
Activations and outputs are allocated once and reused; KV caches are updated in place; ``run``
returns ``program.outputs`` in order, IO_OUTPUTs cloned, a KV cache as the bound tensor itself.
IO_INPUTs (token ids, the decode position) are copied into tensors this object owns, so a
captured CUDA graph reads them from fixed addresses: with ``capture_graph=True`` the first run
executes eagerly (compiling every kernel), then captures the whole step; later runs copy the
inputs in and replay it. Kernels read the position on the device, so the graph serves every
decode step. Rebinding a weight or cache to a different tensor captures once more: the last
`MAX_GRAPHS` captures are kept by their bound addresses, so steps alternating between a few
caches (a new generate call's cache, batch slots) replay instead of re-capturing each call.
"""
from __future__ import annotations

import os
from typing import Mapping

import torch

from amk.backends import resolve_device
from amk.errors import BackendUnavailable, TraceError, ValidationError
from amk.program.ir import BufferKind, Program

BOUND_KINDS = (BufferKind.WEIGHT, BufferKind.CONST, BufferKind.KV_CACHE)
MAX_GRAPHS = 4          # captured graphs kept per program (each a few hundred kernel nodes)


def _device(device) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = resolve_device(device, "TritonProgram", "use the reference backend")
    if dev.type != "cuda" and os.environ.get("TRITON_INTERPRET", "") != "1":
        raise BackendUnavailable(f"TritonProgram(device={device!r}) runs on the CPU only under "
                                 f"the Triton interpreter: set TRITON_INTERPRET=1 before importing "
                                 f"triton, or use a CUDA device")
    return dev


class TritonProgram:
    """Run ``program`` on ``device`` one Triton launch per task."""

    def __init__(self, program: Program, device=None, capture_graph: bool = False,
                 check: bool = True):
        try:
            import triton  # noqa: F401
        except ImportError as e:
            raise BackendUnavailable(f"the triton backend needs the triton package ({e}); "
                                     f"pip install 'amk[triton]'") from None
        if check:
            from amk.program.validate import validate     # lazy: keeps import order simple
            result = validate(program)
            if not result.ok:
                raise ValidationError("TritonProgram refuses an invalid program:\n"
                                      + result.report(), result)
        self.program = program
        self.device = _device(device)
        if capture_graph and self.device.type != "cuda":
            raise BackendUnavailable("capture_graph=True needs a CUDA device")
        self.capture_graph = capture_graph
        from amk.backends.triton.launch import launch
        self._launch = launch
        # Backend-owned tensors: activations, outputs and the IO_INPUT copies, allocated once.
        self._slots: list[torch.Tensor | None] = [None] * len(program.buffers)
        for b in program.buffers:
            if b.kind in (BufferKind.ACTIVATION, BufferKind.IO_OUTPUT, BufferKind.IO_INPUT):
                self._slots[b.id] = torch.zeros(b.shape, dtype=b.dtype.torch, device=self.device)
        self._inputs = [b for b in program.buffers if b.kind == BufferKind.IO_INPUT]
        self._bound = [b for b in program.buffers if b.kind in BOUND_KINDS]
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}   # bound addresses -> capture
        self._graph: torch.cuda.CUDAGraph | None = None        # the last one run
        self.captures = 0

    # ------------------------------------------------------------------ bindings
    def _bind(self, bindings: Mapping[str, torch.Tensor]) -> tuple:
        errors = []
        device = self.device

        def check(b, t, need_device: bool) -> bool:
            # the passing case first and without formatting: every call binds ~10 tensors a layer
            if (isinstance(t, torch.Tensor) and t.shape == tuple(b.shape)
                    and t.dtype == b.dtype.torch
                    and (not need_device or (t.device == device and t.is_contiguous()))):
                return True
            errors.append(self._binding_error(b, t, need_device))
            return False

        sources = [(b, bindings.get(b.source)) for b in self._inputs]
        for b, t in sources:
            check(b, t, need_device=False)
        for b in self._bound:
            t = bindings.get(b.source)
            if check(b, t, need_device=True):
                self._slots[b.id] = t
        if errors:
            raise TraceError("TritonProgram.run: bad bindings:\n  " + "\n  ".join(errors))
        for b, t in sources:                         # token ids / position: into our tensors
            self._slots[b.id].copy_(t, non_blocking=True)
        return tuple(self._slots[b.id].data_ptr() for b in self._bound)

    def _binding_error(self, b, t, need_device: bool) -> str:
        where = f"buffer {b.id} {b.name!r} ({b.kind.name}, source {b.source!r})"
        want = f"shape {tuple(b.shape)} dtype {b.dtype.torch}"
        if t is None:
            return f"{where}: no binding; pass a tensor of {want} under {b.source!r}"
        if not isinstance(t, torch.Tensor):
            return f"{where}: bound to a {type(t).__name__}, expected a tensor of {want}"
        if tuple(t.shape) != tuple(b.shape) or t.dtype != b.dtype.torch:
            return f"{where}: expected {want}, got shape {tuple(t.shape)} dtype {t.dtype}"
        if need_device and t.device != self.device:
            return (f"{where}: tensor is on {t.device} but the program runs on {self.device}; "
                    f"move it first (bound tensors are never copied)")
        return f"{where}: tensor is not contiguous; pass t.contiguous()"

    # ------------------------------------------------------------------ execution
    def _run_tasks(self) -> None:
        slots, launch = self._slots, self._launch
        for task in self.program.tasks:
            try:
                launch(task, slots)
            except Exception as e:
                e.add_note(f"while launching task {task.id} {task.name!r} ({task.op.name}) of "
                           f"program {self.program.name!r} on the triton backend")
                raise

    def run(self, bindings: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Run one decode step; returns ``program.outputs`` (see the module docstring)."""
        key = self._bind(bindings)
        if not self.capture_graph:
            self._run_tasks()
        elif key in self._graphs:
            self._graph = self._graphs[key]
            self._graph.replay()
        else:
            # eagerly first: the step itself, and every kernel compiled (a new address can be a
            # new specialization) before the capture, which must not compile
            self._run_tasks()
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._run_tasks()
            if len(self._graphs) >= MAX_GRAPHS:      # drop the oldest capture
                self._graphs.pop(next(iter(self._graphs)))
            self._graphs[key] = self._graph = graph
            self.captures += 1
        out = self._outputs()
        # Bound tensors are the caller's: holding them would keep a finished generate call's
        # cache alive, so the next call's cache could never reuse its addresses (and graph).
        for b in self._bound:
            self._slots[b.id] = None
        return out

    def replay(self) -> None:
        """Replay the captured step as is (same inputs): for benchmarks."""
        if self._graph is None:
            raise BackendUnavailable("TritonProgram.replay: nothing captured yet; call run() "
                                     "with capture_graph=True first")
        self._graph.replay()

    def _outputs(self) -> list[torch.Tensor]:
        out = []
        for bid in self.program.outputs:
            t = self._slots[bid]
            out.append(t if self.program.buffers[bid].kind == BufferKind.KV_CACHE else t.clone())
        return out
