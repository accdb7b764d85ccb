"""The schedule IR: the contract between the passes and the backends.

A Program is a set of tasks that synchronise only through monotonic counters. Every field
name follows the customer's seed (Buffer, Counter, Wait, Task); the enums below are the one
source of truth for opcodes and dtypes (the CUDA ABI header is generated from them).

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
from dataclasses import dataclass, replace
from typing import Any, Mapping

import torch


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


class DType(enum.IntEnum):
    """Dtype codes, frozen (the seed fixes I8 = 6 and I4 = 7)."""
    F32 = 0
    F16 = 1
    BF16 = 2
    I32 = 3
    U8 = 4
    BOOL = 5
    I8 = 6
    I4 = 7          # a quantization code, never a buffer dtype: int4 weights live in U8 buffers
    F8E4M3 = 8
    F8E5M2 = 9
    I64 = 10

    @property
    def torch(self) -> torch.dtype:
        if self is DType.I4:
            raise ValueError("I4 is a quantization code; int4 weights are stored as U8 buffers")
        return _TO_TORCH[self]

    @property
    def itemsize(self) -> int:
        if self is DType.I4:
            return self.torch          # raises: I4 is a code, its storage is U8
        return _ITEMSIZE[self]

    @property
    def short(self) -> str:
        return self.name.lower()

    @staticmethod
    def of(dt: torch.dtype) -> "DType":
        try:
            return _FROM_TORCH[dt]
        except KeyError:
            raise TypeError(f"AMK has no dtype for torch {dt}") from None

    @staticmethod
    def parse(s: str) -> "DType":
        return DType[s.upper()]


_TO_TORCH = {
    DType.F32: torch.float32, DType.F16: torch.float16, DType.BF16: torch.bfloat16,
    DType.I32: torch.int32, DType.U8: torch.uint8, DType.BOOL: torch.bool,
    DType.I8: torch.int8, DType.F8E4M3: torch.float8_e4m3fn, DType.F8E5M2: torch.float8_e5m2,
    DType.I64: torch.int64,
}
_FROM_TORCH = {v: k for k, v in _TO_TORCH.items()}
_ITEMSIZE = {k: torch.empty((), dtype=v).element_size() for k, v in _TO_TORCH.items()}


class BufferKind(enum.IntEnum):
    IO_INPUT = 0     # a runtime input (token ids, decode position)
    IO_OUTPUT = 1    # returned to the caller
    WEIGHT = 2       # model parameter, read only
    CONST = 3        # a table the compiler made (rope frequencies), read only
    KV_CACHE = 4     # persistent state, updated in place
    ACTIVATION = 5   # scratch between tasks, owned by the backend


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
