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

A batched GEMV whose x is large next to its weights (down at batch 16: 256 KB of x for 256 KB
of weights a tile, every tile reading all of x) is split over K as well (split_k): R row tiles
x C K slices, each writing fp32 partial sums of its rows to one of C partial buffers, then a SUM
a row tile adds the C partials in order (into which `fuse` folds the residual ADD). Each tile
then reads 1 / C of x. Not where x comes from a norm (the norm needs whole rows) or the GEMV
has a bias.

A `whole_ops` target (the triton backend: one launch per task, its grid spreads the op) gets
no tiles at all: splitting an op there only adds launches.
"""
from __future__ import annotations

from amk.passes.options import PassOptions
from amk.gcpause import without_gc
from amk.passes.sync import rebuilt, rethreshold
from amk.program.ir import (Buffer, BufferKind, DType, InstructionKind as K, Program, Task, Wait,
                            new_task)

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


NORMS = (K.RMSNORM, K.LAYERNORM)
SPLIT_K_ALIGN = 256               # a K slice's columns: whole segments of every GEMV kernel
SPLIT_K_ROWS_MAX = 16             # rows of x the bytes rule splits at most (bf16 weights only)


def split_k(task: Task, bufs, w: int, writer: K | None, opts: PassOptions) -> int:
    """K slices for a GEMV tiled w columns wide: the most (at most 4) whose x bytes saved a tile
    (x is read by every tile) beat the partials' traffic and the SUM's stage (three task
    overheads at one SM's share of the bandwidth), for bf16 weights and at most
    SPLIT_K_ROWS_MAX rows of x; 1: no split. opts.k_split forces a count where the split is
    legal: x of several rows, not from a norm, no bias, and what the cuda backend's
    tensor-core GEMV runs over a slice (bf16 x; bf16 weights, or quantized ones in groups of
    whole 128-element k-blocks; slices of whole 256-element segments: k stays absolute, so a
    slice needs no group alignment of its own)."""
    x, wt = bufs[task.inputs[0]], bufs[task.inputs[1]]
    k = int(task.params.get("K", x.cols))
    m = x.numel // max(k, 1)
    quant = bool(task.params.get("qdtype"))
    group = int(task.params.get("group", k)) if quant else 0
    legal = (m >= 2 and writer not in NORMS and not task.params.get("bias")
             and (quant or len(task.inputs) == 2) and len(wt.shape) == 2
             and "k_off" not in task.params and x.dtype is DType.BF16
             and (group % 128 == 0 if quant else wt.dtype is DType.BF16))
    cs = [c for c in (4, 2) if legal and k % (c * SPLIT_K_ALIGN) == 0]
    if opts.k_split is not None:
        return int(opts.k_split) if int(opts.k_split) in cs else 1
    if quant or m > SPLIT_K_ROWS_MAX:   # measured slower there (NOTES v49): int4 at batch 16
        return 1                        # +7%, batch 64 +11%, where bf16 at 16 won 3.5%
    t = opts.target
    # the SUM's stage: its task and a hand-off on each side, at one SM's share of the bandwidth
    # (3 overheads: batch 16 won, -3.5% on an H200 and -5.2% on an H100, saving 160 KB a tile;
    # batch 8, saving 80, lost +5.5% on an H100, NOTES v49)
    hand_off = 3 * t.task_overhead_ns * 1e-9 * t.mem_bw / max(t.num_sms, 1)
    xb = x.numel * x.dtype.itemsize
    for c in cs:
        partials = 2 * c * m * min(w * c, wt.shape[0]) * 4          # written, then read
        if xb * (1 - 1 / c) - partials > hand_off:
            return c
    return 1


def _split_k_tiles(task: Task, grid: list[tuple[int, int]], c: int, parts: list[Buffer],
                   y: int, counter: int) -> list[Task]:
    """R x C K-slice tiles (each into partial buffer kc), then R SUM tasks into y (counter)."""
    k = int(task.params.get("K", 0))
    kt = k // c
    n = len(grid)
    out = [new_task(task.id, task.op, task.inputs, (parts[kc].id,),
                    {**task.params, "n_off": lo, "N_tile": w, "k_off": kc * kt, "K_tile": kt},
                    task.waits, task.out_counter, f"{task.name}[tile {i}/{n}, k {kc}/{c}]")
           for i, (lo, w) in enumerate(grid) for kc in range(c)]
    out += [new_task(task.id, K.SUM, tuple(p.id for p in parts), (y,), {"n_off": lo, "N_tile": w},
                     (Wait(task.out_counter, 0),), counter, f"{task.name}[sum {i}/{n}]")
            for i, (lo, w) in enumerate(grid)]
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
    writer: dict[int, K] = {}                        # buffer -> the op that last wrote it
    added: list[Buffer] = []                         # split_k's partial buffers
    summed: dict[int, int] = {}                      # a split GEMV's counter -> its SUMs'
    gemv_out: set[int] = set()                       # the outputs of GEMVs
    next_counter = max((t.out_counter for t in program.tasks), default=0) + 1
    out: list[Task] = []
    for t in program.tasks:
        new = [t]
        if t.op in GEMV and t.outputs:
            y = bufs[t.outputs[0]]
            n = y.cols
            gemv_out.add(y.id)
            if _untiled(t, n):
                row_bytes = sum(bufs[b].nbytes for b in t.inputs[1:]) / max(n, 1)
                w = gemv_tile_cols(n, row_bytes, opts, stage.get(t.id))
                c = split_k(t, bufs, w, writer.get(t.inputs[0]), opts) if t.inputs else 1
                w = min(n, w * c)
                grid = [(lo, min(w, n - lo)) for lo in range(0, n, w)]
                if c > 1:
                    first = len(bufs) + len(added)
                    parts = [Buffer(first + i, f"{y.name}.k{i}", BufferKind.ACTIVATION, DType.F32,
                                    y.shape) for i in range(c)]
                    added += parts
                    summed[t.out_counter] = next_counter
                    new = _split_k_tiles(t, grid, c, parts, y.id, next_counter)
                    next_counter += 1
                    grid_of[y.id] = grid
                elif len(grid) > 1:
                    new = _split(t, grid)
                    grid_of[y.id] = grid
        elif t.op in ELEMENTWISE and t.outputs and "n_off" not in t.params:
            y = bufs[t.outputs[0]]
            same = all(bufs[b].shape == y.shape for b in t.inputs)
            # a GEMV's grid (a split GEMV's: its SUMs') before an elementwise op's: `fuse`
            # folds the op into the tiles that write its GEMV input
            grid = next((grid_of[b] for b in sorted(t.inputs, key=lambda b: b not in gemv_out)
                         if b in grid_of), None)
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
        for task in new:
            writer.update((b, task.op) for b in task.outputs)
    if len(out) == len(program.tasks):
        return program
    if summed:          # a split GEMV's readers wait for its SUMs, which wait for its tiles
        out = [t if t.op is K.SUM or not any(w.counter in summed for w in t.waits) else
               rebuilt(t, waits=tuple(Wait(summed.get(w.counter, w.counter), w.threshold)
                                      for w in t.waits))
               for t in out]
    # each tile keeps its op's waits and counter: only thresholds change (= tile counts)
    return rethreshold(program.with_(tasks=tuple(out), queues=(), buffers=bufs + tuple(added)))
