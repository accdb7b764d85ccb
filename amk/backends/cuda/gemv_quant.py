"""The batch-1 quantized GEMV on CUDA cores (op_gemv_qdirect, templates/gemv_quant.cuh): which
GEMVs take it, and its rows an item.

Every batch-1 GEMV of int8, packed int4 or fp8 E4M3 weights whose 16-byte vectors each lie in
one group (of a power-of-two size, or one a row) takes it; op_gemv_mma stays for batches, which
reuse each weight vector for many rows of x. Its weights stream at op_gemv_direct's depth (16
loads a lane in flight, 12 for int4, against the mma's 4), dequantised in registers. An item
is RI weight rows x one K segment of 2048 weights; RI is the fewest rows at the fewest rounds
of items a warp that keep a round's bytes under ROUND_BYTES an SM where the tile allows: a
small tile spreads over the warps, a large one takes rounds of ~64 KiB (NOTES v42, v43), in a
rolling register buffer (plan_items).
"""
from __future__ import annotations

from amk.backends.cuda.smem import NWARPS
from amk.backends.cuda.steps import RMS_RN, Variant

VW = {1: 16, 2: 32, 3: 16}        # weights a 16-byte vector, by QMODE (templates: QVec)
GU = {1: 4, 2: 2, 3: 4}           # vectors a row a lane an item holds
LOADS = {1: 16, 2: 12, 3: 16}     # 16-byte loads a lane an item holds at most (int4: 16 spilled)
SEGMENT = 2048                    # weights of K an item's row covers: 32 lanes x GU x VW
ROUND_BYTES = 65536               # a round of items' bytes an SM at most, where rows allow (NOTES v43)
ROLL_LOADS = 8                    # loads a lane an item when its registers roll (16 spilled, NOTES v43)


def group_shift(qmode: int, group: int, ngroups: int) -> int | None:
    """ip GSHIFT (k >> GSHIFT is k's group, clamped to the last) when each 16-byte weight vector
    lies in one group (the scale on its partial sum): one group a row, or a power-of-two group
    of whole vectors; else None (op_gemv_qdirect cannot run it)."""
    if ngroups == 1:
        return 30
    if group % VW[qmode] or group & (group - 1):
        return None
    return group.bit_length() - 1


def rows_per_item(qmode: int, nmat: int, n_tile: int, K: int, zeros: bool, cap: int | None = None) -> int:
    """RI (a multiple of nmat, `cap` loads a lane at most: LOADS, 8 with zeros): the fewest rows an
    item at the fewest rounds of items a warp that keep a round's weight bytes (scales and zeros
    not counted) under ROUND_BYTES where the tile allows, so the tile's loads spread over the
    most warps. Why rounds of ~64 KiB: the warps of one round issue, wait and compute in step,
    so one large round leaves the loads idle while they compute; smaller rounds let one warp's
    dequantise-and-dot run beside another's loads (NOTES v42, v43)."""
    nseg = -(-K // SEGMENT)
    cap = cap or (8 if zeros else LOADS[qmode])
    options = [ri for ri in (6, 4, 2, 1) if ri * GU[qmode] <= cap and ri % nmat == 0]

    def rounds(ri: int) -> int:
        return -(-(-(-n_tile // (ri // nmat)) * nseg) // NWARPS)
    tile_bytes = nmat * n_tile * K // (2 if qmode == 2 else 1)
    want = max(rounds(options[0]), -(-tile_bytes // ROUND_BYTES))
    fit = [ri for ri in options if rounds(ri) >= want] or options[-1:]
    return min(ri for ri in fit if rounds(ri) == min(map(rounds, fit)))


def plan_items(qmode: int, nmat: int, n_tile: int, K: int, zeros: bool) -> tuple[int, bool]:
    """(RI, ROLL): rows_per_item's RI, or, where that leaves a warp more than one item and every
    item fills its K segment, a rolling buffer (ROLL: each register slot takes the warp's next
    item once read, so the next item's loads fly while this one is dequantised) of at most
    ROLL_LOADS loads a lane (1B int4 -1 to -2%, 8B int4 -3%, v44). A partial segment (K %
    SEGMENT) does not roll: it leaves slots without loads, so at 8 slots its items would keep
    half as many in flight (Qwen3-0.6B's K 1024; not measured apart: v43's Qwen3 loss was its
    scheduler's spill, v44)."""
    ri = rows_per_item(qmode, nmat, n_tile, K, zeros)
    items = -(-n_tile // (ri // nmat)) * -(-K // SEGMENT)
    if items <= NWARPS or K % SEGMENT:
        return ri, False
    return rows_per_item(qmode, nmat, n_tile, K, zeros, cap=ROLL_LOADS), True


def gemv_qdirect(*, tx, ty, ts, tz, qmode, nmat, epi, bias, zeros, ri, roll, tr="float", to=None,
                 norm=False, nx="float", nw="float", rn=RMS_RN) -> Variant:
    """op_gemv_qdirect with every template argument, in its order. xpad (int4): it stages x
    itself padded (x_floats), so its lanes read x without rotating their weights
    (folds.unpad_shared_x turns it off where x is shared with another step: XS_READY). int8 / fp8 keep the rotation: padded,
    the 1B's steps measured +0.5 / +0.7% in one round (NOTES v48)."""
    return Variant.of("op_gemv_qdirect", tx=tx, ty=ty, ts=ts, tz=tz, qmode=qmode, nmat=nmat, epi=epi,
                      bias=bias, zeros=zeros, ri=ri, roll=roll, tr=tr, to=to or ty, norm=norm, nx=nx, nw=nw,
                      rn=rn, xpad=qmode == 2)


def x_floats(K: int, qmode: int) -> int:
    """The floats of op_gemv_qdirect's x: int4's padded, 4 after every 32 (xpad_at in
    common.cuh), so consecutive lanes' 16-byte reads of their vectors fall in distinct banks."""
    return -(-K // 32) * 36 if qmode == 2 else -(-K // 4) * 4


def replan(v: Variant, ip: dict, nmat: int) -> Variant:
    """The variant of an op_gemv_qdirect step once it runs nmat matrices (pair_gemvs)."""
    ri, roll = plan_items(v.arg("qmode"), nmat, ip["N_TILE"], ip["K"], v.arg("zeros"))
    return v.with_(nmat=nmat, ri=ri, roll=roll)
