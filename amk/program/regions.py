"""What each task reads and writes, as column ranges of buffers (docs/PROGRAM.md, "Regions").

A Region is columns [lo, hi) of a buffer's last axis, all rows. Everything that reasons about
hazards (deps, validate, the counter allocator) goes through `task_regions`, one table below.
Over-approximation is the safe direction for writes and for race checks; reads are kept exact
where the op's contract says so (tiled elementwise, per-head attention) so the coverage proof
does not demand writes nobody needs.
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Sequence

from amk.program.ir import Buffer, InstructionKind as K, Task


class Region(NamedTuple):
    buffer: int
    lo: int
    hi: int

    def __str__(self) -> str:
        return f"b{self.buffer}[{self.lo}:{self.hi}]"


def overlaps(a: Region, b: Region) -> bool:
    """Same buffer and the column ranges intersect."""
    return a.buffer == b.buffer and a.lo < b.hi and b.lo < a.hi


# How each opcode touches its operands. "tile" = the op honours n_off/N_tile on its output and on
# inputs of the output's width (listed by position); "whole" = everything. Attention ops are special.
_TILED_INPUTS: dict[K, tuple[int, ...]] = {
    K.COPY: (0,), K.ROPE: (0,), K.SILU_MUL: (0, 1), K.GELU: (0,), K.ADD: (0, 1), K.MUL: (0, 1),
}
_GEMV = (K.GEMV_TILE, K.GEMM_TILE)        # read x and weights whole, write the tile's columns
_ATTENTION = (K.ATTENTION_TILE, K.ATTENTION_COMBINE)
PARTIAL_WRITE = 2                         # ATTENTION_TILE flags bit: out holds [acc | m | l] rows
NEW_KV = 4                                # ATTENTION_TILE flags bit: row pos from inputs 4, 5


def kv_window(kv_start: int, kv_len: int, max_seq: int, pos: int | None,
              shard: int = 0, shards: int = 1) -> tuple[int, int]:
    """The cache rows [lo, hi) an ATTENTION_TILE reads at run time: [kv_start, kv_start+kv_len)
    clamped by max_seq and the runtime pos (rows <= pos), then, for a split-KV shard (shards >
    1), shard `shard` of `shards` equal pieces of that live window. Splitting the live window,
    not the cache's capacity, keeps every shard busy however large the cache a user allocates."""
    lo = kv_start
    hi = min(max_seq, kv_start + kv_len)
    if pos is not None:
        hi = min(hi, pos + 1)
    hi = max(hi, lo)
    if shards > 1:
        size = -(-(hi - lo) // shards)
        lo, hi = lo + shard * size, min(hi, lo + (shard + 1) * size)
        hi = max(hi, lo)
    return lo, hi

def _whole(bid: int | None, width) -> list[Region]:
    if bid is None:
        return []
    return [Region(bid, 0, width(bid))]


def _cols(bid: int | None, lo: int, hi: int, width) -> list[Region]:
    """Columns [lo, hi) of bid, or the whole buffer if it is not that wide (a non-flat view)."""
    if bid is None:
        return []
    w = width(bid)
    # A head range on a non-flat view cannot be a column range: fall back to the whole buffer
    # (validate rejects head-restricted attention whose output is not flat).
    if lo < 0 or hi > w or lo >= hi:
        return [Region(bid, 0, w)]
    return [Region(bid, lo, hi)]


def _tile_range(params: Mapping[str, Any], out_width: int | None) -> tuple[int, int] | None:
    if "n_off" not in params and "N_tile" not in params:
        return None
    lo = int(params.get("n_off", 0))
    if "N_tile" in params:
        return lo, lo + int(params["N_tile"])
    return (lo, out_width) if out_width is not None else None


def _head_cols(params: Mapping[str, Any], row: int) -> tuple[int, int] | None:
    """Columns of heads [h_off, h_off+h_count) in a flat buffer of `row` columns per head."""
    if "h_off" not in params:
        return None
    h_off = int(params["h_off"])
    h_count = int(params.get("h_count", int(params.get("n_heads", 0)) - h_off))
    return h_off * row, (h_off + h_count) * row


def _op_regions(op: K, ins: Sequence[int | None], outs: Sequence[int | None],
                params: Mapping[str, Any], width, out_width: int | None):
    """(reads, writes) of one primitive op; None operands are FUSED scratch (private)."""
    reads: list[Region] = []
    writes: list[Region] = []
    if op in _GEMV:
        for b in ins:
            reads += _whole(b, width)
        tile = _tile_range(params, out_width)
        for o in outs:
            writes += _cols(o, *tile, width) if tile else _whole(o, width)
    elif op in _ATTENTION:
        hd = int(params.get("head_dim", 0))
        flat_out = op is K.ATTENTION_TILE and not int(params.get("flags", 0)) & PARTIAL_WRITE
        in_row = hd if op is K.ATTENTION_TILE else hd + 2
        out_row = hd if flat_out or op is K.ATTENTION_COMBINE else hd + 2
        in_cols = _head_cols(params, in_row)
        out_cols = _head_cols(params, out_row)
        rep = int(params.get("n_heads", 1)) // max(int(params.get("n_kv_heads", params.get("n_heads", 1))), 1)
        kv_cols = None if in_cols is None or rep < 1 else (in_cols[0] // rep, in_cols[1] // rep)
        for i, b in enumerate(ins):
            # ATTENTION_TILE: q per head, NEW_KV's new k/v rows per kv head; caches and pos
            # whole. COMBINE: every partial per head.
            per_head = in_cols is not None and (op is K.ATTENTION_COMBINE or i == 0)
            if op is K.ATTENTION_TILE and i >= 4 and kv_cols is not None:
                reads += _cols(b, *kv_cols, width)
            else:
                reads += _cols(b, *in_cols, width) if per_head else _whole(b, width)
        for o in outs:
            writes += _cols(o, *out_cols, width) if out_cols else _whole(o, width)
    elif op in _TILED_INPUTS:
        tile = _tile_range(params, out_width)
        tiled = _TILED_INPUTS[op]
        for i, b in enumerate(ins):
            if b is None:
                continue
            same_width = out_width is None or width(b) == out_width
            if tile and i in tiled and same_width:
                reads += _cols(b, *tile, width)
            else:
                reads += _whole(b, width)
        for o in outs:
            writes += _cols(o, *tile, width) if tile else _whole(o, width)
    elif op is K.FUSED:
        raise AssertionError("FUSED is expanded by task_regions")
    else:
        # NOP, EMBED, norms, SOFTMAX, DEQUANT, SAMPLE_ARGMAX, ALLREDUCE_SHARD, and KV_APPEND
        # (writes a run-time row: modelled as the whole cache) touch whole buffers.
        for b in ins:
            reads += _whole(b, width)
        for o in outs:
            writes += _whole(o, width)
    return reads, writes


def _fused_regions(task: Task, width):
    """Union over recipe steps of the regions on external operands (scratch is private)."""
    reads: list[Region] = []
    writes: list[Region] = []
    recipe = task.params.get("recipe") or {}
    for step in recipe.get("steps") or []:
        ins: list[int | None] = []
        for a in step.get("args") or []:
            ins.append(task.inputs[int(a["in"])] if "in" in a else None)
        out = step.get("out")
        if out == "final" or out == -1:
            o: int | None = task.outputs[0]
        elif isinstance(out, Mapping):
            o = task.outputs[int(out["o"])]
        else:
            o = None
        if o is not None:
            ow: int | None = width(o)
        else:
            shape = step.get("out_shape")
            ow = int(shape[-1]) if shape else None
        r, w = _op_regions(K(int(step["op"])), ins, [o], step.get("params") or {}, width, ow)
        reads += r
        writes += w
    return _merge(reads), _merge(writes)


def _merge(regions: list[Region]) -> list[Region]:
    """Sorted, with overlapping or touching ranges of one buffer merged."""
    out: list[Region] = []
    for r in sorted(regions):
        if out and out[-1].buffer == r.buffer and r.lo <= out[-1].hi:
            last = out[-1]
            out[-1] = Region(r.buffer, last.lo, max(last.hi, r.hi))
        else:
            out.append(r)
    return out


def task_regions(task: Task, buffers: Sequence[Buffer] | Mapping[int, Buffer]
                 ) -> tuple[list[Region], list[Region]]:
    """(reads, writes) of `task`, each a list of Regions (merged per buffer)."""
    def width(bid: int) -> int:
        return buffers[bid].cols

    if task.op is K.FUSED:
        return _fused_regions(task, width)
    out_width = width(task.outputs[0]) if task.outputs else None
    reads, writes = _op_regions(task.op, task.inputs, task.outputs, task.params, width, out_width)
    return _merge(reads), _merge(writes)
