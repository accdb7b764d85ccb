"""tile: split GEMV/GEMM tasks into output-column tiles (n_off, N_tile); sibling tiles share one
counter (consumers wait threshold = tile count, the seed's convention, until allocate_counters).

Tile width, when `opts.tile_n` is None (all widths are multiples of target.min_tile_cols, 8 on
an H200):
  * about one tile per SM for the op's stage: ceil(N / num_sms) columns, where N counts every
    GEMV that reads the same x (q, k and v share one stage; gate and up, fused tile by tile
    later, count once);
  * but no tile streams more than target.max_tile_bytes (4 MiB on an H200: one tile per SM even
    for the LM head, so its norm and x staging happen once per SM, not once per 256 KiB).
Llama-3.2-1B on 132 SMs: q/k/v 24 cols (96 KiB; 86 + 22 + 22 tiles), o 16 cols (64 KiB),
gate/up 64 cols (256 KiB each, 512 KiB fused), down 16 cols (256 KiB), LM head 976 cols (3.9
MiB, 132 tiles).

Column-tiled elementwise ops (ADD, SILU_MUL, MUL, GELU, COPY) that read a tiled GEMV's output,
and whose operands all have the output's shape, get the same tiles: that lets `fuse` fold them
into the producing tile. A ROPE whose output is an attention's q is tiled per kv-head group (so
each split-KV task can recompute just its heads' rope).

A `whole_ops` target (the triton backend: one launch per task, its grid spreads the op) gets
no tiles at all: splitting an op there only adds launches.
"""
from __future__ import annotations

from amk.passes.options import PassOptions
from amk.gcpause import without_gc
from amk.passes.sync import rethreshold
from amk.program.ir import InstructionKind as K, Program, Task, new_task

GEMV = (K.GEMV_TILE, K.GEMM_TILE)
ELEMENTWISE = (K.ADD, K.SILU_MUL, K.MUL, K.GELU, K.COPY)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def gemv_tile_cols(n: int, row_bytes: float, opts: PassOptions, stage_cols: int | None = None) -> int:
    """Output columns per tile for an op with n output columns and row_bytes of weight each;
    stage_cols: the columns of every GEMV of its stage (_stage_cols), when it has company."""
    if opts.tile_n is not None:
        return max(1, min(int(opts.tile_n), n))
    t = opts.target
    m = t.min_tile_cols
    per_sm = _round_up(-(-(stage_cols or n) // t.num_sms), m)
    cap = max(m, int(t.max_tile_bytes // max(row_bytes, 1.0)) // m * m)
    return max(1, min(n, max(m, min(per_sm, cap))))


def _stage_cols(program: Program) -> dict[int, int]:
    """GEMV task id -> output columns of its stage: the GEMVs that read the same x run at the
    same time (q, k and v after one norm), so they share the SMs: tiled together they take
    about one tile per SM in all, not one per SM each (192 tiles on 132 SMs = two rounds).
    Two GEMVs whose outputs meet in one elementwise op (gate and up -> silu_mul) are fused
    tile by tile later, so the pair counts once. GEMVs alone in their stage are left out."""
    bufs = program.buffers
    stages: dict[int, list[Task]] = {}
    for t in program.tasks:
        if t.op in GEMV and t.outputs and len(t.inputs) >= 2 and _untiled(t, bufs[t.outputs[0]].cols):
            stages.setdefault(t.inputs[0], []).append(t)
    ew_inputs = [e.inputs for e in program.tasks if e.op in ELEMENTWISE]
    out: dict[int, int] = {}
    for ts in stages.values():
        if len(ts) < 2:
            continue
        by_out = {t.outputs[0]: t for t in ts}
        counted = {t.id for t in ts}
        for ins in ew_inputs:
            pair = sorted({by_out[b].id for b in ins if b in by_out})
            if len(pair) == 2:
                counted.discard(pair[1])
        cols = sum(bufs[t.outputs[0]].cols for t in ts if t.id in counted)
        out.update((t.id, cols) for t in ts)
    return out


def _untiled(task: Task, n: int) -> bool:
    p = task.params
    return int(p.get("n_off", 0)) == 0 and int(p.get("N_tile", n)) == n


def _split(task: Task, grid: list[tuple[int, int]]) -> list[Task]:
    n = len(grid)
    return [new_task(task.id, task.op, task.inputs, task.outputs,
                     {**task.params, "n_off": lo, "N_tile": w}, task.waits, task.out_counter,
                     f"{task.name}[tile {i}/{n}]")
            for i, (lo, w) in enumerate(grid)]


@without_gc
def tile(program: Program, opts: PassOptions | None = None) -> Program:
    opts = opts or PassOptions()
    if opts.target.whole_ops and opts.tile_n is None:
        return program
    bufs = program.buffers
    # q inputs of attention: rope producing them is tiled per kv-head group
    attn_q: dict[int, Task] = {}
    for t in program.tasks:
        if t.op is K.ATTENTION_TILE and t.inputs:
            attn_q.setdefault(t.inputs[0], t)

    stage = _stage_cols(program)
    grid_of: dict[int, list[tuple[int, int]]] = {}   # buffer -> the column tiles that write it
    out: list[Task] = []
    for t in program.tasks:
        new = [t]
        if t.op in GEMV and t.outputs:
            y = bufs[t.outputs[0]]
            n = y.cols
            if _untiled(t, n):
                row_bytes = sum(bufs[b].nbytes for b in t.inputs[1:]) / max(n, 1)
                w = gemv_tile_cols(n, row_bytes, opts, stage.get(t.id))
                grid = [(lo, min(w, n - lo)) for lo in range(0, n, w)]
                if len(grid) > 1:
                    new = _split(t, grid)
                    grid_of[y.id] = grid
        elif t.op in ELEMENTWISE and t.outputs and "n_off" not in t.params:
            y = bufs[t.outputs[0]]
            same = all(bufs[b].shape == y.shape for b in t.inputs)
            grid = next((grid_of[b] for b in t.inputs if b in grid_of), None)
            if same and grid:
                new = _split(t, grid)
                grid_of[y.id] = grid
        elif t.op is K.ROPE and t.outputs and t.outputs[0] in attn_q and "n_off" not in t.params:
            a = attn_q[t.outputs[0]].params
            hd, nh = int(a["head_dim"]), int(a["n_heads"])
            nkv = int(a.get("n_kv_heads", nh))
            y = bufs[t.outputs[0]]
            if nkv > 1 and y.cols == nh * hd and bufs[t.inputs[0]].shape == y.shape:
                w = hd * (nh // nkv)
                new = _split(t, [(lo, w) for lo in range(0, y.cols, w)])
        out.extend(new)
    if len(out) == len(program.tasks):
        return program
    # each tile keeps its op's waits and counter: only thresholds change (= tile counts)
    return rethreshold(program.with_(tasks=tuple(out), queues=()))
