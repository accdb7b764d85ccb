"""Program -> the CUDA backend's tables, in three visible stages:

    encode   every task (encoders.py; a FUSED task's recipe: fused.py)
    fold     merge steps the templates run as one (folds.FOLDS, then the program-level argmax
             and preload folds): fold_program -> Folded, the backend's first stage
    spec     what kernel.cu depends on (kernel_spec.py): NVRTC may start here
    pack     into descriptor arrays (tables.pack) -> Lowered

Nothing here touches a GPU: pointers are symbolic and the runtime resolves them once the
buffers are bound.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from amk.gcpause import without_gc
from amk.identity_memo import IdentityMemo
from amk.program.ir import Buffer, InstructionKind as K, Program
from amk.program.regions import operand_pattern
from amk.backends.cuda.argmax_fold import ArgmaxFolds
from amk.backends.cuda.encoders import encode_op
from amk.backends.cuda.folds import fold_steps
from amk.backends.cuda.kernel_spec import KernelSpec, kernel_spec
from amk.backends.cuda.fused import lower_fused
from amk.backends.cuda.options import CudaOptions
from amk.backends.cuda.preload import drop_unissued_preloads, preload
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
    early_memo = IdentityMemo()           # _no_early's steps, once per encoded step
    tasks = []
    views = [_view(b) for b in program.buffers]       # one View per buffer, shared by its tasks
    memo.number(views)
    for t in program.tasks:
        ins = [views[b] for b in t.inputs]
        outs = [views[b] for b in t.outputs]
        if t.op == K.FUSED and not argmax.touches(t):
            # the whole folded task, preload included, once per kind (_LoweredKind.folded)
            ft, used = memo.folded(t, ins, outs, scratch, options.preload_bytes, pre_memo)
        else:
            if t.op == K.FUSED:
                fused, used = memo.lower(t, ins, outs, scratch)
            else:
                fused, used = Fused([(encode_op(t, t.op, ins, outs, t.params), ins, outs)], []), 0
            ft = FoldedTask(t, ins, outs, argmax.steps(t, fused.steps, outs), fused.zero)
            ft = preload(ft, options.preload_bytes, pre_memo)
        if t.op == K.FUSED and not ft.one:
            scratch += -(-used // SCRATCH_ALIGN) * SCRATCH_ALIGN
            _no_early(ft, early_memo)
        tasks.append(ft)
    queues = _queues(program, n_ctas)
    drop_unissued_preloads(tasks, queues)
    return Folded(tasks, queues, scratch)


def _no_early(ft: FoldedTask, memo: IdentityMemo) -> None:
    """A task that still runs steps after the folds has no early phase: the scheduler runs one
    (attn_early, during the poll) only for a plain task, so its steps get EARLY 0 (new Encoded
    objects: the encoded ones are shared through the kind memos)."""
    ft.steps = [(memo.get(enc, None, lambda enc=enc: replace(enc, ip=dict(enc.ip, EARLY=0))), a, o)
                if enc.ip.get("EARLY") else (enc, a, o) for enc, a, o in ft.steps]


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

    def kind(self, t, views: list[View], ins: list[View], outs: list[View],
             scratch: int) -> _LoweredKind:
        operands = t.inputs + t.outputs
        kind = (operand_pattern(operands)[1], tuple(map(self.shape_of.__getitem__, operands)),
                scratch % SCRATCH_ALIGN)
        return self.done.get(t.params.get("recipe"), kind,
                             lambda: _LoweredKind(views, scratch, ins, outs, t))

    def lower(self, t, ins: list[View], outs: list[View], scratch: int) -> tuple[Fused, int]:
        views = ins + outs
        return self._lowered(self.kind(t, views, ins, outs, scratch), views, scratch)

    @staticmethod
    def _lowered(kind_of: _LoweredKind, views: list[View], scratch: int) -> tuple[Fused, int]:
        if kind_of.views is views:               # lowered just now
            return kind_of.fused, kind_of.used
        return kind_of.moved(views, scratch), kind_of.used

    def folded(self, t, ins: list[View], outs: list[View], scratch: int, cap: int,
               pre_memo: IdentityMemo) -> tuple[FoldedTask, int]:
        """The task encoded, folded and preloaded (no argmax fold: the caller's), from its
        kind's first task renamed: preload too reads only the steps' encodings and the
        operands' kinds and dtypes, which the kind fixes."""
        views = ins + outs
        kind_of = self.kind(t, views, ins, outs, scratch)
        if kind_of.template is None:
            fused, used = self._lowered(kind_of, views, scratch)
            ft = preload(FoldedTask(t, ins, outs, fused.steps, fused.zero), cap, pre_memo)
            kind_of.template = _Template(ft.steps, ft.zero, ft.preload, views, scratch)
            kind_of.preload_step = ft.preload_step
            return ft, used
        steps, zero, pre = kind_of.template.instance(views, scratch)
        return FoldedTask(t, ins, outs, steps, zero, pre, kind_of.preload_step), kind_of.used


class _LoweredKind:
    """One kind's steps, and where each of their views comes from (an operand of the task, by
    position, or scratch), so that another task of the kind gets its own without hashing views."""

    def __init__(self, views: list[View], scratch: int, ins, outs, t):
        self.views, self.scratch = views, scratch
        self.fused, self.used = _lower_and_fold(t, ins, outs, scratch)
        self.plan: _Template | None = None          # its steps (moved())
        self.template: _Template | None = None      # its folded, preloaded task (folded())
        self.preload_step = -1

    def moved(self, views: list[View], scratch: int) -> Fused:
        if self.plan is None:
            self.plan = _Template(self.fused.steps, self.fused.zero, [], self.views, self.scratch)
        steps, zero, _ = self.plan.instance(views, scratch)
        return Fused(steps, zero)


class _Template:
    """Steps with each view as a slot: an operand's position (the last, as a dict keeps: equal
    operands are one View object), else a scratch view (each distinct one once), moved by the
    task's scratch offset, as are the zeroed ranges; preloaded ranges name operands' refs.
    Every task of a kind has as many operands."""

    def __init__(self, steps: list, zero: list, preload: list, views: list[View], scratch: int):
        at = {v: k for k, v in enumerate(views)}
        ref_at = {v.ref: k for k, v in enumerate(views)}
        extra: dict[View, int] = {}

        def slot(v: View) -> int:
            k = at.get(v)
            return k if k is not None else len(views) + extra.setdefault(v, len(extra))

        self.steps = [(enc, [slot(v) for v in args], [slot(v) for v in outs])
                      for enc, args, outs in steps]
        self.scratch_views, self.scratch, self.zero = list(extra), scratch, zero
        self.preload = [(ref_at[ref], off, n) for ref, off, n in preload]

    def instance(self, views: list[View], scratch: int) -> tuple[list, list, list]:
        """(steps, zeroed ranges, preloaded ranges) over these operand views and scratch."""
        delta = scratch - self.scratch
        new = views + [View(v.shape, v.dtype, (REF_SCRATCH, v.ref[1] + delta), None)
                       for v in self.scratch_views]
        return ([(enc, [new[k] for k in args], [new[k] for k in outs])
                 for enc, args, outs in self.steps],
                [(o + delta, n) for o, n in self.zero],
                [(new[k].ref, off, n) for k, off, n in self.preload])


def lower_program(program: Program, n_ctas: int = 132, options: CudaOptions = CudaOptions(),
                  on_spec: Callable[[KernelSpec], None] | None = None) -> Lowered:
    """The kernel's tables for ``program`` (fold_program, then tables.pack). on_spec gets the
    kernel spec before the tables are packed (compile.start_program starts NVRTC there)."""
    folded = fold_program(program, n_ctas, options)
    spec = kernel_spec(folded)
    if on_spec is not None:
        on_spec(spec)
    return pack(program, folded, spec)


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
