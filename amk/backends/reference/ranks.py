"""The rank simulator: n tensor-parallel rank programs on one device, one ReferenceVM each.

Each rank runs its ready tasks with the VM's counter contract until the only tasks it could
run are cross-rank collectives (amk/program/collectives.py): there it blocks. A collective
fires once every rank has arrived at it (the k-th collective of each program pairs with the
k-th of every other), reduces the ranks' parts in rank order (semantics_collective.py) and
releases all of them. Nothing ever waits on a thread, so a rank that never arrives is
reported at once as a DeadlockError naming the collective, who waits and who does not: the
single-device VM's "nothing is ready" rule, across ranks.

Orders: "program" runs rank 0 until it blocks, then rank 1, ... (lowest ready task first);
"random" picks a seeded random action each time (a task of a random rank, or a collective all
ranks reached), so tests can show the result does not depend on how the ranks interleave.

This drives the VMs' own prepared state (bindings, task arguments, counters, epochs): it is
the VM's scheduler run for several programs at once, not a second execution model.
"""
from __future__ import annotations

import heapq
import random
import time
from typing import Mapping, Sequence

import torch

from amk.backends.reference.semantics_collective import reduce_ranks
from amk.backends.reference.semantics_common import flush_subnormals
from amk.backends.reference.vm import MAX_STUCK_SHOWN, ReferenceVM, RunStats
from amk.errors import DeadlockError, ValidationError
from amk.program.collectives import collective_tasks, reduction
from amk.program.ir import BufferKind, InstructionKind

ORDERS = ("program", "random")


class _Rank:
    """One rank's run: the VM's ready queue, with its collectives held back until they fire."""

    def __init__(self, vm: ReferenceVM, rank: int, epoch: int):
        self.vm, self.rank, self.epoch = vm, rank, epoch
        tasks = vm.program.tasks
        self.coll = {t.id: k for k, t in enumerate(collective_tasks(vm.program))}
        self.n_coll = len(self.coll)
        self.ins, self.outs = vm._task_args()
        n = len(tasks)
        self.unmet = [0] * n
        self.waiting: dict[tuple[int, int], list[int]] = {}
        vals = vm._values
        for t in range(n):
            for c, thr, step in vm._waits[t]:
                need = thr + step * (epoch - 1)
                if vals[c] < need:
                    self.unmet[t] += 1
                    self.waiting.setdefault((c, need), []).append(t)
        self.done = [False] * n
        self.exec_order: list[int] = []
        self.ready: list[int] = []          # local tasks ready to run (a heap by task id)
        self.arrived: dict[int, int] = {}   # collective index -> its task id, ready to fire
        for t in range(n):
            if self.unmet[t] == 0:
                self._release(t)

    def _release(self, t: int) -> None:
        if t in self.coll:
            self.arrived[self.coll[t]] = t
        else:
            heapq.heappush(self.ready, t)

    def finished(self) -> bool:
        return len(self.exec_order) == len(self.done)

    def run(self, t: int) -> None:
        vm = self.vm
        vm._fn[t](self.ins[t], self.outs[t], vm._params[t], vm.ctx)
        self.complete(t)

    def complete(self, t: int) -> None:
        vm = self.vm
        self.done[t] = True
        self.exec_order.append(t)
        c = vm._out[t]
        vm._values[c] += 1
        for u in self.waiting.pop((c, vm._values[c]), ()):
            self.unmet[u] -= 1
            if self.unmet[u] == 0:
                self._release(u)

    def take_ready(self, rng: random.Random | None) -> int:
        if rng is None:
            return heapq.heappop(self.ready)
        t = self.ready.pop(rng.randrange(len(self.ready)))
        heapq.heapify(self.ready)
        return t


def check_ranks(vms: Sequence[ReferenceVM]) -> None:
    """Every collective of rank r's program must say rank r of a world of len(vms)."""
    problems = []
    for r, vm in enumerate(vms):
        for t in collective_tasks(vm.program):
            rank, world = t.params.get("rank"), t.params.get("world")
            if (rank, world) != (r, len(vms)):
                problems.append(f"program {r} ({vm.program.name!r}) task {t.id} {t.name!r} is "
                                f"rank {rank} of {world}, but it runs as rank {r} of {len(vms)}")
    if problems:
        raise ValidationError("run_ranks: the programs do not form one group:\n  "
                              + "\n  ".join(problems[:MAX_STUCK_SHOWN]))


