"""tile: split GEMV/GEMM tasks into output-column tiles (n_off, N_tile); sibling tiles share one
counter (consumers wait threshold = tile count, the seed's convention, until allocate_counters).

Tile width, when `opts.tile_n` is None (all widths are multiples of target.min_tile_cols = 16):
  * enough tiles that one op alone can keep every SM streaming: ceil(N / num_sms) columns;
  * but no tile streams more than target.max_tile_bytes (256 KiB: ~8 us of one SM's share of
    HBM bandwidth, long enough to hide a task's dispatch and counter wait, short enough that
    the placement can balance), so a wide op (FFN, LM head) gives several tiles per SM.
Llama-3.2-1B on 132 SMs: q/o/k/v 16 cols (64 KiB), gate/up 64 cols (256 KiB), down 16 cols
(256 KiB), LM head 64 cols (2004 tiles); ~13k tasks after fusion.

Column-tiled elementwise ops (ADD, SILU_MUL, MUL, GELU, COPY) that read a tiled GEMV's output,
and whose operands all have the output's shape, get the same tiles: that lets `fuse` fold them
into the producing tile. A ROPE whose output is an attention's q is tiled per kv-head group (so
each split-KV task can recompute just its heads' rope).
"""
from __future__ import annotations

from amk.passes.options import PassOptions
from amk.passes.sync import rethreshold, without_gc
from amk.program.ir import InstructionKind as K, Program, Task

GEMV = (K.GEMV_TILE, K.GEMM_TILE)
ELEMENTWISE = (K.ADD, K.SILU_MUL, K.MUL, K.GELU, K.COPY)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def gemv_tile_cols(n: int, row_bytes: float, opts: PassOptions) -> int:
    """Output columns per tile for an op with n output columns and row_bytes of weight each."""
    if opts.tile_n is not None:
        return max(1, min(int(opts.tile_n), n))
    t = opts.target
    m = t.min_tile_cols
    per_sm = _round_up(-(-n // t.num_sms), m)
    cap = max(m, int(t.max_tile_bytes // max(row_bytes, 1.0)) // m * m)
    return max(1, min(n, max(m, min(per_sm, cap))))


def _untiled(task: Task, n: int) -> bool:
    p = task.params
    return int(p.get("n_off", 0)) == 0 and int(p.get("N_tile", n)) == n


def _split(task: Task, grid: list[tuple[int, int]]) -> list[Task]:
    n = len(grid)
    return [Task(task.id, task.op, task.inputs, task.outputs,
                 {**task.params, "n_off": lo, "N_tile": w}, task.waits, task.out_counter,
                 f"{task.name}[tile {i}/{n}]")
            for i, (lo, w) in enumerate(grid)]


@without_gc
def tile(program: Program, opts: PassOptions | None = None) -> Program:
    opts = opts or PassOptions()
    bufs = program.buffers
    # q inputs of attention: rope producing them is tiled per kv-head group
    attn_q: dict[int, Task] = {}
    for t in program.tasks:
        if t.op is K.ATTENTION_TILE and t.inputs:
            attn_q.setdefault(t.inputs[0], t)

    grid_of: dict[int, list[tuple[int, int]]] = {}   # buffer -> the column tiles that write it
    out: list[Task] = []
    for t in program.tasks:
        new = [t]
        if t.op in GEMV and t.outputs:
            y = bufs[t.outputs[0]]
            n = y.cols
            if _untiled(t, n):
                row_bytes = sum(bufs[b].nbytes for b in t.inputs[1:]) / max(n, 1)
                w = gemv_tile_cols(n, row_bytes, opts)
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
