"""Where the megakernel's time goes: one profiled decode step of a preset shape (--model,
default Llama-3.2-1B; a cache of --max-seq rows, default 8192; before v21 the profile sized the
cache to the context).

Builds the cuda step with AMK_PROFILE=1 (each CTA records %globaltimer at every task's wait
start, wait end and end), runs a few warm steps, and prints from the last one:
  * per task kind: count, wait and run time (sum over CTAs, mean per task), bytes per run us,
    the FUSED steps' times and the intervals between a plain task's AMK_MARK points;
  * per SM: busy (run) time, waiting time, idle tail;
  * the stage timeline of one middle layer (first run start .. last end of each stage);
  * the span of the whole step.

    python bench/profile/profile_decode.py --context 1024 [--model qwen3-0.6b] [--max-seq 8192]
        [--batch 16] [--quant int4] [--layers 16] [--json out.json]
"""
from __future__ import annotations

import collections
import json
import os
import re
import sys
from pathlib import Path

os.environ["AMK_PROFILE"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # amk and bench without PYTHONPATH

from amk.passes.cost import task_cost  # noqa: E402
from amk.program.ir import BufferKind, InstructionKind as K  # noqa: E402
from amk.program.recipe import recipe_of  # noqa: E402
from bench.gpu_tool import have_gpu, parser  # noqa: E402
from amk.models.presets import PRESETS  # noqa: E402
from amk.quant import FORMATS  # noqa: E402
from bench.preset_step import cuda_step  # noqa: E402

_LAYER = re.compile(r"(?:layers|kv)\.(\d+)\.")


_QUANT_PARTS = ("q", "scales", "zeros")   # a quantized weight's buffers: <matrix>.q, .scales, ...


def task_kind(task, bufs) -> str:
    """A short name: the 2-D weight it streams (wq, w_gate, lm_head...; a quantized one by its
    matrix, not its .q buffer) or its op(s)."""
    ops = ([s.op.name for s in recipe_of(task).steps]
           if task.op is K.FUSED else [task.op.name])
    for b in task.inputs:
        buf = bufs[b]
        if buf.kind is BufferKind.WEIGHT and len(buf.shape) == 2:
            parts = buf.name.split(".")
            name = parts[-2] if parts[-1] in _QUANT_PARTS and len(parts) > 1 else parts[-1]
            return name + ("+" + "+".join(o for o in ops if o != "GEMV_TILE") if len(ops) > 1 else "")
    if "ATTENTION_TILE" in ops:
        return "attention"
    return "+".join(ops).lower()


def task_layer(task, bufs) -> int:
    for b in task.inputs + task.outputs:
        m = _LAYER.search(bufs[b].name + ".")
        if m:
            return int(m.group(1))
    return -1


def summarise(prog, rows, steps: dict | None = None, marks: dict | None = None) -> dict:
    """rows: CudaProgram.profile(); steps: CudaProgram.profile_steps() (FUSED step starts);
    marks: CudaProgram.profile_marks() (AMK_MARK points inside the tasks' device functions)."""
    bufs, tasks = prog.buffers, prog.tasks
    t0 = min(r[2] for r in rows)
    t_end = max(r[4] for r in rows)
    kinds = collections.defaultdict(lambda: {"n": 0, "wait_us": 0.0, "run_us": 0.0, "bytes": 0.0})
    per_cta = collections.defaultdict(lambda: {"run": 0.0, "wait": 0.0, "end": 0.0})
    stages = collections.defaultdict(lambda: [float("inf"), 0.0, 0])
    for tid, q, w0, w1, e, sm, ready in rows:
        t = tasks[tid]
        k = task_kind(t, bufs)
        d = kinds[k]
        d["n"] += 1
        d["wait_us"] += (w1 - w0) / 1e3
        d["run_us"] += (e - w1) / 1e3
        d["bytes"] += task_cost(t, bufs).bytes
        st = (steps or {}).get(tid)
        mk = (marks or {}).get(tid)
        if mk:                                 # wait end -> ready -> each mark -> end: us summed
            pts = [("w", w1), ("r", ready)] + timeline(st, mk) + [("e", e)]
            md, mn = d.setdefault("marks", {}), d.setdefault("marks_n", {})
            d["n_marked"] = d.get("n_marked", 0) + 1
            for (a, ta), (b, tb) in zip(pts, pts[1:]):   # a dead shard has fewer intervals
                md[f"{a}>{b}"] = md.get(f"{a}>{b}", 0.0) + (tb - ta) / 1e3
                mn[f"{a}>{b}"] = mn.get(f"{a}>{b}", 0) + 1
        if st:                                 # per lowered step: us summed over the kind's tasks
            ends = [s for _, s in st[1:]] + [e]
            sd = d.setdefault("steps", {})
            for j, ((op, a), b) in enumerate(zip(st, ends)):
                key = f"{j}:{K(op).name}"
                sd[key] = sd.get(key, 0.0) + (b - a) / 1e3
        c = per_cta[q]
        c["run"] += (e - w1) / 1e3
        c["wait"] += (w1 - w0) / 1e3
        c["end"] = max(c["end"], (e - t0) / 1e3)
        s = stages[(task_layer(t, bufs), k)]
        s[0] = min(s[0], (w1 - t0) / 1e3)
        s[1] = max(s[1], (e - t0) / 1e3)
        s[2] += 1
    return {"span_us": (t_end - t0) / 1e3, "kinds": dict(kinds), "per_cta": dict(per_cta),
            "stages": {f"{l}:{k}": v for (l, k), v in stages.items()}}


def timeline(st: list | None, mk: list) -> list:
    """A task's points between ready and its end: a plain task's marks as "k"; a FUSED task's
    step starts as "s<j>" each followed by that step's marks as "<j>.k"; a step's marks in the
    order they were passed (a mark's number need not be its place)."""
    mk = sorted(mk, key=lambda m: (m[0], m[2]))
    if not st:
        return [(str(k), v) for _, k, v in mk]
    out = []
    for j, (_, start) in enumerate(st):
        out.append((f"s{j}", start))
        out += [(f"{j}.{k}", v) for s, k, v in mk if s == j]
    return out


def run_profiled(step, args, steps: int):
    """Run a profiled amk.jit step `steps` times: (executable, bindings, program, the last
    run's rows, their summary)."""
    exe, bindings = step.executable(*args)
    for _ in range(steps):
        exe.run(bindings)
    rows = exe.profile()
    prog = step.lower(*args).program
    return exe, bindings, prog, rows, summarise(prog, rows, exe.profile_steps(), exe.profile_marks())


def steps_line(d: dict) -> str:
    """A kind's FUSED steps, mean us a task each."""
    return "steps us/task: " + ", ".join(f"{k} {v / d['n']:.2f}" for k, v in d["steps"].items())


def marks_line(d: dict) -> str:
    """A kind's AMK_MARK intervals (w: wait end, r: ready, s<j>: FUSED step j's start, e: task
    end), each the mean us over the tasks that had it, their count in brackets where it is not
    every marked task's (a dead split-KV shard returns after its first mark: 0>e)."""
    n, mn = d["n_marked"], d["marks_n"]
    return (f"marks us/task ({n} of {d['n']} tasks): "
            + ", ".join(f"{k} {v / mn[k]:.2f}" + ("" if mn[k] == n else f" [{mn[k]}]")
                        for k, v in d["marks"].items()))


def print_summary(s: dict, mid_layer: int) -> None:
    print(f"\nstep span {s['span_us']:.1f} us")
    print(f"{'kind':>28} {'n':>6} {'wait us':>10} {'run us':>10} {'run/task':>9} "
          f"{'wait/task':>9} {'GB/s/SM':>8}")
    for k, d in sorted(s["kinds"].items(), key=lambda kv: -kv[1]["run_us"]):
        n = d["n"]
        gbs = d["bytes"] / (d["run_us"] * 1e3) if d["run_us"] else 0.0
        print(f"{k:>28} {n:>6} {d['wait_us']:>10.0f} {d['run_us']:>10.0f} "
              f"{d['run_us'] / n:>9.2f} {d['wait_us'] / n:>9.2f} {gbs:>8.1f}")
        if d.get("steps"):
            print(" " * 30 + steps_line(d))
        if d.get("marks"):
            print(" " * 30 + marks_line(d))
    runs = sorted(c["run"] for c in s["per_cta"].values())
    waits = sorted(c["wait"] for c in s["per_cta"].values())
    ends = sorted(c["end"] for c in s["per_cta"].values())
    pct = lambda v, f: v[min(len(v) - 1, int(f * len(v)))]  # noqa: E731
    print(f"per CTA run us: min {runs[0]:.0f} p50 {pct(runs, .5):.0f} max {runs[-1]:.0f}; "
          f"wait us: min {waits[0]:.0f} p50 {pct(waits, .5):.0f} max {waits[-1]:.0f}; "
          f"end us: min {ends[0]:.0f} max {ends[-1]:.0f}")
    print(f"stages of layer {mid_layer} (us from step start: first run start, last end, tasks):")
    mine = [(v, k) for k, v in s["stages"].items() if k.split(":")[0] == str(mid_layer)]
    prev_end = None
    for v, k in sorted(mine):
        gap = "" if prev_end is None else f" (starts {v[0] - prev_end:+.1f} after previous end)"
        print(f"  {k:>30}: {v[0]:8.1f} .. {v[1]:8.1f}  = {v[1] - v[0]:6.1f} us, {v[2]} tasks{gap}")
        prev_end = v[1]
    per_layer = []
    for l in range(0, 64):
        st = [v for k, v in s["stages"].items() if k.split(":")[0] == str(l)]
        if not st:
            break
        per_layer.append(max(v[1] for v in st) - min(v[0] for v in st))
    if per_layer:
        print("layer spans us: " + " ".join(f"{x:.0f}" for x in per_layer))
    rest = [(k, v) for k, v in s["stages"].items() if k.split(":")[0] == "-1"]
    for k, v in sorted(rest, key=lambda kv: kv[1][0]):
        print(f"  {k:>30}: {v[0]:8.1f} .. {v[1]:8.1f}  = {v[1] - v[0]:6.1f} us, {v[2]} tasks")


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--model", default="llama-3.2-1b", choices=sorted(PRESETS),
                    help="the preset shape (default %(default)s)")
    ap.add_argument("--max-seq", type=int, default=8192, help="KV cache rows (default %(default)s)")
    ap.add_argument("--batch", type=int, default=1, help="sequences a step (default %(default)s)")
    ap.add_argument("--quant", default=None, choices=sorted(FORMATS),
                    help="weight-only quantized linears and LM head (Model.quantize)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--raw", action="store_true",
                    help="also put every task's row (task, queue, wait start/end, end ns, SM, ready ns) in the JSON")
    a = ap.parse_args(argv)
    if not have_gpu(__file__):
        return 2
    step, args, cfg = cuda_step(a.context, a.layers, a.model, a.max_seq, a.batch, a.quant)
    exe, bindings, prog, rows, s = run_profiled(step, args, a.steps)
    knobs = {k: v for k, v in sorted(os.environ.items()) if k.startswith("AMK_")}
    print("knobs set: " + " ".join(f"{k}={v}" for k, v in knobs.items()))
    print(f"{a.model}{' ' + a.quant if a.quant else ''}, batch {a.batch}, context {a.context}, max_seq {a.max_seq}, {len(prog.tasks)} tasks, {exe.grid} CTAs, "
          f"{exe.kernel.num_regs} registers, {exe.kernel.local_bytes} B local")
    print_summary(s, cfg.n_layers // 2)
    if a.json:
        raw = {"rows": [[int(v) for v in r] for r in rows]} if a.raw else {}
        Path(a.json).write_text(json.dumps({"model": a.model, "quant": a.quant, "context": a.context, "max_seq": a.max_seq, "batch": a.batch, **s, **raw}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
