"""The schedule IR: the contract between the passes and the backends.

A Program is a set of tasks that synchronise only through monotonic counters. Every field
name follows the customer's seed (Buffer, Counter, Wait, Task); InstructionKind below is the one
source of truth for opcodes (the CUDA ABI header is generated from it, and from amk/dtypes.py's
DType, re-exported here with amk/buffer_kinds.py's BufferKind so `amk.program.ir` names them all).

Conventions every consumer relies on (see docs/PROGRAM.md for the per-opcode table):
  * a task fires when every wait ``counter >= threshold + per_step * (epoch - 1)`` holds, where
    per_step is the number of tasks incrementing that counter and epoch = 1 for the first decode
    step, 2 for the next, ...; when it finishes it adds 1 to ``out_counter``.
    Counters are never reset: one program serves every decode step.
  * buffers are dense, row-major; a task's "columns" are the buffer's last axis.
  * ``program order`` (the order of ``tasks``) is a legal sequential execution.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

from amk.buffer_kinds import BufferKind
from amk.dtypes import DType

__all__ = ["InstructionKind", "DType", "BufferKind", "Buffer", "Counter", "Wait", "Task",
           "Program"]


class InstructionKind(enum.IntEnum):
    NOP = 0
    COPY = 1
    EMBED = 2
    RMSNORM = 3
    LAYERNORM = 4
    GEMV_TILE = 5
    GEMM_TILE = 6
    ATTENTION_TILE = 7
    ATTENTION_COMBINE = 8
    ROPE = 9
    SILU_MUL = 10
    GELU = 11
    ADD = 12
    MUL = 13
    DEQUANT = 14
    SOFTMAX = 15
    KV_APPEND = 16
    SAMPLE_ARGMAX = 17
    ALLREDUCE_SHARD = 18
    FUSED = 19
    SOFTCAP = 20        # y = cap * tanh(x / cap); cap = 1 is tanh (Gemma 2's soft-capping)
    SUM = 21            # y = x_0 + x_1 + ... in fp32, in input order (a K-split GEMV's partials)


@dataclass(frozen=True)
class Buffer:
    id: int
    name: str
    kind: BufferKind
    dtype: DType
    shape: tuple[int, ...]
    source: str = ""          # pytree path of the argument leaf (inputs, weights, kv) or ""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def cols(self) -> int:
        return self.shape[-1] if self.shape else 1


@dataclass(frozen=True)
class Counter:
    id: int
    init: int = 0


@dataclass(frozen=True)
class Wait:
    counter: int
    threshold: int


@dataclass(frozen=True)
class Task:
    id: int
    op: InstructionKind
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    params: Mapping[str, Any]
    waits: tuple[Wait, ...]
    out_counter: int
    name: str = ""            # where it came from: "layers.3.wq[tile 2/16]" (for errors and dumps)

    def with_(self, **kw) -> "Task":
        return replace(self, **kw)


def new_task(id: int, op: InstructionKind, inputs: tuple[int, ...], outputs: tuple[int, ...],
             params: Mapping[str, Any], waits: tuple[Wait, ...], out_counter: int,
             name: str = "") -> Task:
    """Task(...), the same object, without the frozen dataclass's __init__, which sets every
    field through object.__setattr__ (1.6 -> 0.6 us; the passes build ~2x10^5 tasks a compile
    of the 8B shape). Task has no __post_init__ and no __slots__ (checked below)."""
    t = _new(Task)
    d = t.__dict__
    d["id"], d["op"], d["inputs"], d["outputs"] = id, op, inputs, outputs
    d["params"], d["waits"], d["out_counter"], d["name"] = params, waits, out_counter, name
    return t


_new = object.__new__
assert not hasattr(Task, "__post_init__") and "__slots__" not in Task.__dict__
assert [f.name for f in fields(Task)] == ["id", "op", "inputs", "outputs", "params", "waits",
                                          "out_counter", "name"]


@dataclass(frozen=True)
class Program:
    buffers: tuple[Buffer, ...]
    counters: tuple[Counter, ...]
    tasks: tuple[Task, ...]
    queues: tuple[tuple[int, ...], ...] = ()      # per-SM static task lists (after `place`)
    name: str = "program"
    outputs: tuple[int, ...] = ()                 # buffer ids returned, in the function's order

    def buffer(self, bid: int) -> Buffer:
        return self.buffers[bid]

    def with_(self, **kw) -> "Program":
        return replace(self, **kw)
