"""The tensor-core GEMV (op_gemv_mma, templates/gemv_batch.cuh): which GEMVs take it, and how
its shared memory is planned.

It runs the batched float GEMVs (bf16 x and weights, M > 1 rows of x: each weight vector is
read once for all rows of a pass, not once per 4 rows as op_gemv does; at M = 1 only a K past
smem.GEMV_X_MAX, which op_gemv_direct and op_gemv cannot stage) and the batched
quantized GEMVs of bf16 x (int8, packed int4, fp8 E4M3; batch 1 takes op_gemv_qdirect,
gemv_quant.py, where it can): the weights are dequantised in registers as they leave the warp's
ring in shared memory.

The work area holds x as bf16 (MP rows of a window of KW elements of K, each row padded against
bank conflicts; with the norm, times its weight), the sums (NMAT x rows x MP x CH chunks, fp32),
the norm's per-row sums of squares (each window's own slots) and 1 / rms (the epilogue scales a
row's sums by it), and each warp's ring of RD stages: the weights of one job (16 rows x one K
segment, 2 KiB; quantized also the rows' scales and zeros) copied by cp.async, RD - 1 jobs ahead
of the warp's compute, across its items and windows. The plan takes the fewest passes over the
weights (MP = 8 NB rows of x a pass), then enough items for every warp, then rings of 3 stages
or more, then the fewest windows, then the deepest ring (plan).

x through the ring (XR, bf16 without the norm): a tile that reads x about once (one 16-row
group: o and down at batch 16) has no x window; each job's stage also holds x's rows over its
segment (one k-block a job), so x streams with the weights, without the windows' barriers and
stagings (down at batch 16: 17 of its 24.5 us a tile were its four windows' stagings, NOTES
v24).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from amk.backends.cuda.smem import NWARPS, SMEM_BYTES
from amk.backends.cuda.steps import Variant

NB_MAX = 4                       # n-tiles of 8 rows of x a pass (registers: 4 x 8 accumulators)
KU = 2                           # k-blocks (16-byte loads per row per lane) an item has in flight
#                                  (4: ptxas spilled in op_gemv_mma and the scheduler)
KU_XR = 1                        # with x through the ring: x's rows of a job are 64 bytes (no
#                                  bank conflicts, mma_issue_x)
VW = {0: 8, 1: 16, 2: 32, 3: 16}  # elements of a 16-byte weight vector, by QMODE
RD_MAX = 6                       # stages of a warp's ring (the template waits for up to 5 behind)
RD_GOOD = 3                      # 2 stages ahead: 64 KiB an SM in flight, a window's x staging
#                                  (~2 us) covered
WINDOWS_MAX = 4                  # a window is two barriers and an x staging (~2 us): past 4 they
#                                  cost more than a deeper ring gains
# A norm's x over several windows (each adds its sums of squares) where one window leaves a ring
# of one stage, bf16, at passes of at most 2 n-tiles: Llama-3-8B batch 16 7.943 -> 7.468 ms;
# with windows wherever they ranked first, 1B batch 64 (32 rows a pass), Qwen3 and int8 at
# batch 16 were slower (NOTES v27)
NORM_WINDOWS_NB_MAX = 2
# The 196 KiB the CTA had before the fold's room (smem.py): a batch-1 GEMV's preload (the top
# 64 KiB, preload.py) is issued when the task before it ends (or from its attention), so no
# op_gemv_mma task runs while it is in flight or read. A larger budget (rings a stage deeper,
# 215 KiB) measured level or slower (NOTES v27).
BUDGET = 196 << 10
assert BUDGET <= SMEM_BYTES


@dataclass(frozen=True)
class MmaPlan:
    nb: int                      # n-tiles a pass (template NB)
    kw: int                      # x window (ip KW)
    spi: int                     # K segments an item (ip SPI)
    rd: int                      # stages of each warp's weight ring (ip RD)
    xr: bool = False             # x through the ring with the weights (template XR)


def segment(qmode: int, xr: bool = False) -> int:
    """Elements of K one item's segment covers (KU k-blocks of 4 lanes x a 16-byte vector)."""
    return (KU_XR if xr else KU) * 4 * VW[qmode]


