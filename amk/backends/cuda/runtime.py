"""CudaProgram: a Program compiled into one persistent kernel and run one launch per step.

Binding contract (the reference VM's): ``run(bindings)`` maps each IO_INPUT / WEIGHT / CONST /
KV_CACHE buffer's ``source`` to a tensor; activations are allocated once and reused; the KV
cache is updated in place; the result is the tensors of ``program.outputs`` in order, IO_OUTPUT
cloned. Counters are monotonic across steps and the kernel advances the epoch itself, so a
step is exactly one launch on torch's current stream (``launch()`` is CUDA-graph capturable).
"""
from __future__ import annotations

import operator
import time
from typing import Mapping

import numpy as np
import torch

from amk.errors import BackendUnavailable, DeadlockError, TraceError, ValidationError
from amk.program.ir import BufferKind, InstructionKind, Program
from amk.program.validate import validate as validate_program
from amk.backends.cuda import abi
from amk.backends.cuda.codegen import render_lowered
from amk.backends.cuda.smem import NTHREADS, SMEM_BYTES
from amk.backends.cuda.compile import arch_of, compile_source
from amk.backends.cuda.driver import Kernel
from amk.backends.cuda.fault_mirror import FaultMirror
from amk.backends.cuda.lowered_cache import lower_program_cached
from amk.backends.cuda.options import CudaOptions
from amk.backends.cuda.steps import REF_BUFFER

_BOUND = (BufferKind.WEIGHT, BufferKind.CONST, BufferKind.KV_CACHE)
_OWNED = (BufferKind.ACTIVATION, BufferKind.IO_OUTPUT, BufferKind.IO_INPUT)


def _dev_tensor(a: np.ndarray, device) -> torch.Tensor:
    raw = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
    if raw.size == 0:
        raw = np.zeros(16, dtype=np.uint8)
    return torch.from_numpy(raw.copy()).to(device)


