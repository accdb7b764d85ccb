"""What the CUDA lowering works on: an operand's View, a device-function Variant, and one
Encoded step (the content of one task descriptor before it is packed into the tables).

A step is (Encoded, input views, output views). Pointers are symbolic (a buffer id or a
scratch-arena offset): the runtime resolves them once the buffers are bound.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

from amk.errors import CompileError
from amk.program.ir import BufferKind, DType

# C++ type of each buffer dtype in the templates (bf16/f16 are freestanding bit structs).
CTYPE = {DType.F32: "float", DType.F16: "f16", DType.BF16: "bf16", DType.I32: "int",
         DType.I64: "long long", DType.I8: "signed char", DType.U8: "unsigned char"}
FLOATS = (DType.F32, DType.F16, DType.BF16)
RMS_RN = 8              # row elements a thread of rms_row holds (the kernel's AMK_RMS_RN)
SCRATCH_ALIGN = 256

REF_BUFFER, REF_SCRATCH = 0, 1
# The staged attentions (one template signature, one descriptor): CUDA cores, tensor cores
STAGED_ATTENTION = ("op_attention_smem", "op_attention_mma")


@dataclass(frozen=True)
class View:
    """What an op sees of one operand: shape, dtype, where it lives, and what it is."""
    shape: tuple[int, ...]
    dtype: DType
    ref: tuple[int, int]                 # (REF_BUFFER, buffer id) or (REF_SCRATCH, byte offset)
    kind: BufferKind | None = None       # None for FUSED scratch

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def cols(self) -> int:
        return self.shape[-1] if self.shape else 1

    @property
    def esize(self) -> int:
        return self.dtype.itemsize


@dataclass(frozen=True)
class Variant:
    """One device function the kernel's switch calls: its name and its template arguments, by
    name and in the template's order (codegen.call_text renders it once). Values are C++ type
    names (str), ints and bools."""
    fn: str
    args: tuple[tuple[str, object], ...] = ()

    @staticmethod
    def of(fn: str, **args) -> "Variant":
        return Variant(fn, tuple(args.items()))

    def arg(self, name: str, default=None):
        return dict(self.args).get(name, default)

    def with_(self, **kw) -> "Variant":
        """These arguments replaced where the variant has them, else appended in kw's order
        (a template's defaulted trailing arguments)."""
        args = tuple((k, kw.pop(k) if k in kw else v) for k, v in self.args)
        return Variant(self.fn, args + tuple(kw.items()))


@dataclass
class Encoded:
    """One descriptor's content, before it is packed."""
    op: int
    variant: Variant | None              # the device function that runs it; None = nothing to run
    ip: dict[str, int] = field(default_factory=dict)
    fp: dict[str, float] = field(default_factory=dict)
    group: str = ""

    def is_fn(self, *fns: str) -> bool:
        return self.variant is not None and self.variant.fn in fns


def fail(task, msg: str) -> None:
    where = f"task {task.id} ({task.name or task.op.name})" if task is not None else "program"
    raise CompileError(f"CUDA backend: {where}: {msg}")


def ctype(task, dt: DType) -> str:
    """The template type of a buffer dtype."""
    if dt not in CTYPE:
        fail(task, f"dtype {dt.name} is not supported by the CUDA templates")
    return CTYPE[dt]


def ftype(task, dt: DType) -> str:
    """The template type of a float dtype (f32/f16/bf16)."""
    if dt not in FLOATS:
        fail(task, f"expected a float dtype (f32/f16/bf16), got {dt.name}")
    return CTYPE[dt]


def int_input(t, v: View, what: str) -> int:
    """1 if an index operand is int64, 0 if int32; else a clear error."""
    if v.dtype not in (DType.I32, DType.I64):
        fail(t, f"{what} must be int32 or int64, got {v.dtype.name}")
    return int(v.dtype == DType.I64)


@dataclass(frozen=True)
class Fused:
    """A FUSED task's steps and the scratch ranges (offset, bytes) zeroed before they run: what
    lower_fused makes of the recipe and what every fold (folds.FOLDS) takes and returns."""
    steps: list
    zero: list


@dataclass
class FoldedTask:
    """One program task after encoding and every fold: its own operands, its steps (one step
    and no zeroing over buffers only: it runs as a plain instruction), the scratch it zeroes,
    and the weight ranges the task before it in the queue preloads for it (preload.py)."""
    task: object                         # the program's Task
    ins: list
    outs: list
    steps: list
    zero: list
    preload: list = field(default_factory=list)
    preload_step: int = -1               # the step whose ip PRE reads the preloaded rows

    @cached_property      # steps are replaced in place only by steps over the same views
    def one(self) -> bool:
        return (len(self.steps) == 1 and not self.zero
                and all(v.ref[0] == REF_BUFFER for v in self.steps[0][1] + self.steps[0][2]))


@dataclass
class Folded:
    """The whole program after the folds: what tables.pack turns into descriptor arrays."""
    tasks: list                          # FoldedTask per program task, in task order
    queues: list                         # per-CTA task ids
    scratch_bytes: int
