"""Hand-built GEMV programs for the tensor-core GEMV (op_gemv_mma, gemv_batch.py): batched bf16
GEMVs at M in {2, 5, 8, 16, 64} and int8 / packed int4 / fp8 E4M3 weights (group scales that
are multiples of a k-block, smaller groups that scale each weight first, zeros, a bias) at
batch 1 and batched, on odd shapes: K not a multiple of a segment, tiles of rows not a multiple
of 16 at an odd offset. Cases as cuda_examples' (one task each; the CPU compile test and the
GPU test against the reference semantics use them)."""
from __future__ import annotations

import math

import torch

from amk.program.ir import BufferKind as BK, DType as D, InstructionKind as K
from amk.testing.cuda_examples import Case, _ints, _rand, _single

QDTYPE = {"int8": D.I8, "int4": D.I4, "fp8": D.F8E4M3}


def _float_case(M: int, N: int, Kd: int, n_off: int, n_tile: int, bias: bool,
                ks: tuple[int, int] | None = None) -> Case:
    ins = [("x", BK.IO_INPUT, D.BF16, (M, Kd)), ("W", BK.WEIGHT, D.BF16, (N, Kd))]
    fill = {"x": _rand((M, Kd), torch.bfloat16), "W": _rand((N, Kd), torch.bfloat16, 0.05)}
    if bias:
        ins.append(("bias", BK.WEIGHT, D.BF16, (N,)))
        fill["bias"] = _rand((N,), torch.bfloat16)
    op = K.GEMV_TILE if M == 1 else K.GEMM_TILE
    params, y, name = {"n_off": n_off, "N_tile": n_tile, "K": Kd}, D.BF16, ""
    if ks is not None:                 # a K slice: fp32 partial sums (passes/tile.split_k)
        params.update(k_off=ks[0], K_tile=ks[1] - ks[0])
        y, name = D.F32, f"_ks{ks[0]}_{ks[1]}"
    return _single(f"mma_bf16_m{M}_k{Kd}_n{n_tile}{'_bias' if bias else ''}{name}", op, ins,
                   [("y", BK.IO_OUTPUT, y, (M, N))], params, fill)


def _fp8_codes(shape):
    """Random E4M3 values (finite: every byte but the two NaN codes), as float8_e4m3fn."""
    def f(g):
        b = torch.randint(0, 256, shape, generator=g, dtype=torch.int32)
        b = torch.where((b & 0x7F) == 0x7F, b & 0xF0, b).to(torch.uint8)
        return b.view(torch.float8_e4m3fn)
    return f


def quant_case(fmt: str, M: int, N: int, Kd: int, group: int, zeros: bool, bias: bool,
               n_off: int, n_tile: int, prefix: str = "mma", ks: tuple[int, int] | None = None) -> Case:
    """One quantized GEMV tile of M rows of bf16 x (random codes, scales, integer zeros)."""
    ng = math.ceil(Kd / group)
    if fmt == "int8":
        q = ("qw", BK.WEIGHT, D.I8, (N, Kd))
        qfill = _ints((N, Kd), -128, 128, torch.int8)
    elif fmt == "int4":
        q = ("qw", BK.WEIGHT, D.U8, (N, Kd // 2))
        qfill = _ints((N, Kd // 2), 0, 256, torch.uint8)
    else:
        q = ("qw", BK.WEIGHT, D.F8E4M3, (N, Kd))
        qfill = _fp8_codes((N, Kd))
    scale = 0.02 if fmt != "fp8" else 0.002
    ins = [("x", BK.IO_INPUT, D.BF16, (M, Kd)), q, ("scales", BK.WEIGHT, D.BF16, (N, ng))]
    fill = {"x": _rand((M, Kd), torch.bfloat16), "qw": qfill,
            "scales": lambda g: ((torch.rand((N, ng), generator=g) + 0.5) * scale).to(torch.bfloat16)}
    if zeros:
        ins.append(("zeros", BK.WEIGHT, D.BF16, (N, ng)))
        fill["zeros"] = lambda g: torch.randint(-3, 4, (N, ng), generator=g).to(torch.bfloat16)
    params = {"n_off": n_off, "N_tile": n_tile, "K": Kd, "qdtype": int(QDTYPE[fmt]), "group": group}
    if bias:
        ins.append(("bias", BK.WEIGHT, D.BF16, (N,)))
        fill["bias"] = _rand((N,), torch.bfloat16)
        params["bias"] = True
    op = K.GEMV_TILE if M == 1 else K.GEMM_TILE
    name = f"{prefix}_{fmt}_m{M}_k{Kd}_g{group}{'_z' if zeros else ''}{'_bias' if bias else ''}"
    y = D.BF16
    if ks is not None:                 # a K slice: fp32 partial sums (passes/tile.split_k)
        params.update(k_off=ks[0], K_tile=ks[1] - ks[0])
        y, name = D.F32, f"{name}_ks{ks[0]}_{ks[1]}"
    return _single(name, op, ins, [("y", BK.IO_OUTPUT, y, (M, N))], params, fill)


def cases() -> list[Case]:
    C = []
    # batched bf16: K a multiple of 8 but not of a segment (64) or of 256; tiles of 40 / 24 / 7 rows
    for M, Kd, n_tile, bias in ((2, 1000, 40, True), (5, 264, 24, False), (8, 2048, 37, False),
                                (16, 8192, 16, False), (64, 520, 7, True)):
        C.append(_float_case(M, 64, Kd, 3, n_tile, bias))
    # quantized: group scales on the mma's sums (group a multiple of the k-block: 64 int8 / fp8,
    # 128 int4; one group a row), zeros, a bias; group 32 (smaller than a k-block: op_gemv)
    for fmt, M, Kd, group, zeros, bias in (
            ("int8", 1, 640, 128, False, False), ("int8", 5, 384, 64, True, True),
            ("int8", 16, 208, 32, True, False), ("int8", 64, 1024, 1024, False, False),
            ("int4", 1, 1024, 128, False, True), ("int4", 2, 640, 128, True, False),
            ("int4", 16, 96, 32, True, False), ("int4", 8, 2048, 2048, False, False),
            ("fp8", 1, 512, 128, False, False), ("fp8", 5, 1040, 64, False, True),
            ("fp8", 16, 96, 32, False, False), ("fp8", 64, 256, 256, False, False)):
        C.append(quant_case(fmt, M, 48, Kd, group, zeros, bias, 5, 33))
    # K slices of a split GEMV (k_off / K_tile, fp32 partials): x in a window (64 rows) and x
    # through the ring (16 rows); quantized with zeros, at a slice that is not the first
    C.append(_float_case(16, 96, 2048, 16, 64, False, (512, 1536)))
    C.append(_float_case(8, 64, 1024, 3, 16, False, (768, 1024)))
    for fmt, M, zeros in (("int8", 16, True), ("int4", 16, True), ("fp8", 5, False)):
        C.append(quant_case(fmt, M, 80, 2048, 128, zeros, False, 8, 64, ks=(1024, 1536)))
    return C