class CudaProgram:
    def __init__(self, program: Program, device=None, *, validate: bool = True,
                 arch: str | None = None, options: CudaOptions = CudaOptions(),
                 sync_each_run: bool = True):
        if not torch.cuda.is_available():
            raise BackendUnavailable("CudaProgram needs a CUDA GPU; use backend='reference'")
        self.program = program
        self.device = torch.device(device if device is not None else "cuda")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if validate:
            res = validate_program(program)
            if not res.ok:
                raise ValidationError("the CUDA backend refuses an invalid program:\n"
                                      + res.report(), res)
        self.options = options
        self.timings: dict[str, float] = {}
        # False: run() launches and returns; a fault shows at the next run() or check()
        # (fault_mirror.py). amk.jit's steps run this way; True keeps run() = launch + check.
        self.sync_each_run = sync_each_run
        sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.nthreads, smem = NTHREADS, SMEM_BYTES
        t0 = time.perf_counter()
        self.lowered = low = lower_program_cached(program, sm_count, options)
        self.source = render_lowered(low, options)
        self.timings["render_s"] = time.perf_counter() - t0
        res = compile_source(self.source, arch or arch_of(self.device), cuda_options=options)
        self.compile_result = res
        self.timings["compile_s"] = res.seconds
        self.timings["cache_hit"] = float(res.cache_hit)
        t0 = time.perf_counter()
        with torch.cuda.device(self.device):
            torch.zeros(1, device=self.device)             # make torch's context current
            self.kernel = Kernel(res.cubin, "amk_megakernel", self.device.index, smem)
        self.timings["load_s"] = time.perf_counter() - t0
        self.grid = len(low.queues)
        occ = self.kernel.occupancy(self.nthreads)
        if occ < 1 or self.grid > occ * self.kernel.sm_count:
            raise BackendUnavailable(
                f"the megakernel needs {self.grid} co-resident CTAs but the GPU holds "
                f"{occ} per SM x {self.kernel.sm_count} SMs; place the program on fewer queues")
        self._alloc()

    # ------------------------------------------------------------------ setup
    def _alloc(self) -> None:
        low, dev, prog = self.lowered, self.device, self.program
        self.buffers: dict[int, torch.Tensor] = {}
        for b in prog.buffers:
            if b.kind in _OWNED:
                self.buffers[b.id] = torch.zeros(b.shape, dtype=b.dtype.torch, device=dev)
        self.scratch = torch.zeros(max(low.scratch_bytes, 16), dtype=torch.uint8, device=dev)
        stride = self.options.counter_stride          # counter i lives at word i * stride
        init = torch.zeros(max(len(prog.counters), 1) * stride, dtype=torch.int64)
        init[::stride][:len(prog.counters)] = torch.tensor([c.init for c in prog.counters],
                                                           dtype=torch.int64)
        self.counter_init = init.to(torch.int32)
        self.counters = self.counter_init.to(dev)
        self.state = torch.zeros(abi.STATE_DTYPE.itemsize // 4, dtype=torch.int32, device=dev)
        self.fault_mirror = FaultMirror(self.state)
        errs = np.full(max(self.grid, 1), -1, dtype=np.int64).astype(np.int32)
        self._errs_init = np.zeros(max(self.grid, 1), dtype=abi.ERR_DTYPE)
        self._errs_init["task"] = errs
        self.errs = _dev_tensor(self._errs_init, dev)
        self.tasks_dev = _dev_tensor(low.tasks, dev)
        self.waits_dev = _dev_tensor(low.waits, dev)
        qt = np.array([t for q in low.queues for t in q] or [0], dtype=np.int32)
        qo = np.cumsum([0] + [len(q) for q in low.queues]).astype(np.int32)
        self.queue_tasks = _dev_tensor(qt, dev)
        self.queue_off = _dev_tensor(qo, dev)
        self.ptrs_dev = torch.zeros(max(len(low.ptr_refs), 1), dtype=torch.int64, device=dev)
        self.ranges_dev = torch.zeros(max(len(low.ranges), 1) * 2, dtype=torch.int64, device=dev)
        n_entries = max(len(qt), 1)
        self.prof = (torch.zeros(n_entries * abi.PROF_WORDS, dtype=torch.int64, device=dev)
                     if "#define AMK_PROFILE" in self.source else None)
        self._bound: dict[int, torch.Tensor] = {}
        self._bound_key: tuple | None = None
        self._poisoned = False
        self._args: bytes | None = None
        self._bind_plan()

    def _addresses(self) -> np.ndarray:
        base = np.zeros(len(self.program.buffers), dtype=np.uint64)
        for bid, t in list(self.buffers.items()) + list(self._bound.items()):
            base[bid] = t.data_ptr()
        return base

    def _upload_tables(self) -> None:
        low = self.lowered
        base = self._addresses()
        sbase = np.uint64(self.scratch.data_ptr())
        refs = low.ptr_refs
        if len(refs):
            ptrs = np.where(refs[:, 0] == REF_BUFFER, base[refs[:, 1].clip(0, len(base) - 1)],
                            sbase + refs[:, 1].astype(np.uint64))
            self.ptrs_dev.copy_(torch.from_numpy(ptrs.astype(np.uint64).view(np.int64)))
        if low.ranges:
            rng = np.zeros(len(low.ranges), dtype=abi.RANGE_DTYPE)
            for i, ((kind, ident), off, n) in enumerate(low.ranges):
                a = base[ident] if kind == REF_BUFFER else sbase + np.uint64(ident)
                rng[i]["addr"], rng[i]["bytes"] = np.uint64(a) + np.uint64(off), n
            self.ranges_dev.copy_(torch.from_numpy(rng.view(np.int64)))
        args = np.zeros(1, dtype=abi.ARGS_DTYPE)
        for name, t in (("tasks", self.tasks_dev), ("waits", self.waits_dev),
                        ("ptrs", self.ptrs_dev), ("ranges", self.ranges_dev),
                        ("queue_tasks", self.queue_tasks), ("queue_off", self.queue_off),
                        ("counters", self.counters), ("state", self.state), ("errs", self.errs)):
            args[0][name] = t.data_ptr()
        args[0]["watchdog_ns"] = int(self.options.watchdog_s * 1e9)
        args[0]["n_queues"] = self.grid
        args[0]["prof"] = self.prof.data_ptr() if self.prof is not None else 0
        self._args = args.tobytes()

    # ------------------------------------------------------------------ binding
    def _bind_plan(self) -> None:
        """Once: the buffers a step binds, and the binding key of each (its source path)."""
        bound = [b for b in self.program.buffers if b.kind in _BOUND]
        self._inputs = [(b, b.source or b.name) for b in self.program.buffers
                        if b.kind == BufferKind.IO_INPUT]
        self._bound_bufs = bound
        self._bound_keys = [b.source or b.name for b in bound]
        self._last_srcs: list | None = None     # the tensors bound last time, as given
        self._last_ptrs: list | None = None
        self._out_refs = [(bid, bid in {b.id for b in bound}, self.program.buffers[bid].kind)
                          for bid in self.program.outputs]

    def _bind(self, bindings: Mapping[str, torch.Tensor]) -> None:
        try:
            srcs = list(map(bindings.__getitem__, self._bound_keys))
        except KeyError:
            srcs = None                         # the full check below names the missing key
        # The same tensors at the same addresses as last time: their checks and the tables hold
        # (identity plus data_ptr, so a tensor re-pointed in place, e.g. `.data = x`, rebinds).
        same = (srcs is not None and self._last_srcs is not None and self._args is not None
                and all(map(operator.is_, srcs, self._last_srcs))
                and list(map(torch.Tensor.data_ptr, srcs)) == self._last_ptrs)
        if not same:
            self._bind_bound(bindings)
        for b, key in self._inputs:
            t = bindings.get(key)
            if t is None:
                raise TraceError(f"buffer {b.name!r} (IO_INPUT) needs a tensor bound to "
                                 f"{key!r}; bindings has {sorted(bindings)[:12]}")
            if t.dtype != b.dtype.torch or t.numel() != b.numel:
                raise TraceError(f"buffer {b.name!r} expects {b.dtype.name}{list(b.shape)}, "
                                 f"got {t.dtype}{list(t.shape)} for {key!r}")
            self.buffers[b.id].copy_(t.reshape(b.shape), non_blocking=True)

    def _bind_bound(self, bindings: Mapping[str, torch.Tensor]) -> None:
        """Check every weight / const / kv binding and upload the tables if an address moved."""
        bound: dict[int, torch.Tensor] = {}
        copied = False
        for b, key in zip(self._bound_bufs, self._bound_keys):
            if key not in bindings:
                raise TraceError(f"buffer {b.name!r} ({b.kind.name}) needs a tensor bound to "
                                 f"{key!r}; bindings has {sorted(bindings)[:12]}")
            t = bindings[key]
            if t.dtype != b.dtype.torch or t.numel() != b.numel:
                raise TraceError(f"buffer {b.name!r} expects {b.dtype.name}{list(b.shape)}, "
                                 f"got {t.dtype}{list(t.shape)} for {key!r}")
            if t.device != self.device or not t.is_contiguous() or t.data_ptr() % 16:
                if b.kind == BufferKind.KV_CACHE:
                    raise TraceError(f"KV cache {key!r} must be a contiguous, 16-byte aligned "
                                     f"tensor on {self.device} (it is updated in place)")
                t = t.to(self.device).contiguous().clone()
                copied = True
            bound[b.id] = t
        key = tuple(sorted((i, t.data_ptr()) for i, t in bound.items()))
        self._bound = bound
        if key != self._bound_key or self._args is None:
            self._upload_tables()
            self._bound_key = key
        # A weight copied to the device is copied again next time (it may have changed)
        srcs = None if copied else [bindings[k] for k in self._bound_keys]
        self._last_srcs = srcs
        self._last_ptrs = None if copied else [t.data_ptr() for t in srcs]

    def bind(self, bindings: Mapping[str, torch.Tensor]) -> None:
        """Check and bind a step's tensors without launching: the inputs are copied into the
        program's own input buffers (input_buffer()), which a captured loop then updates."""
        with torch.cuda.device(self.device):
            self._before_step()
            self._bind(bindings)

    def input_buffer(self, source: str) -> torch.Tensor:
        """The program's own buffer of the IO_INPUT bound to `source` (fixed address)."""
        for b, key in self._inputs:
            if key == source:
                return self.buffers[b.id]
        raise KeyError(f"program {self.program.name!r} has no input bound to {source!r}")

    def output_buffers(self) -> list[torch.Tensor]:
        """The tensors of program.outputs as the kernel writes them, not cloned: the next
        launch overwrites them (for a captured loop that copies what it keeps)."""
        return [self._bound[bid] if is_bound else self.buffers[bid]
                for bid, is_bound, _ in self._out_refs]

    # ------------------------------------------------------------------ running
    def reset(self) -> None:
        """Counters back to their initial values and epoch 0 (after an aborted step)."""
        self.counters.copy_(self.counter_init)
        self.state.zero_()
        self.errs.copy_(torch.from_numpy(self._errs_init.view(np.uint8).copy()))
        self.fault_mirror.clear()
        self._poisoned = False

    def launch(self) -> None:
        """One decode step: one kernel launch on torch's current stream, nothing else (so a
        stream capture records it: torch.cuda.graph makes its capture stream current)."""
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self.kernel.launch(self.grid, self.nthreads, stream, self._args)

    def _before_step(self) -> None:
        if self._poisoned:
            self.reset()
        elif self.fault_mirror.faulted():
            self.check()                 # an earlier asynchronous step faulted: raise it

    def run(self, bindings: Mapping[str, torch.Tensor], check: bool | None = None) -> list[torch.Tensor]:
        """One step. check (default: sync_each_run) synchronises and raises this step's fault;
        without it the step is launched and the call returns at once, an earlier step's fault
        raising here first (seen in the pinned mirror, then reported by check())."""
        check = self.sync_each_run if check is None else check
        with torch.cuda.device(self.device):
            self._before_step()
            self._bind(bindings)
            self.launch()
            if check:
                self.check()
            else:
                self.fault_mirror.after_launch()
            return self._outputs()

    def check(self) -> None:
        """Synchronise and raise the error the kernel recorded, if any."""
        torch.cuda.current_stream(self.device).synchronize()
        st = self.state.cpu().numpy().view(abi.STATE_DTYPE)[0]
        if int(st["fault"]) == 0 and int(st["abort"]) == 0:
            return
        self._poisoned = True
        code, task, value = int(st["fault"]), int(st["fault_task"]), int(st["fault_value"])
        if code == abi.FAULT_COPY:
            raise BackendUnavailable(
                "megakernel fault: a bulk copy into shared memory (a GEMV tile's preload or a "
                "combine's partials) did not land within AMK_WATCHDOG_S; AMK_PRELOAD=0 turns the "
                "preload off (the combine's copies have no switch); report the program")
        if code == abi.FAULT_DEADLOCK or int(st["abort"]):
            raise DeadlockError(self._deadlock_report())
        name = self._task_name(task)
        if code == abi.FAULT_KV_POS:
            raise TraceError(f"{name}: KV_APPEND position {value} is outside the cache; use a "
                             "larger max_seq or stop generating earlier")
        if code == abi.FAULT_EMBED_ID:
            raise TraceError(f"{name}: token id {value} is outside the embedding table")
        raise BackendUnavailable(f"megakernel fault {code} in {name} (value {value})")

    def _prof_rows(self):
        if self.prof is None:
            raise BackendUnavailable("this megakernel was built without AMK_PROFILE=1")
        torch.cuda.current_stream(self.device).synchronize()
        p = self.prof.cpu().numpy().reshape(-1, abi.PROF_WORDS)
        return [(tid, q) for q, tasks in enumerate(self.lowered.queues) for tid in tasks], p

    def profile(self) -> list[tuple[int, int, int, int, int, int, int]]:
        """AMK_PROFILE=1 builds: the last step's (task id, CTA, wait start, wait end, task end,
        SM id, ready) per queue entry, %globaltimer ns; ready: the barrier after the wait passed
        (the task's descriptor copies landed), just before its device function. Synchronises."""
        entries, p = self._prof_rows()
        return [(tid, q, int(p[i, 0]), int(p[i, 1]), int(p[i, 2]), int(p[i, 3]), int(p[i, 4]))
                for i, (tid, q) in enumerate(entries)]

    def _fused_steps(self, tid: int) -> int:
        """How many of task tid's lowered FUSED steps the profile row keeps (0: a plain task)."""
        t = self.lowered.tasks[tid]
        return min(int(t["n_sub"]), abi.PROF_STEPS) if int(t["op"]) == int(InstructionKind.FUSED) else 0

    def profile_steps(self) -> dict[int, list[tuple[int, int]]]:
        """AMK_PROFILE=1 builds: task id -> (opcode, start ns) of each of its lowered FUSED
        steps, at most abi.PROF_STEPS (a step's time is the next start, or the task's end,
        minus its own). Tasks lowered as one instruction are left out. Synchronises."""
        entries, p = self._prof_rows()
        out = {}
        for i, (tid, _) in enumerate(entries):
            n = self._fused_steps(tid)
            if n and p[i, abi.PROF_HEAD]:
                t = self.lowered.tasks[tid]
                subs = self.lowered.tasks[int(t["sub_begin"]):int(t["sub_begin"]) + n]
                out[tid] = [(int(s["op"]), int(p[i, abi.PROF_HEAD + j])) for j, s in enumerate(subs)]
        return out

    def profile_marks(self) -> dict[int, list[tuple[int, int, int]]]:
        """AMK_PROFILE=1 builds: task id -> (step, k, ns) of each AMK_MARK(k) its device
        functions passed (step: the FUSED step, 0 for a plain task; the points are listed where
        each function is, e.g. op_gemv_direct, op_attention_smem), in step then k order.
        Synchronises."""
        entries, p = self._prof_rows()
        out = {}
        for i, (tid, _) in enumerate(entries):
            marks = [(s, k, int(p[i, abi.PROF_MARK0 + s * abi.PROF_MARKS + k]))
                     for s in range(max(1, self._fused_steps(tid))) for k in range(abi.PROF_MARKS)]
            marks = [m for m in marks if m[2]]
            if marks:
                out[tid] = marks
        return out

    def _task_name(self, tid: int) -> str:
        if 0 <= tid < len(self.program.tasks):
            t = self.program.tasks[tid]
            return f"task {tid} ({t.name or t.op.name})"
        return f"task {tid}"

    def _deadlock_report(self) -> str:
        errs = self.errs.cpu().numpy().view(abi.ERR_DTYPE)
        lines = []
        for q, e in enumerate(errs):
            if int(e["task"]) >= 0:
                lines.append(f"  {self._task_name(int(e['task']))} on CTA {q}: counter "
                             f"{int(e['counter'])} = {int(e['value'])}, waits for >= "
                             f"{int(e['target'])}")
        stuck = sorted({int(e["task"]) for e in errs if int(e["task"]) >= 0})
        return (f"megakernel made no progress for {self.options.watchdog_s:g} s (AMK_WATCHDOG_S); "
                f"stuck tasks {stuck}:\n" + "\n".join(lines)
                + "\nThe schedule waits on counters that never reach their thresholds: check "
                  "the program with amk.validate. The program's state was reset for the next run.")

    def _outputs(self) -> list[torch.Tensor]:
        return [self._bound[bid] if is_bound else self.buffers[bid]
                if kind == BufferKind.IO_INPUT else self.buffers[bid].clone()
                for bid, is_bound, kind in self._out_refs]
