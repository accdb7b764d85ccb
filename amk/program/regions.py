"""What each task reads and writes, as column ranges of buffers (docs/PROGRAM.md, "Regions").

A Region is columns [lo, hi) of a buffer's last axis, in every row or in rows [r0, r1) of its
leading axes taken as one (a batched attention task writes only its sequences' rows of y).
Everything that reasons about hazards (deps, validate, the counter allocator) goes through
`task_regions`, one table below.
Over-approximation is the safe direction for writes and for race checks; reads are kept exact
where the op's contract says so (tiled elementwise, per-head attention) so the coverage proof
does not demand writes nobody needs.
"""
from __future__ import annotations

from functools import partial
from itertools import count
from typing import Any, Mapping, NamedTuple, Sequence

from amk.identity_memo import IdentityMemo
from amk.program.ir import Buffer, InstructionKind as K, Task
from amk.program.recipe import INPUT, OUTPUT, parse_recipe


ALL_ROWS = 1 << 62      # a Region's r1 when it spans every row


class Region(NamedTuple):
    buffer: int
    lo: int
    hi: int
    r0: int = 0
    r1: int = ALL_ROWS

    @property
    def every_row(self) -> bool:
        return self.r0 <= 0 and self.r1 >= ALL_ROWS

    def __str__(self) -> str:
        rows = "" if self.every_row else f"rows {self.r0}:{self.r1}, "
        return f"b{self.buffer}[{rows}{self.lo}:{self.hi}]"


# A Region from a (buffer, lo, hi, r0, r1) tuple, without the NamedTuple's Python-level
# __new__: the compile's hot loops build ~10^5 of them (renamed regions of repeated tasks)
new_region = partial(tuple.__new__, Region)


def overlaps(a: Region, b: Region) -> bool:
    """Same buffer, and the column ranges and the row ranges intersect."""
    return (a.buffer == b.buffer and a.lo < b.hi and b.lo < a.hi
            and a.r0 < b.r1 and b.r0 < a.r1)


def buffer_rows(buf: Buffer) -> int:
    """The rows a Region's r0 / r1 count: every leading axis taken as one."""
    return buf.numel // max(buf.cols, 1)


# How each opcode touches its operands. "tile" = the op honours n_off/N_tile on its output and on
# inputs of the output's width (listed by position); "whole" = everything. Attention ops are special.
_TILED_INPUTS: dict[K, tuple[int, ...]] = {
    K.COPY: (0,), K.ROPE: (0,), K.SILU_MUL: (0, 1), K.GELU: (0,), K.ADD: (0, 1), K.MUL: (0, 1),
    K.SOFTCAP: (0,),
}
_GEMV = (K.GEMV_TILE, K.GEMM_TILE)        # read x (its K slice) and weights whole, write the tile's columns
_ATTENTION = (K.ATTENTION_TILE, K.ATTENTION_COMBINE)
PARTIAL_WRITE = 2                         # ATTENTION_TILE flags bit: out holds [acc | m | l] rows
NEW_KV = 4                                # ATTENTION_TILE flags bit: row pos from inputs 4, 5


def live_window(kv_start: int, kv_len: int, max_seq: int, pos: int | None,
                window: int = 0) -> tuple[int, int]:
    """The cache rows [lo, hi) an attention may read at run time: [kv_start, kv_start+kv_len)
    clamped by max_seq and the runtime pos (rows <= pos; a sliding window > 0 also drops rows
    <= pos - window)."""
    lo = kv_start
    hi = min(max_seq, kv_start + kv_len)
    if pos is not None:
        hi = min(hi, pos + 1)
        if window > 0:
            lo = max(lo, pos + 1 - window)
    return lo, max(hi, lo)


