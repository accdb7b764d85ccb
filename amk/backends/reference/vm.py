"""The counter-driven reference VM: runs a Program with real numerics, the project's oracle.

It implements the same execution contract as the CUDA megakernel: a task fires only when every
wait ``counter >= threshold + per_step * (epoch - 1)`` holds, where per_step is the number of
tasks that increment that counter (epoch = 1 on this VM's first run, 2 on its second, ...); when
it finishes it adds 1 to its out-counter. Counters are never reset, so one program
serves every decode step. Scheduling is a ready queue fed by per-counter waiting lists, so a run
costs O(tasks + waits) bookkeeping, and a stuck schedule is reported the moment nothing is
ready, with the stuck tasks and the counter values they wait on.

Orders: ``"program"`` (lowest ready task id first), ``"random"`` (a seeded random ready task: any
legal interleaving, reproducible) and ``"queues"`` (program.queues: one worker per per-SM list,
round robin, each worker runs its next task only when it is ready, like the persistent kernel).
"""
from __future__ import annotations

import heapq
import random
import time
from dataclasses import dataclass, field
from typing import Mapping

import torch

from amk.backends import resolve_device
from amk.errors import DeadlockError, TraceError, ValidationError
from amk.program.ir import BufferKind, InstructionKind, Program

from amk.backends.reference.semantics import RefCtx, semantics_for
from amk.backends.reference.semantics_common import flush_subnormals
from amk.backends.reference.semantics_fused import check_recipe

ORDERS = ("program", "random", "queues")
DEFAULT_TIMEOUT_S = 600.0        # one run's wall-clock limit (amk.knobs.vm_timeout_s's default)
BOUND_KINDS = (BufferKind.IO_INPUT, BufferKind.WEIGHT, BufferKind.CONST, BufferKind.KV_CACHE)
MAX_STUCK_SHOWN = 16
_TIME_CHECK_EVERY = 256          # tasks between wall-clock checks (perf_counter is not free)


@dataclass
class RunStats:
    """What the last ``run`` did: the task ids in execution order and its wall time."""
    epoch: int
    order: str
    n_tasks: int
    exec_order: list[int] = field(default_factory=list)
    wall_s: float = 0.0


