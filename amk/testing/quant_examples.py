"""Hand-built batch-1 quantized GEMV programs for op_gemv_qdirect (gemv_quant.py): int8, packed
int4 and fp8 E4M3 weights, groups of 32 / 64 / 128 and one group a row, with and without
zeros, some with a bias, on odd shapes (K below one 2048-weight segment, past whole segments
and of whole segments; a 33-row tile at an odd offset and a 250-row one, so items of few and of
many rows), and a group that is not a power of two (op_gemv runs it). Cases as cuda_examples'
(one task each; the CPU test and the GPU test against the reference semantics use them)."""
from __future__ import annotations

from amk.testing.cuda_examples import Case
from amk.testing.mma_examples import quant_case

KS = (640, 2112, 4160)
TILES = ((5, 33), (3, 250))


def cases() -> list[Case]:
    C = []
    i = 0
    for fmt in ("int8", "int4", "fp8"):
        for zeros in ((False, True) if fmt != "fp8" else (False,)):
            for group in (32, 64, 128, 0):
                Kd = KS[i % len(KS)]
                n_off, n_tile = TILES[i % len(TILES)]
                C.append(quant_case(fmt, 1, 260, Kd, group or Kd, zeros, i % 3 == 0, n_off, n_tile, "qd"))
                i += 1
    C.append(quant_case("fp8", 1, 260, 2112, 64, True, True, 3, 250, "qd"))     # fp8 with zeros
    C.append(quant_case("int8", 1, 260, 768, 96, False, False, 5, 33, "qd"))    # group 96: op_gemv
    # whole segments and many items a warp: the rolling buffer (gemv_quant.plan_items' ROLL) at
    # an odd first row, with zeros, on one int4 matrix and on one fp8 group a row (the model tests
    # roll int8 / fp8 down and LM head tiles and every gate/up pair, but no zeros, no single int4)
    C.append(quant_case("int8", 1, 260, 4096, 128, True, False, 3, 250, "qd"))
    C.append(quant_case("int4", 1, 260, 4096, 64, False, True, 3, 250, "qd"))
    C.append(quant_case("fp8", 1, 260, 4096, 4096, False, False, 3, 250, "qd"))
    return C