def live_shards(rows: int, shards: int, shard_rows: int) -> int:
    """How many of a split-KV attention's `shards` shards cover a live window of `rows` rows
    (ext, AMK's live count): enough that each has at least `shard_rows` rows, at least one and
    at most `shards`. shard_rows <= 0: every shard (the seed's fixed count)."""
    if shard_rows <= 0:
        return shards
    return max(1, min(shards, rows // shard_rows))


def kv_window(kv_start: int, kv_len: int, max_seq: int, pos: int | None,
              shard: int = 0, shards: int = 1, window: int = 0,
              shard_rows: int = 0) -> tuple[int, int] | None:
    """The cache rows [lo, hi) an ATTENTION_TILE reads at run time: the live window
    (live_window), then, for a split-KV shard (shards > 1), shard `shard` of L equal pieces of
    it, L = live_shards(its rows, shards, shard_rows) (L = shards when shard_rows is 0).
    Splitting the live window, not the cache's capacity, keeps every live shard busy however
    large the cache a user allocates. None: the shard is not live (shard >= L): it reads and
    writes nothing, and the combine does not read its partial."""
    lo, hi = live_window(kv_start, kv_len, max_seq, pos, window)
    if shards > 1:
        live = live_shards(hi - lo, shards, shard_rows)
        if shard >= live:
            return None
        size = -(-(hi - lo) // live)
        # a shard that starts past the rows (5 rows in 4 shards of 2: the last) is empty at
        # the window's end, never past it (nor past the cache: a batched attention reads
        # every row's shard from the lowest lo to the highest hi)
        lo, hi = min(hi, lo + shard * size), min(hi, lo + (shard + 1) * size)
    return lo, hi


def combine_partials(params: Mapping[str, Any], n_inputs: int) -> int:
    """How many of an ATTENTION_COMBINE's inputs are partials: all, or all but the last, the
    runtime pos, when the combine counts its live shards (kv_shard_rows > 0, ext)."""
    return n_inputs - 1 if int(params.get("kv_shard_rows", 0)) > 0 else n_inputs


def combine_live(params: Mapping[str, Any], n_parts: int, pos: int | None) -> int:
    """The partials an ATTENTION_COMBINE merges: the first live_shards(...) of its n_parts,
    from the attention's window params it carries (kv_start, kv_len: the window's rows in the
    cache, window) and pos; every partial when it does not count live shards."""
    rows = int(params.get("kv_shard_rows", 0))
    if rows <= 0:
        return n_parts
    start = int(params.get("kv_start", 0))
    lo, hi = live_window(start, int(params["kv_len"]), start + int(params["kv_len"]), pos,
                         int(params.get("window", 0)))
    return live_shards(hi - lo, n_parts, rows)


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


def k_range(params: Mapping[str, Any], k: int) -> tuple[int, int]:
    """The K columns [lo, hi) of x and W a GEMV tile multiplies: all k, or one slice of a
    split GEMV (ext: k_off / K_tile, tile.py; its partial sums go to a SUM)."""
    lo = int(params.get("k_off", 0))
    return lo, lo + int(params.get("K_tile", k - lo))


def _head_cols(params: Mapping[str, Any], row: int) -> tuple[int, int] | None:
    """Columns of heads [h_off, h_off+h_count) in a flat buffer of `row` columns per head."""
    if "h_off" not in params:
        return None
    h_off = int(params["h_off"])
    h_count = int(params.get("h_count", int(params.get("n_heads", 0)) - h_off))
    return h_off * row, (h_off + h_count) * row


def seq_range(params: Mapping[str, Any], n_seq: int) -> tuple[int, int]:
    """The sequences [b_off, b_off+b_count) an ATTENTION_TILE covers (ext; all by default)."""
    b_off = int(params.get("b_off", 0))
    return b_off, b_off + int(params.get("b_count", n_seq - b_off))


def _seq_head_cols(bid: int | None, params: Mapping[str, Any], row: int, width, rows,
                   own_seqs: bool) -> list[Region]:
    """The regions of a per-head operand. A buffer of one row holding several sequences'
    heads one after the other (split_kv's batched partials, [1, B*n_heads*row]: sequence b's
    heads are columns [b*n_heads*row, (b+1)*n_heads*row)) gives each sequence (own_seqs: each
    of the task's seq_range) its head columns; a buffer of n_heads*row columns gives the head
    columns of every row, or (own_seqs, b_off given) of the task's sequences' rows (a row a
    sequence: a batched task's direct output, [B, n_heads*row]); anything else is whole."""
    if bid is None:
        return []
    w, per_seq = width(bid), int(params.get("n_heads", 0)) * row
    cols = _head_cols(params, row) or (0, per_seq)
    if per_seq > 0 and w == per_seq and own_seqs and "b_off" in params:
        r0, r1 = seq_range(params, rows(bid))
        return [Region(bid, *cols, r0, r1)]
    if per_seq <= 0 or w == per_seq or w % per_seq:
        return _cols(bid, *cols, width) if "h_off" in params else _whole(bid, width)
    lo, hi = seq_range(params, w // per_seq) if own_seqs else (0, w // per_seq)
    return [Region(bid, b * per_seq + cols[0], b * per_seq + cols[1]) for b in range(lo, hi)]


def _op_regions(op: K, ins: Sequence[int | None], outs: Sequence[int | None],
                params: Mapping[str, Any], width, rows, out_width: int | None):
    """(reads, writes) of one primitive op; None operands are FUSED scratch (private).
    width(b) / rows(b): buffer b's columns and its rows (buffer_rows)."""
    reads: list[Region] = []
    writes: list[Region] = []
    if op in _GEMV:
        for i, b in enumerate(ins):        # a K slice reads only its columns of x
            slice_x = i == 0 and b is not None and "k_off" in params
            reads += _cols(b, *k_range(params, width(b)), width) if slice_x else _whole(b, width)
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
        n_parts = combine_partials(params, len(ins)) if op is K.ATTENTION_COMBINE else 0
        # an ATTENTION_TILE of sequences [b_off, b_off+b_count) writes only theirs in a
        # sequence-major partial (split_kv's batched tasks); its other operands stay whole rows
        own_seqs = op is K.ATTENTION_TILE
        for i, b in enumerate(ins):
            # ATTENTION_TILE: q per head, NEW_KV's new k/v rows per kv head; caches and pos
            # whole. COMBINE: every partial per head, its pos (live count) whole. Per head of
            # every sequence in a sequence-major buffer.
            if op is K.ATTENTION_TILE and i >= 4 and kv_cols is not None:
                reads += _cols(b, *kv_cols, width)
            elif i < n_parts or i == 0:
                reads += _seq_head_cols(b, params, in_row, width, rows, False)
            else:
                reads += _whole(b, width)
        for o in outs:
            writes += _seq_head_cols(o, params, out_row, width, rows, own_seqs)
    elif op is K.COPY and "x_off" in params:
        # a column move (slice / concat): columns [x_off, x_off + w) of x -> the output's tile
        lo, hi = _tile_range(params, out_width) or (0, out_width or 0)
        x_off = int(params["x_off"])
        reads += _cols(ins[0], x_off, x_off + hi - lo, width)
        for o in outs:
            writes += _cols(o, lo, hi, width)
    elif op in _TILED_INPUTS or op is K.SUM:
        tile = _tile_range(params, out_width)
        tiled = _TILED_INPUTS.get(op, range(len(ins)))      # SUM: every input
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


# _fused_regions once per (recipe object, operand widths, pattern of repeated operands, order
# of the operands' ids): a decoder's layers repeat each FUSED task over other buffers (the 8B
# shape: 20.8k tasks). The regions are kept over operand positions, sorted as the renamed ones
# sort (by buffer id first, and the ids are distinct: their order is all the sort needs), so a
# task's regions are a renaming, no merge and no sort.
_FUSED = IdentityMemo(limit=100_000)
# every buffer's (columns, rows) of a buffers tuple (immutable, as a Program's): the FUSED key
# reads them for each operand of each task, and Buffer.numel is a product each time
_SHAPES = IdentityMemo(limit=4)
# per buffers tuple, each (inputs, outputs) pair's distinct ids and the number of its operand
# structure (pattern, widths, id order, inputs): the tiles of one op share their operands
# (Qwen3-0.6B: 675 pairs over 18k tasks), so the structure and its key are built once a pair
_OPERANDS = IdentityMemo(limit=4)
# structure -> number, the _FUSED key's rest; numbers are never reused, so an entry of _FUSED
# or _OPERANDS that outlives this table cannot meet another structure's number
_STRUCT_NUMBER: dict[tuple, int] = {}
_NEXT_NUMBER = count()


def _shapes(buffers) -> list[tuple[int, int]] | None:
    if not isinstance(buffers, tuple):
        return None
    return _SHAPES.get(buffers, None, lambda: [(b.cols, buffer_rows(b)) for b in buffers])


def operand_pattern(operands) -> tuple[list[int], tuple[int, ...]]:
    """(the distinct buffers of a task's operands, in order of first use; each operand's index
    among them): two tasks of one recipe with the same pattern alias their operands alike."""
    ids = list(dict.fromkeys(operands))
    if len(ids) == len(operands):
        return ids, tuple(range(len(ids)))
    at = {b: k for k, b in enumerate(ids)}
    return ids, tuple(at[b] for b in operands)


def _structure(inputs, outputs, shape_of) -> tuple[list[int], tuple]:
    """(distinct operand ids, (pattern, widths and rows, rank of each id, number of inputs))."""
    ids, pattern = operand_pattern(inputs + outputs)
    shape = tuple(map(shape_of, ids))
    rank = tuple(sorted(range(len(ids)), key=ids.__getitem__))
    return ids, (pattern, shape, rank, len(inputs))


def _operands(task: Task, buffers: tuple, shapes: list) -> tuple[list[int], int, tuple]:
    """_structure of the task's operands with its number, once per (buffers, operands)."""
    table = _OPERANDS.get(buffers, None, dict)
    key = (task.inputs, task.outputs)
    got = table.get(key)
    if got is None:
        ids, struct = _structure(task.inputs, task.outputs, shapes.__getitem__)
        number = _STRUCT_NUMBER.get(struct)
        if number is None:
            if len(_STRUCT_NUMBER) > 100_000:
                _STRUCT_NUMBER.clear()
            number = _STRUCT_NUMBER[struct] = next(_NEXT_NUMBER)
        got = table[key] = (ids, number, struct)
    return got


def _fused_regions(task: Task, width, rows, buffers=None):
    """Union over recipe steps of the regions on external operands (scratch is private)."""
    recipe = task.params.get("recipe")
    shapes = _shapes(buffers)
    if shapes is not None:
        ids, number, struct = _operands(task, buffers, shapes)
    else:
        ids, struct = _structure(task.inputs, task.outputs, lambda b: (width(b), rows(b)))
        number = struct
    pattern, shape, rank, n_in = struct

    def compute():
        over = _fused_regions_over(recipe, pattern[:n_in], pattern[n_in:],
                                   lambda k: shape[k][0], lambda k: shape[k][1])
        at = {k: i for i, k in enumerate(rank)}        # operand k's place in id order
        return tuple(sorted(rs, key=lambda r: (at[r[0]], r[3], r[4], r[1], r[2])) for rs in over)

    over = _FUSED.get(recipe, number, compute)
    return tuple([new_region((ids[k], lo, hi, r0, r1)) for k, lo, hi, r0, r1 in rs]
                 for rs in over)


def forget_fused_regions() -> None:
    _FUSED.clear()
    _SHAPES.clear()
    _OPERANDS.clear()
    _STRUCT_NUMBER.clear()


def _fused_regions_over(recipe, inputs: Sequence[int], outputs: Sequence[int], width, rows):
    reads: list[Region] = []
    writes: list[Region] = []
    for step in parse_recipe(recipe).steps:
        ins = [inputs[a.index] if a.kind == INPUT else None for a in step.args]
        if step.out.kind == OUTPUT:
            o: int | None = outputs[step.out.index]
            ow: int | None = width(o)
        else:
            o = None
            ow = step.out_shape[-1] if step.out_shape else None
        r, w = _op_regions(step.op, ins, [o], step.params, width, rows, ow)
        reads += r
        writes += w
    return merge(reads), merge(writes)


def _order(r: Region) -> tuple[int, int, int, int, int]:
    return r.buffer, r.r0, r.r1, r.lo, r.hi


def merge(regions: list[Region]) -> list[Region]:
    """Sorted (by buffer, rows, columns), with overlapping or touching column ranges of one
    buffer and the same rows merged."""
    out: list[Region] = []
    for r in sorted(regions, key=_order):
        last = out[-1] if out else None
        if last and (last.buffer, last.r0, last.r1) == (r.buffer, r.r0, r.r1) and r.lo <= last.hi:
            out[-1] = Region(r.buffer, last.lo, max(last.hi, r.hi), r.r0, r.r1)
        else:
            out.append(r)
    return out


def task_regions(task: Task, buffers: Sequence[Buffer] | Mapping[int, Buffer]
                 ) -> tuple[list[Region], list[Region]]:
    """(reads, writes) of `task`, each a list of Regions (merged per buffer)."""
    def width(bid: int) -> int:
        return buffers[bid].cols

    def rows(bid: int) -> int:
        return buffer_rows(buffers[bid])

    if task.op is K.FUSED:
        return _fused_regions(task, width, rows, buffers)
    out_width = width(task.outputs[0]) if task.outputs else None
    reads, writes = _op_regions(task.op, task.inputs, task.outputs, task.params, width, rows,
                                out_width)
    return merge(reads), merge(writes)
