"""What each GEMV tile of a preset's decode step reads from global memory, on any machine (no
GPU): its weights (the tile's rows of the weight, scales, zeros, bias) against its activations
(x, read whole by every tile of the op, or its K slice, and the residual rows it adds), per task
kind and layer, from the lowered program the cuda backend runs (meta weights; quantized ones on
the CPU over 2 layers). At batch 1 x is a few KB a tile; at batch 16 an unsplit down tile read as
many bytes of x as of weights (NOTES v48), so down is tiled rows x K there now (passes/tile.split_k:
a quarter of x a tile). The last columns say what tiling rows x K would do to a kind (C
K-slices: x / C a tile, its outputs as C fp32 partials to add). The plan columns come from the
CUDA lowering of the same program: the GEMV function a tile runs and, for the tensor-core GEMV
(op_gemv_mma, gemv_batch.plan), its passes over the weights (8 NB rows of x a pass: each pass
reads the tile's weights again), x windows and ring stages a warp (1: no load in flight while
it computes); "SM reads" = weights x passes + activations, what the tile pulls into its SM.
A folded split-KV combine (the o tiles at batch 1) is counted with every shard's partial; at run
time it reads only the live ones (regions.live_shards: one at context 128, P at P x 128 rows).

    python bench/traffic.py --model llama-3.2-1b --batch 16
    python bench/traffic.py --model qwen3-0.6b --batch 1 4 16 64 --json /tmp/traffic.json
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "profile"))
sys.path.append(str(Path(__file__).resolve().parent.parent))   # amk without PYTHONPATH
from gpu_tool import parser  # noqa: E402

READ_ONLY = ("WEIGHT", "CONST")


def step_reads(op, ins, params, out_cols) -> tuple[float, float]:
    """(weight bytes, activation bytes) one step reads from global memory (None: on-chip
    scratch): a GEMV's weight-like inputs by its tile's share of rows, x whole, the rest by the
    tile's share of columns (a residual, a bias); any other step's inputs by the columns it
    writes, as passes/cost.py counts them."""
    from amk.passes.cost import GEMV, nbytes
    from amk.program.regions import k_range
    w_bytes = a_bytes = 0.0
    gemv = op in GEMV and len(ins) >= 2 and ins[1] is not None
    if gemv:
        n, k = ins[1].shape[0], int(params.get("K", ins[1].shape[-1]))
        lo, hi = k_range(params, k)
        kf = (hi - lo) / max(k, 1)                                   # a K slice's share (split_k)
        frac = min(1.0, int(params.get("N_tile", n)) / max(n, 1)) * kf
    else:
        n_tile = int(params.get("N_tile", 0))
        frac = min(1.0, n_tile / out_cols) if n_tile and out_cols else 1.0
    for i, b in enumerate(ins):
        if b is None:
            continue
        f = kf if (gemv and i == 0) else frac if (gemv or b.cols == out_cols) else 1.0
        if b.kind.name in READ_ONLY:
            w_bytes += nbytes(b) * f
        else:
            a_bytes += nbytes(b) * f
    return w_bytes, a_bytes


def task_reads(task, bufs) -> tuple[float, float, int] | None:
    """(weight bytes, activation bytes, output columns) of a task with a GEMV step, else None."""
    from amk.passes.cost import GEMV
    from amk.program.ir import InstructionKind as K
    from amk.program.recipe import INPUT, OUTPUT, recipe_of
    if task.op is not K.FUSED:
        steps = [(task.op, [bufs[b] for b in task.inputs], task.params,
                  bufs[task.outputs[0]] if task.outputs else None)]
    else:
        steps = [(st.op, [bufs[task.inputs[a.index]] if a.kind == INPUT else None for a in st.args], st.params,
                  bufs[task.outputs[st.out.index]] if st.out.kind == OUTPUT else None)
                 for st in recipe_of(task).steps]
    if not any(op in GEMV for op, *_ in steps):
        return None
    w = a = 0.0
    cols = 0
    for op, ins, params, out in steps:
        oc = out.cols if out is not None else 0
        dw, da = step_reads(op, ins, params, oc)
        w, a = w + dw, a + da
        if op in GEMV:
            cols = max(cols, int(params.get("N_tile", oc)))
    return w, a, cols


def tile_plan(low, tid: int) -> tuple[str, int]:
    """(the plan in words, passes over the weights) of a lowered GEMV task: its GEMV step's
    function, and for op_gemv_mma NB, passes, x windows, ring stages and x through the ring."""
    from amk.backends.cuda import abi
    d = low.tasks[tid]
    steps = low.tasks[int(d["sub_begin"]):int(d["sub_begin"]) + int(d["n_sub"])] if int(d["n_sub"]) else [d]
    for s in steps:
        v = low.variants[int(s["variant"])] if int(s["variant"]) >= 0 else None
        if v is None or not v.fn.startswith("op_gemv"):
            continue
        if v.fn != "op_gemv_mma":
            return v.fn, 1
        ip = {n: int(s["ip"][abi.ip_index("GEMV", n)]) for n in ("M", "K", "KW", "RD", "KLO", "KHI")}
        k = ip["KHI"] - ip["KLO"] if v.arg("ks") else ip["K"]        # a K slice's share of K
        passes = -(-ip["M"] // (8 * v.arg("nb")))
        windows = "x in the ring" if v.arg("xr") else f"{-(-k // ip['KW'])} window(s)"
        return f"mma NB {v.arg('nb')}, {passes} pass(es), {windows}, ring {ip['RD']}", passes
    return "-", 1


def kinds(model: str, batch: int, quant: str | None, layers: int | None) -> list[dict]:
    """One row a GEMV task kind: tasks a layer, KB a task of weights and of activations, the
    CUDA plan of its first tile and what a tile pulls into its SM."""
    from amk.backends.cuda.lower import lower_program
    from amk.models.presets import PRESETS, random_model
    from profile_decode import task_kind, task_layer
    cfg = PRESETS[model]
    n_layers = layers or (2 if quant else cfg.n_layers)
    m = random_model(replace(cfg, n_layers=n_layers), device="cpu" if quant else "meta")
    if quant:
        m.quantize(quant)
    prog = m.lower(backend="cuda", batch=batch).program
    low = lower_program(prog)
    acc: dict[str, list] = defaultdict(lambda: [0, 0.0, 0.0, 0])
    plans: dict[str, tuple[str, int]] = {}
    for t in prog.tasks:
        r = task_reads(t, prog.buffers)
        if r is None:
            continue
        k = task_kind(t, prog.buffers)
        plans.setdefault(k, tile_plan(low, t.id))
        row = acc[k]
        row[0] += 1
        row[1] += r[0]
        row[2] += r[1]
        row[3] = max(row[3], r[2])
        row.append(task_layer(t, prog.buffers))
    out = []
    for k, (n, w, a, cols, *lay) in acc.items():
        per_layer = n // max(len(set(lay)), 1)
        plan, passes = plans[k]
        out.append({"kind": k, "tasks_a_layer": per_layer, "weight_kb": w / n / 1024, "act_kb": a / n / 1024,
                    "act_share": a / (a + w) if a + w else 0.0, "cols": cols, "plan": plan,
                    "passes": passes, "sm_kb": (w * passes + a) / n / 1024})
    return sorted(out, key=lambda r: -r["weight_kb"] * r["tasks_a_layer"])


def rows_by_k(row: dict, batch: int, c: int) -> tuple[float, float]:
    """(activation KB, fp32 partial KB written) a task if the op were tiled rows x K with c
    K-slices and as many tasks: x / c (the residual and bias stay), c times the rows a tile."""
    partial = row["cols"] * c * batch * 4 / 1024
    return row["act_kb"] / c, partial


def table(model: str, batch: int, quant: str | None, rows: list[dict]) -> str:
    lines = [f"{model} batch {batch} {quant or 'bf16'} (KB a task)",
             "kind | tasks a layer | weights | activations | act share | C=2 act / partials | "
             "C=4 act / partials | plan (cuda) | SM reads",
             "---|---|---|---|---|---|---|---|---"]
    for r in rows:
        c2, c4 = rows_by_k(r, batch, 2), rows_by_k(r, batch, 4)
        lines.append(f"{r['kind']} | {r['tasks_a_layer']} | {r['weight_kb']:.1f} | {r['act_kb']:.1f} | "
                     f"{100 * r['act_share']:.0f}% | {c2[0]:.1f} / {c2[1]:.1f} | {c4[0]:.1f} / {c4[1]:.1f} | "
                     f"{r['plan']} | {r['sm_kb']:.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    from amk.models.presets import PRESETS
    ap = parser(__doc__)
    ap.add_argument("--model", default="llama-3.2-1b", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--quant", default=None, choices=["int8", "int4", "fp8"])
    ap.add_argument("--layers", type=int, default=None, help="layers to build (default: the preset's; 2 with --quant)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if any(b < 1 for b in a.batch):
        ap.error(f"--batch must be >= 1, got {a.batch}")
    report = []
    for b in a.batch:
        rows = kinds(a.model, b, a.quant, a.layers)
        print(table(a.model, b, a.quant, rows) + "\n")
        report.append({"model": a.model, "batch": b, "quant": a.quant, "rows": rows})
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