def run_ranks(vms: Sequence[ReferenceVM], bindings: Sequence[Mapping[str, torch.Tensor]],
              order: str = "program", seed: int = 0) -> list[list[torch.Tensor]]:
    """One step of every rank: vms[r] runs rank r's program on bindings[r]. Returns each
    rank's ``program.outputs`` as ReferenceVM.run does. On any error every VM's counters go
    back to where they were, so the step can be run again."""
    if order not in ORDERS:
        raise ValueError(f"run_ranks order={order!r}; choose one of {ORDERS}")
    if len(vms) != len(bindings) or not vms:
        raise ValidationError(f"run_ranks: {len(vms)} programs but {len(bindings)} bindings")
    check_ranks(vms)
    epochs = {vm.epoch for vm in vms}
    if len(epochs) != 1:
        raise ValidationError(f"run_ranks: the ranks' VMs have run different numbers of steps "
                              f"({[vm.epoch for vm in vms]}); drive them together from the start")
    epoch = epochs.pop() + 1
    for vm, b in zip(vms, bindings):
        vm._bind(b)
    saved = [list(vm._values) for vm in vms]
    t0 = time.perf_counter()
    ranks: list[_Rank] = []
    try:
        ranks = [_Rank(vm, r, epoch) for r, vm in enumerate(vms)]
        with flush_subnormals():
            _schedule(ranks, random.Random(seed) if order == "random" else None,
                      t0 + vms[0].timeout_s)
    except BaseException:
        for vm, vals in zip(vms, saved):
            vm._values[:] = vals
        raise
    outs = []
    for vm, rk in zip(vms, ranks):
        vm.epoch = epoch
        vm.last_stats = RunStats(epoch, f"ranks:{order}", len(rk.done), rk.exec_order,
                                 time.perf_counter() - t0)
        bufs = vm.program.buffers
        outs.append([vm._slots[b] if bufs[b].kind == BufferKind.KV_CACHE else vm._slots[b].clone()
                     for b in vm.program.outputs])
    return outs


def _schedule(ranks: list[_Rank], rng: random.Random | None, deadline: float) -> None:
    next_coll = 0                 # collectives fire in order: the k-th pairs with the k-th
    n_coll = max(rk.n_coll for rk in ranks)
    steps = 0
    while not all(rk.finished() for rk in ranks):
        local = [rk for rk in ranks if rk.ready]
        full = next_coll < n_coll and all(next_coll in rk.arrived for rk in ranks)
        if not local and not full:
            raise _deadlock(ranks, next_coll)
        if local and (rng is None or not full or rng.random() < len(local) / (len(local) + 1)):
            rk = local[0] if rng is None else rng.choice(local)
            while rk.ready:               # program order: run this rank until it blocks
                t = rk.take_ready(rng)
                try:
                    rk.run(t)
                except Exception as e:
                    task = rk.vm.program.tasks[t]
                    e.add_note(f"while running task {t} {task.name!r} "
                               f"({InstructionKind(task.op).name}) of rank {rk.rank}")
                    raise
                if rng is not None:
                    break
        else:
            _fire(ranks, next_coll)
            next_coll += 1
        steps += 1
        if steps % 64 == 0 and time.perf_counter() > deadline:
            raise _deadlock(ranks, next_coll, "wall-clock limit exceeded (AMK_VM_TIMEOUT_S)")


def _fire(ranks: list[_Rank], k: int) -> None:
    """Collective k on every rank: check the parts agree, reduce, release each rank."""
    tasks = [rk.arrived.pop(k) for rk in ranks]
    first = ranks[0].vm.program.tasks[tasks[0]]
    what = reduction(first)
    xs = [rk.ins[t][0] for rk, t in zip(ranks, tasks)]
    outs = [rk.outs[t][0] for rk, t in zip(ranks, tasks)]
    for r, (rk, t) in enumerate(zip(ranks, tasks)):
        task = rk.vm.program.tasks[t]
        if (reduction(task), tuple(xs[r].shape), tuple(outs[r].shape)) != \
                (what, tuple(xs[0].shape), tuple(outs[0].shape)):
            raise ValidationError(
                f"collective #{k}: rank {r}'s task {t} {task.name!r} is a {reduction(task)} of "
                f"{list(xs[r].shape)} -> {list(outs[r].shape)}, rank 0's task {first.id} "
                f"{first.name!r} a {what} of {list(xs[0].shape)} -> {list(outs[0].shape)}; "
                f"the rank programs must issue the same collectives in the same order")
    reduce_ranks(what, xs, outs)
    for rk, t in zip(ranks, tasks):
        rk.complete(t)


def _deadlock(ranks: list[_Rank], k: int, reason: str = "") -> DeadlockError:
    """Who waits at collective k, who never arrives there and why (that rank's stuck tasks)."""
    epoch = ranks[0].epoch
    waiting = [rk for rk in ranks if k in rk.arrived]
    absent = [rk for rk in ranks if k not in rk.arrived]
    head = f"rank simulator deadlock, step {epoch}" + (f": {reason}" if reason else "")
    lines = [head]
    if waiting:
        t = waiting[0].vm.program.tasks[waiting[0].arrived[k]]
        lines.append(f"  ranks {[rk.rank for rk in waiting]} wait in collective #{k} "
                     f"(task {t.id} {t.name!r}); ranks {[rk.rank for rk in absent]} never arrive:")
    for rk in absent if waiting else ranks:
        if rk.finished():
            lines.append(f"  rank {rk.rank} finished its program: it has {rk.n_coll} "
                         f"collectives, so no collective #{k}")
        elif not rk.ready and not rk.arrived:
            err = rk.vm._deadlock("no task is ready", epoch, rk.done, rk.unmet)
            lines.append(f"  rank {rk.rank} is stuck: " + str(err).replace("\n", "\n    "))
        elif rk.arrived:
            lines.append(f"  rank {rk.rank} waits in collective #{min(rk.arrived)} instead "
                         f"(the ranks issue their collectives in different orders)")
    return DeadlockError("\n".join(lines))
