"""Tensor dtypes, below both IRs: the graph IR's avals and the schedule IR's buffers use them.

`DType` is the one enum of dtype codes (the CUDA ABI header is generated from it) and its
mapping to torch dtypes.
"""
from __future__ import annotations

import enum

import torch


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
