"""Program -> the CUDA backend's tables, in three visible stages:

    encode   every task (encoders.py; a FUSED task's recipe: fused.py)
    fold     merge steps the templates run as one (folds.FOLDS, then the program-level argmax
             and preload folds): fold_program -> Folded, the backend's first stage
    pack     into descriptor arrays (tables.pack) -> Lowered

Nothing here touches a GPU: pointers are symbolic and the runtime resolves them once the
buffers are bound.
"""
from __future__ import annotations

from amk.gcpause import without_gc
from amk.identity_memo import IdentityMemo
from amk.program.ir import Buffer, InstructionKind as K, Program
from amk.program.regions import operand_pattern
from amk.backends.cuda.argmax_fold import ArgmaxFolds
from amk.backends.cuda.encoders import encode_op
from amk.backends.cuda.folds import fold_steps
from amk.backends.cuda.fused import lower_fused
from amk.backends.cuda.options import CudaOptions
from amk.backends.cuda.preload import drop_unissued_preloads, preload
from amk.backends.cuda.ring import fit_below_ring, mark_ring_steps
from amk.backends.cuda.steps import (REF_BUFFER, REF_SCRATCH, SCRATCH_ALIGN, Folded, FoldedTask,
                                     Fused, View, fail)
from amk.backends.cuda.tables import Lowered, pack


@without_gc
def fold_program(program: Program, n_ctas: int = 132,
                 options: CudaOptions = CudaOptions()) -> Folded:
    """Every task encoded and folded. ``n_ctas`` only matters when the program has no queues."""
    argmax = ArgmaxFolds(program)
    scratch = argmax.scratch_bytes        # the argmax partials first, then the FUSED scratch
    memo = _FusedMemo()
    pre_memo = IdentityMemo()             # preload's PRE steps, once per encoded step
    tasks = []
    views = [_view(b) for b in program.buffers]       # one View per buffer, shared by its tasks
    memo.number(views)
    for t in program.tasks:
        ins = [views[b] for b in t.inputs]
        outs = [views[b] for b in t.outputs]
        if t.op == K.FUSED:
            fused, used = memo.lower(t, ins, outs, scratch)
        else:
            fused, used = Fused([(encode_op(t, t.op, ins, outs, t.params), ins, outs)], []), 0
        ft = FoldedTask(t, ins, outs, argmax.steps(t, fused.steps, outs), fused.zero)
        # v2's ring streams every tile's weights: no preload (it would be a second copy)
        ft = mark_ring_steps(ft) if options.kernel == "v2" else preload(ft, options.preload_bytes,
                                                                      pre_memo)
        if t.op == K.FUSED and not ft.one:
            scratch += -(-used // SCRATCH_ALIGN) * SCRATCH_ALIGN
        tasks.append(ft)
    if options.kernel == "v2":
        fit_below_ring(tasks)
    queues = _queues(program, n_ctas)
    drop_unissued_preloads(tasks, queues)
    return Folded(tasks, queues, scratch)


def _lower_and_fold(t, ins: list[View], outs: list[View], scratch: int) -> tuple[Fused, int]:
    fused, used = lower_fused(t, ins, outs, scratch)
    return fold_steps(fused), used


class _FusedMemo:
    """lower_fused + fold_steps once per distinct kind of FUSED task. A decoder's layers repeat
    (the 8B shape: 20.8k tasks, a few hundred kinds): a task with the same recipe object, the
    same operand shapes, dtypes and kinds, the same pattern of repeated buffers and the same
    scratch alignment gets the first one's steps over its own buffers and scratch offset (the
    encoders and folds only compare refs, never read them)."""

    def __init__(self):
        self.done = IdentityMemo()
        self.shape_of: list[int] = []    # buffer id -> a number for its (shape, dtype, kind)

    def number(self, views: list[View]) -> None:
        """Number each buffer's (shape, dtype, kind) once: a task's kind then hashes ints."""
        ids: dict[tuple, int] = {}
        self.shape_of = [ids.setdefault((v.shape, v.dtype, v.kind), len(ids)) for v in views]

    def lower(self, t, ins: list[View], outs: list[View], scratch: int) -> tuple[Fused, int]:
        views = ins + outs
        operands = t.inputs + t.outputs
        kind = (operand_pattern(operands)[1], tuple(map(self.shape_of.__getitem__, operands)),
                scratch % SCRATCH_ALIGN)
        kind_of = self.done.get(t.params.get("recipe"), kind,
                                lambda: _LoweredKind(views, scratch, ins, outs, t))
        if kind_of.views is views:               # lowered just now
            return kind_of.fused, kind_of.used
        return kind_of.moved(views, scratch), kind_of.used


class _LoweredKind:
    """One kind's steps, and where each of their views comes from (an operand of the task, by
    position, or scratch), so that another task of the kind gets its own without hashing views."""

    def __init__(self, views: list[View], scratch: int, ins, outs, t):
        self.views, self.scratch = views, scratch
        self.fused, self.used = _lower_and_fold(t, ins, outs, scratch)
        self.plan = None

    def moved(self, views: list[View], scratch: int) -> Fused:
        if self.plan is None:
            # operand position of each view equal to an operand (the last, as a dict keeps),
            # else after them, the scratch view it is (each distinct one once: equal views
            # stay one object); every task of the kind has as many operands
            at = {v: k for k, v in enumerate(self.views)}
            scratch_views: dict[View, int] = {}

            def slot(v: View) -> int:
                k = at.get(v)
                return k if k is not None else len(self.views) + scratch_views.setdefault(
                    v, len(scratch_views))

            self.plan = ([(enc, [slot(v) for v in args], [slot(v) for v in outs_])
                          for enc, args, outs_ in self.fused.steps], list(scratch_views))
        steps, old_scratch = self.plan
        delta = scratch - self.scratch
        new = views + [View(v.shape, v.dtype, (REF_SCRATCH, v.ref[1] + delta), None)
                       for v in old_scratch]
        return Fused([(enc, [new[k] for k in args], [new[k] for k in outs_])
                      for enc, args, outs_ in steps],
                     [(o + delta, n) for o, n in self.fused.zero])


def lower_program(program: Program, n_ctas: int = 132,
                  options: CudaOptions = CudaOptions()) -> Lowered:
    """The kernel's tables for ``program`` (fold_program, then tables.pack)."""
    return pack(program, fold_program(program, n_ctas, options))


def _queues(program: Program, n_ctas: int) -> list[list[int]]:
    if program.queues:
        qs = [list(q) for q in program.queues]
        seen = sorted(t for q in qs for t in q)
        if seen != list(range(len(program.tasks))):
            fail(None, "program.queues must hold every task exactly once")
        return qs
    n = max(1, min(n_ctas, len(program.tasks)))
    return [list(range(i, len(program.tasks), n)) for i in range(n)]


def _view(b: Buffer) -> View:
    return View(tuple(b.shape), b.dtype, (REF_BUFFER, b.id), b.kind)