class ReferenceVM:
    """Execute ``program`` on ``device`` with counter-driven scheduling and real numerics."""

    def __init__(self, program: Program, device="cpu", order: str = "program", seed: int = 0,
                 check: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S):
        """timeout_s: the wall-clock limit of one run (AMK_VM_TIMEOUT_S, read by the caller);
        past it the run is a DeadlockError naming the stuck tasks."""
        if order not in ORDERS:
            raise ValueError(f"ReferenceVM order={order!r}; choose one of {ORDERS}")
        if check:
            from amk.program.validate import validate   # lazy: written alongside this module
            result = validate(program)
            if not result.ok:
                raise ValidationError("ReferenceVM refuses an invalid program:\n" + result.report(),
                                      result)
        self.program = program
        self.device = resolve_device(device, "ReferenceVM", "use device='cpu'")
        self.order = order
        self.timeout_s = timeout_s
        self._rng = random.Random(seed)
        self.ctx = RefCtx()
        self.epoch = 0                      # completed runs
        self.last_stats: RunStats | None = None
        self._prepare()

    # ------------------------------------------------------------------ structure (once)
    def _prepare(self) -> None:
        prog = self.program
        problems: list[str] = []
        for i, b in enumerate(prog.buffers):
            if b.id != i:
                problems.append(f"buffer {b.name!r} has id {b.id} at position {i} (ids must be 0..n-1)")
        cidx = {c.id: i for i, c in enumerate(prog.counters)}
        self._counter_ids = [c.id for c in prog.counters]
        self._values = [c.init for c in prog.counters]          # persists across runs
        n_buf = len(prog.buffers)
        self._fn, self._waits, self._out = [], [], []
        per_step = [0] * len(prog.counters)        # increments of each counter in one step
        for t in prog.tasks:
            if t.out_counter in cidx:
                per_step[cidx[t.out_counter]] += 1
        for i, t in enumerate(prog.tasks):
            where = f"task {t.id} {t.name!r} ({InstructionKind(t.op).name})"
            if t.id != i:
                problems.append(f"{where} sits at position {i} (task ids must be 0..n-1)")
            for b in (*t.inputs, *t.outputs):
                if not 0 <= b < n_buf:
                    problems.append(f"{where} uses buffer {b}, which does not exist")
            for w in t.waits:
                if w.counter not in cidx:
                    problems.append(f"{where} waits on counter {w.counter}, which does not exist")
            if t.out_counter not in cidx:
                problems.append(f"{where} increments counter {t.out_counter}, which does not exist")
            if t.op == InstructionKind.FUSED:
                try:
                    check_recipe(t.params.get("recipe"), len(t.inputs), len(t.outputs), self.ctx)
                except ValidationError as e:
                    problems.append(f"{where}: {e}")
            self._fn.append(semantics_for(t.op))
            self._waits.append(tuple((cidx.get(w.counter, 0), int(w.threshold),
                                      per_step[cidx.get(w.counter, 0)]) for w in t.waits))
            self._out.append(cidx.get(t.out_counter, 0))
        if self.order == "queues":
            problems += self._queue_problems()
        if problems:
            raise ValidationError("ReferenceVM cannot run this program:\n  " + "\n  ".join(problems))
        # Backend-owned buffers, allocated once and reused by every run.
        self._slots: list[torch.Tensor | None] = [None] * n_buf
        for b in prog.buffers:
            if b.kind in (BufferKind.ACTIVATION, BufferKind.IO_OUTPUT):
                self._slots[b.id] = torch.zeros(b.shape, dtype=b.dtype.torch, device=self.device)
        self._bound = [b for b in prog.buffers if b.kind in BOUND_KINDS]
        self._args: tuple[list[list], list[list]] | None = None     # built on the first run

    def _queue_problems(self) -> list[str]:
        seen: dict[int, int] = {}
        problems = []
        if not self.program.queues:
            return ["order='queues' needs program.queues (run the `place` pass first)"]
        for q, queue in enumerate(self.program.queues):
            for t in queue:
                if not 0 <= t < len(self.program.tasks):
                    problems.append(f"queue {q} lists task {t}, which does not exist")
                elif t in seen:
                    problems.append(f"task {t} is in queue {seen[t]} and queue {q}")
                seen.setdefault(t, q)
        missing = [t for t in range(len(self.program.tasks)) if t not in seen]
        if missing:
            problems.append(f"tasks {missing[:MAX_STUCK_SHOWN]} are in no queue")
        return problems

    @property
    def counters(self) -> dict[int, int]:
        """Current counter values by counter id (monotonic across runs)."""
        return dict(zip(self._counter_ids, self._values))

    # ------------------------------------------------------------------ one step
    def _bind(self, bindings: Mapping[str, torch.Tensor]) -> None:
        errors = []
        for b in self._bound:
            where = f"buffer {b.id} {b.name!r} ({b.kind.name}, source {b.source!r})"
            want = f"shape {tuple(b.shape)} dtype {b.dtype.torch}"
            t = bindings.get(b.source)
            if t is None:
                errors.append(f"{where}: no binding; pass a tensor of {want} under {b.source!r}")
            elif not isinstance(t, torch.Tensor):
                errors.append(f"{where}: bound to a {type(t).__name__}, expected a tensor of {want}")
            elif tuple(t.shape) != tuple(b.shape) or t.dtype != b.dtype.torch:
                errors.append(f"{where}: expected {want}, got shape {tuple(t.shape)} dtype {t.dtype}")
            elif t.device != self.device:
                errors.append(f"{where}: tensor is on {t.device} but the VM runs on {self.device}; "
                              f"move it first (the VM never copies bound tensors)")
            elif not t.is_contiguous():
                errors.append(f"{where}: tensor is not contiguous; pass t.contiguous()")
            else:
                self._slots[b.id] = t
        if errors:
            raise TraceError("ReferenceVM.run: bad bindings:\n  " + "\n  ".join(errors))
        # Read runtime scalars (the decode position) once, not once per task that reads them.
        self.ctx.host_ints = {
            self._slots[b.id].data_ptr(): int(self._slots[b.id].reshape(-1)[0])
            for b in self._bound
            if b.kind == BufferKind.IO_INPUT and b.numel == 1
            and not b.dtype.torch.is_floating_point and b.dtype.torch != torch.bool}

    def run(self, bindings: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Run one step. Returns ``program.outputs`` in order: IO_OUTPUTs as clones, a KV cache
        as the bound tensor itself (updated in place)."""
        epoch = self.epoch + 1
        self._bind(bindings)
        saved = list(self._values)
        stats = RunStats(epoch=epoch, order=self.order, n_tasks=len(self._fn))
        self.last_stats = stats
        t0 = time.perf_counter()
        try:
            with flush_subnormals():
                self._schedule(epoch, stats.exec_order, t0)
        except BaseException:
            # Put the counters back as they were before this step, so the failed step can be
            # run again (e.g. with a valid token) and the VM stays usable.
            self._values[:] = saved
            raise
        finally:
            stats.wall_s = time.perf_counter() - t0
        self.epoch = epoch
        out = []
        for bid in self.program.outputs:
            t = self._slots[bid]
            out.append(t if self.program.buffers[bid].kind == BufferKind.KV_CACHE else t.clone())
        return out

    def _task_args(self) -> tuple[list[list], list[list]]:
        """Per-task input/output tensor lists, built once; later runs patch only the entries
        of bound buffers whose tensor object changed (new token/pos tensors each step)."""
        slots = self._slots
        if self._args is None:
            tasks = self.program.tasks
            self._args = ([[slots[b] for b in t.inputs] for t in tasks],
                          [[slots[b] for b in t.outputs] for t in tasks])
            self._params = [t.params for t in tasks]
            self._uses = {b.id: [] for b in self._bound}
            for t in tasks:
                for side, bids in ((0, t.inputs), (1, t.outputs)):
                    for i, b in enumerate(bids):
                        if b in self._uses:
                            self._uses[b].append((side, t.id, i))
        else:
            for b, uses in self._uses.items():
                tensor = slots[b]
                if uses and self._args[uses[0][0]][uses[0][1]][uses[0][2]] is not tensor:
                    for side, t, i in uses:
                        self._args[side][t][i] = tensor
        return self._args

    # ------------------------------------------------------------------ scheduling
    def _over_time(self) -> str:
        return f"wall-clock limit of {self.timeout_s:g} s exceeded (AMK_VM_TIMEOUT_S)"

    def _schedule(self, epoch: int, exec_order: list[int], t0: float) -> None:
        tasks, fns, outc, vals = self.program.tasks, self._fn, self._out, self._values
        n = len(tasks)
        ins, outs = self._task_args()
        params = self._params
        ctx = self.ctx
        deadline = t0 + self.timeout_s

        # unmet[t]: waits of t not yet satisfied; waiting[(c, v)]: tasks that need counter c == v.
        unmet = [0] * n
        waiting: dict[tuple[int, int], list[int]] = {}
        for t in range(n):
            for c, thr, step in self._waits[t]:
                need = thr + step * (epoch - 1)
                if vals[c] < need:
                    unmet[t] += 1
                    waiting.setdefault((c, need), []).append(t)

        ready: list[int] = [t for t in range(n) if unmet[t] == 0]
        rng = self._rng
        if self.order == "program":
            heapq.heapify(ready)
            pop, push = (lambda: heapq.heappop(ready)), (lambda t: heapq.heappush(ready, t))
        elif self.order == "random":
            def pop():
                i = rng.randrange(len(ready))
                ready[i], ready[-1] = ready[-1], ready[i]
                return ready.pop()
            push = ready.append
        else:
            ready.clear()                  # workers consult unmet[] directly
            pop, push = None, (lambda t: None)

        done = [False] * n
        current = -1

        def execute(t: int) -> None:
            fns[t](ins[t], outs[t], params[t], ctx)
            done[t] = True
            exec_order.append(t)
            c = outc[t]
            vals[c] += 1
            for u in waiting.pop((c, vals[c]), ()):
                unmet[u] -= 1
                if unmet[u] == 0:
                    push(u)

        try:
            if self.order == "queues":
                heads = [0] * len(self.program.queues)
                queues = self.program.queues
                while len(exec_order) < n:
                    progressed = False
                    for q, queue in enumerate(queues):          # one round: each worker once
                        if heads[q] < len(queue) and unmet[queue[heads[q]]] == 0:
                            current = queue[heads[q]]
                            execute(current)
                            heads[q] += 1
                            progressed = True
                    if not progressed:
                        raise self._deadlock("no worker can advance", epoch, done, unmet, heads)
                    if time.perf_counter() > deadline:
                        raise self._deadlock(self._over_time(), epoch,
                                             done, unmet, heads)
            else:
                while ready:
                    current = pop()
                    execute(current)
                    if len(exec_order) % _TIME_CHECK_EVERY == 0 and time.perf_counter() > deadline:
                        raise self._deadlock(self._over_time(), epoch,
                                             done, unmet)
                if len(exec_order) < n:
                    raise self._deadlock("no task is ready", epoch, done, unmet)
        except DeadlockError:
            raise
        except Exception as e:
            if current >= 0 and not done[current]:
                t = tasks[current]
                e.add_note(f"while running task {t.id} {t.name!r} ({InstructionKind(t.op).name}) "
                           f"of program {self.program.name!r}, step {epoch}")
            raise

    def _deadlock(self, reason: str, epoch: int, done: list[bool], unmet: list[int],
                  heads: list[int] | None = None) -> DeadlockError:
        """A DeadlockError naming the stuck tasks and each unmet wait, root causes first."""
        tasks, vals = self.program.tasks, self._values
        stuck = [t for t in range(len(tasks)) if not done[t]]
        left = [0] * len(vals)                       # increments still possible per counter
        for t in stuck:
            left[self._out[t]] += 1

        def unmet_waits(t):
            needs = ((c, thr + step * (epoch - 1)) for c, thr, step in self._waits[t])
            return [(c, need) for c, need in needs if vals[c] < need]

        def hopeless(t):                             # some wait can never be met
            return any(vals[c] + left[c] < need for c, need in unmet_waits(t))

        queue_of = {}
        if heads is not None:
            for q, queue in enumerate(self.program.queues):
                for t in queue:
                    queue_of[t] = (q, queue[heads[q]] if heads[q] < len(queue) else None)
        stuck.sort(key=lambda t: (not hopeless(t), unmet[t] == 0, t))
        lines = [f"ReferenceVM deadlock in program {self.program.name!r}, step {epoch} "
                 f"({self.order} order): {reason}; {len(stuck)} of {len(tasks)} tasks never ran:"]
        for t in stuck[:MAX_STUCK_SHOWN]:
            task = tasks[t]
            desc = ", ".join(f"counter {self._counter_ids[c]}: have {vals[c]}, need {need}"
                             for c, need in unmet_waits(t))
            if not desc:
                q, head = queue_of.get(t, (None, None))
                desc = f"ready, but queued on worker {q} behind task {head}"
            lines.append(f"  task {task.id} {task.name!r} ({InstructionKind(task.op).name}): {desc}")
        if len(stuck) > MAX_STUCK_SHOWN:
            lines.append(f"  ... and {len(stuck) - MAX_STUCK_SHOWN} more stuck tasks")
        lines.append("amk.validate(program) names the structural cause (unreachable threshold or a "
                     "wait cycle)")
        return DeadlockError("\n".join(lines))
