"""What the kernel's source depends on, read off the folded program before its tables are packed.

kernel.cu is the templates plus a switch over the program's variants and a few program-wide
flags; the per-task tables (tables.pack) go to the GPU as data. So NVRTC, the longest step of a
cold compile, can start once the program is folded, and the tables be packed beside it
(compile.start_program). pack numbers the variants with this spec, so the switch and the
descriptors agree by construction.
"""
from __future__ import annotations

from dataclasses import dataclass

from amk.gcpause import without_gc
from amk.program.ir import InstructionKind as K
from amk.backends.cuda.abi import MAX_PTRS
from amk.backends.cuda.steps import Folded, Variant


@dataclass(frozen=True)
class KernelSpec:
    variants: tuple[Variant, ...]    # the switch's cases, numbered as the descriptors name them
    encoded: tuple[Variant, ...]     # the same before the PRE marks: as the encoders made them
    pre: bool                        # a task copies the next task's rows (AMK_PRE, preload.py)
    zero: bool                       # a FUSED task zeroes scratch first (AMK_ZERO)
    early: bool                      # a task has an early phase during its poll (AMK_EARLY)
    too_many: tuple[int, ...]        # ids of tasks with a descriptor of > MAX_PTRS operands


def runs_steps(ft) -> bool:
    """A folded FUSED task whose steps get descriptors of their own (its own runs nothing);
    else the task runs as its one step."""
    return ft.task.op == K.FUSED and not ft.one


@without_gc
def kernel_spec(folded: Folded) -> KernelSpec:
    index: dict[Variant, int] = {}
    with_pre: set[Variant] = set()
    too_many: list[int] = []
    zero = early = False
    seen: set[int] = set()       # the tasks of a kind share their Encoded objects (alive here)
    for ft in folded.tasks:
        own = runs_steps(ft)
        zero = zero or (own and bool(ft.zero))
        early = early or (not own and ft.steps[0][0].ip.get("EARLY", 0) == 1)
        if own and len(ft.ins) + len(ft.outs) > MAX_PTRS:
            too_many.append(ft.task.id)
        for enc, ins, outs in (ft.steps if own else ft.steps[:1]):
            if len(ins) + len(outs) > MAX_PTRS:
                too_many.append(ft.task.id)
            if id(enc) in seen:
                continue
            seen.add(id(enc))
            v = enc.variant
            if v is None:
                continue
            index.setdefault(v, len(index))
            if v.fn == "op_gemv_direct" and enc.ip.get("PRE", 0) > 0:
                with_pre.add(v)       # only the variants that read preloaded rows get that path
                                      # (never-run code costs: NOTES v16)
    pre = any(folded.tasks[j].preload for q in folded.queues for j in q[1:])
    variants = tuple(v.with_(pre=True) if v in with_pre else v for v in index)
    return KernelSpec(variants, tuple(index), pre, zero, early, tuple(dict.fromkeys(too_many)))