def stage_bytes(qmode: int, xr: bool = False, mp: int = 0) -> int:
    """A ring stage (the template's MmaStage, SB): 2 rows x KU k-blocks x 32 lanes of 16-byte
    weight vectors, quantized then the words of the 16 rows' scales and zeros a k-block; XR
    then the pass's mp rows of x over the segment."""
    ku = KU_XR if xr else KU
    w = 2 * ku * 32 * 16
    return w + (0 if qmode == 0 else 2 * (2 * ku * 8 * 4)) + (mp * segment(qmode, True) * 2 if xr else 0)


def norm_slots(kw: int) -> int:
    """NORM: a row's slots of sums of squares (the template's mma_norm_slots): one a warp's 32
    16-byte vectors of x when they are one row's, else one a vector."""
    nvec = kw // 8
    return nvec // 32 if nvec % 32 == 0 else nvec


def smem_bytes(qmode: int, nb: int, kw: int, spi: int, n_tile: int, nmat: int, rd: int,
               norm: bool = False, xr: bool = False, windows: int = 1) -> int:
    """The work area a plan uses (the template's layout; NORM: each of the windows has its own
    slots of sums of squares)."""
    mp = 8 * nb
    xstride = 0 if xr else kw * 2 + (64 if qmode == 0 else 16)
    x = -(-mp * xstride // 16) * 16
    ch = -(-kw // (spi * segment(qmode, xr)))
    rows16 = -(-n_tile // 16) * 16
    per = norm_slots(kw) * windows if norm else NWARPS
    sums = x + 4 * (nmat * rows16 * mp * ch + mp * per + mp)
    return -(-sums // 16) * 16 + NWARPS * rd * stage_bytes(qmode, xr, mp)


def items(qmode: int, kw: int, spi: int, n_tile: int, nmat: int, xr: bool = False) -> int:
    """A window's items: (matrix, 16-row group, chunk of SPI segments), one warp's work each."""
    return nmat * -(-n_tile // 16) * -(-kw // (spi * segment(qmode, xr)))


def _takes_xr(qmode: int, norm: bool, n_tile: int, nmat: int, mp: int) -> bool:
    """x through the ring: bf16 without the norm, where the tile's items read x no more than
    its window would (one 16-row group), or x's re-reads weigh at most one group's weights."""
    groups = nmat * -(-n_tile // 16)
    return qmode == 0 and not norm and (groups == 1 or groups * mp <= 16)


def _plan_xr(K: int, n_tile: int, nmat: int, nb: int) -> MmaPlan | None:
    """The XR plan of nb n-tiles: one window of all of K; enough items for every warp, then
    the deepest ring of 2 stages or more that fits, then the fewest segments a warp runs, then
    the fewest chunks (the epilogue adds them)."""
    seg = segment(0, True)
    nseg = -(-K // seg)
    kw = nseg * seg
    fits = [MmaPlan(nb, kw, s, rd, True) for rd in range(2, RD_MAX + 1) for s in range(1, nseg + 1)
            if smem_bytes(0, nb, kw, s, n_tile, nmat, rd, xr=True) <= BUDGET]
    if not fits:
        return None

    def rank(p: MmaPlan):
        n = items(0, p.kw, p.spi, n_tile, nmat, True)
        return -min(n, NWARPS), -p.rd, -(-n // NWARPS) * p.spi, -(-p.kw // (p.spi * seg))
    return min(fits, key=rank)


@functools.lru_cache(maxsize=None)
def plan(M: int, K: int, n_tile: int, nmat: int, qmode: int, norm: bool = False) -> MmaPlan | None:
    """The plan for M rows of x, K, a tile of n_tile rows of nmat matrices in BUDGET bytes of
    shared memory (None: no plan fits; with the norm, one window unless that leaves a
    one-stage ring, NORM_WINDOWS_NB_MAX). The fewest passes over the weights first; then items
    for every warp (a window's items are all its parallelism: the 1B down projection at
    batch 16 took one 4096-wide window of 3 items, 3 of 16 warps loading, 93 us a tile);
    then at most WINDOWS_MAX windows; then rings of RD_GOOD stages (the loads in flight);
    then the fewest windows (a window is two barriers and its x staging); then the deepest
    ring; then the fewest segments a warp runs and the fewest chunks (the epilogue adds
    them). Every plan that fits is ranked (memoised: one search a shape). A tile that takes
    x through the ring (_takes_xr) gets its XR plan where one fits."""
    seg = segment(qmode)
    nseg = -(-K // seg)
    for nb in range(min(-(-M // 8), NB_MAX), 0, -1):
        xr = _plan_xr(K, n_tile, nmat, nb) if _takes_xr(qmode, norm, n_tile, nmat, 8 * nb) else None
        if xr is not None:
            return xr
        kws = sorted({-(-nseg // w) * seg for w in range(1, nseg + 1)}, reverse=True)
        fits = []
        for kw in kws:
            for rd in range(1, RD_MAX + 1):
                spi = next((s for s in range(1, kw // seg + 1)
                            if smem_bytes(qmode, nb, kw, s, n_tile, nmat, rd, norm, windows=-(-K // kw)) <= BUDGET),
                           None)
                if spi is not None:          # a larger SPI needs less (fewer chunks' sums)
                    fits += [MmaPlan(nb, kw, s, rd) for s in range(spi, kw // seg + 1)]
        if norm:                     # windows only for bf16, a one-stage ring, <= 16 rows a pass
            one = [p for p in fits if p.kw >= K]
            if qmode != 0 or nb > NORM_WINDOWS_NB_MAX or any(p.rd >= 2 for p in one):
                fits = one
        if fits:
            def rank(p: MmaPlan):
                n = items(qmode, p.kw, p.spi, n_tile, nmat)
                ch = -(-p.kw // (p.spi * seg))
                windows = -(-K // p.kw)
                return (-min(n, NWARPS), windows > WINDOWS_MAX, -min(p.rd, RD_GOOD), windows, -p.rd,
                        -(-n // NWARPS) * p.spi, ch)
            return min(fits, key=rank)
    return None


def scales_vectors(qmode: int, group: int, ngroups: int) -> bool:
    """Whether op_gemv_mma runs these group scales: on the mma's sums, so a k-block must lie in
    one group; smaller groups stay on op_gemv. (Weights prescaled one 16-byte vector at a time,
    for groups smaller than a k-block, were wrong on the H200 with zeros: int8 group 32, 2 of 32
    outputs 15% off, NOTES v21 call 6; that path is gone.)"""
    return qmode == 0 or ngroups == 1 or group % (4 * VW[qmode]) == 0


def gemv_mma(*, ty, ts, tz, qmode, nmat, epi, bias, zeros, nb, tr="float", to=None,
             norm=False, nw="float", xr=False, ks=False) -> Variant:
    """op_gemv_mma with every template argument, in its order (KS: a K slice, ip KLO / KHI;
    without it the template's defaulted false, so the other variants' code is as before)."""
    v = Variant.of("op_gemv_mma", ty=ty, ts=ts, tz=tz, qmode=qmode, nmat=nmat, epi=epi, bias=bias,
                   zeros=zeros, nb=nb, tr=tr, to=to or ty, norm=norm, nw=nw, xr=xr)
    return v.with_(ks=True) if ks else v


def planned(v: Variant, ip: dict, p: MmaPlan) -> tuple[Variant, dict]:
    """An op_gemv_mma step under plan p: its variant with p's template arguments, its ip with
    p's fields (a new dict)."""
    return v.with_(nb=p.nb, xr=p.xr), dict(ip, **plan_ip(p))


def replan(v: Variant, ip: dict, *, nmat: int | None = None, norm: bool | None = None) -> MmaPlan | None:
    """The plan of an op_gemv_mma step once a fold changes its matrices or adds the norm."""
    return plan(ip["M"], ip.get("KHI", ip["K"]) - ip.get("KLO", 0), ip["N_TILE"], nmat or v.arg("nmat"),
                v.arg("qmode"), v.arg("norm") if norm is None else norm)


def plan_ip(p: MmaPlan) -> dict:
    return dict(KW=p.kw, SPI=p.spi, RD=p.rd)
