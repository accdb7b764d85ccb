"""Kernel v2's weight ring: which GEMV steps stream their weights through it, and the page
order that the producer warp and the consumer warps (templates/ring.cuh, op_gemv_direct's RING
path) both follow.

A CTA's producer (one lane a page of its producer warpgroup's first warp) walks the CTA's queue
from its first task to its last and, for every RING step (an op_gemv_direct of read-only float
weights), copies the step's items into the ring, one item a page: item `it` of a step is the
CTA's item q (items of earlier RING steps in the queue, then `it`), goes to page q % pages (its
lane's) and fills that page's phase q // pages, once the page's previous item was taken. The consumers take the same items in the same numbering (the step's first q
is how many items earlier steps took): item q goes to warp q % pages (pages <= 16 warps), so a
page is only ever read by one warp, phase after phase (an mbarrier's parity wait must never
be two phases behind), and neither side tells the other anything beyond the mbarriers.

An item is op_gemv_direct's unit of work: two weight rows (NMAT 1: rows 2g, 2g + 1; NMAT 2:
row g of each matrix) x one K segment of SEG_BYTES (32 lanes x 8 vectors x 16 B). In its page,
row j's segment starts at j * segment_bytes(row_bytes): each row j a contiguous byte range of
its matrix, one bulk copy each. A row past the tile is not copied (the consumer reads zeros).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from amk.program.ir import BufferKind
from amk.backends.cuda import gemv_batch
from amk.backends.cuda.smem import RING_BYTES, RING_OFF
from amk.backends.cuda.steps import FoldedTask, fail

SEG_BYTES = 4096            # one K segment of a row: op_gemv_direct's 32 lanes x GU 8 x 16 B
MAX_PAGES = 16              # page p is read by consumer warp p only (op_gemv_direct's 16 warps)


@dataclass(frozen=True)
class Copy:
    """One bulk copy of an item: `nbytes` from byte `src` of matrix `mat` (from the matrix's
    start) to byte `dst` of the item's page."""
    mat: int
    src: int
    nbytes: int
    dst: int


def segment_bytes(row_bytes: int) -> int:
    """Bytes a row's segment holds in a page (a row shorter than a segment: the row)."""
    return min(SEG_BYTES, row_bytes)


def n_items(nmat: int, n_tile: int, row_bytes: int) -> int:
    """op_gemv_direct's items of a tile (its `items`): row groups x K segments."""
    groups = n_tile if nmat == 2 else (n_tile + 1) // 2
    return groups * -(-row_bytes // SEG_BYTES)


def item_copies(nmat: int, n_off: int, n_tile: int, row_bytes: int, pitch: int,
                it: int) -> list[Copy]:
    """The bulk copies of item `it` of a tile (rows n_off.. of pitch bytes, the first row_bytes
    of each read), as the producer issues them (templates/ring.cuh ring_produce_step)."""
    nseg = -(-row_bytes // SEG_BYTES)
    g, seg = divmod(it, nseg)
    sb, off = segment_bytes(row_bytes), seg * SEG_BYTES
    out = []
    for j in range(2):
        r = g if nmat == 2 else 2 * g + j
        if r < n_tile:
            out.append(Copy(j if nmat == 2 else 0, (n_off + r) * pitch + off,
                            min(SEG_BYTES, row_bytes - off), j * sb))
    return out


def consumer_warp(q: int, n_pages: int) -> int:
    """The consumer warp that takes the CTA's item q (its page's only reader)."""
    return q % n_pages


def consumer_offset(nmat: int, n_tile: int, row_bytes: int, it: int, j: int, v: int) -> int | None:
    """Where in its page the consumer reads 16-byte vector v (of the row, 0 <= v <
    row_bytes / 16) of row j of item it (direct_load_ring); None: it reads zeros there."""
    nseg = -(-row_bytes // SEG_BYTES)
    g, seg = divmod(it, nseg)
    r = g if nmat == 2 else 2 * g + j
    lo = seg * SEG_BYTES // 16
    if r >= n_tile or not lo <= v < min(row_bytes // 16, lo + SEG_BYTES // 16):
        return None
    return j * segment_bytes(row_bytes) + (v - lo) * 16


def slot_bytes(row_bytes_of_steps) -> int:
    """A page: the largest item of the program's RING steps (one kernel-wide size, so a page's
    place is q % pages whatever step it holds)."""
    return 2 * max((segment_bytes(rb) for rb in row_bytes_of_steps), default=SEG_BYTES)


def pages(slot: int) -> int:
    """Pages of `slot` bytes the ring's RING_BYTES hold (at most MAX_PAGES: one warp a page)."""
    return max(2, min(MAX_PAGES, RING_BYTES // slot))


def mark_ring_steps(ft: FoldedTask) -> FoldedTask:
    """Every op_gemv_direct step of `ft` whose weights are read-only (WEIGHT / CONST: nothing
    writes them during the kernel, so the producer may copy them before the step's inputs are
    ready) and whose rows are contiguous from the tile's first (any pitch; 16-byte multiples,
    as the direct path already needs) streams through the ring: variant RING, ip RING = NMAT,
    ROWB = bytes a row is read (K), PITCH = bytes between rows."""
    steps = list(ft.steps)
    changed = False
    for i, (enc, args, outs) in enumerate(steps):
        if not enc.is_fn("op_gemv_direct"):
            continue
        nmat = enc.variant.arg("nmat")
        ws = args[1:1 + nmat]
        if any(w.kind not in (BufferKind.WEIGHT, BufferKind.CONST) for w in ws):
            continue
        es = ws[0].esize
        rowb, pitch = enc.ip["K"] * es, enc.ip["LDW"] * es
        if rowb % 16 or pitch % 16:
            continue
        steps[i] = (replace(enc, variant=enc.variant.with_(sr=1, ring=True),
                            ip=dict(enc.ip, RING=nmat, ROWB=rowb, PITCH=pitch)), args, outs)
        changed = True
    return replace(ft, steps=steps) if changed else ft


def fit_below_ring(tasks: list[FoldedTask]) -> None:
    """In a v2 program that streams (any RING step), every op_gemv_mma step's work area ends
    below the ring, replanned there if its v1 plan (up to SMEM_BYTES) reaches into it: the
    producer fills pages for later tasks while the step runs. In place; an error where no plan
    fits."""
    if not any(e.variant.arg("ring") for ft in tasks for e, _, _ in ft.steps if e.is_fn("op_gemv_direct")):
        return
    for k, ft in enumerate(tasks):
        steps, changed = list(ft.steps), False
        for i, (e, args, outs) in enumerate(steps):
            if not e.is_fn("op_gemv_mma") or gemv_batch.step_bytes(e.variant, e.ip) <= RING_OFF:
                continue
            p = gemv_batch.replan(e.variant, e.ip, budget=RING_OFF)
            if p is None:
                fail(ft.task, f"kernel v2: this GEMV's work area does not fit below the weight ring "
                              f"({RING_OFF} bytes); run it on kernel v1 (AMK_KERNEL=v1)")
            var, ip = gemv_batch.planned(e.variant, e.ip, p)
            steps[i] = (replace(e, variant=var, ip=ip), args, outs)
            changed = True
        if changed:
            tasks[k] = replace(ft, steps=steps)
