"""The decode step's pieces as small megakernels of their own (Llama-3.2-1B shapes, bf16), each
profiled like bench/profile_decode.py: how long one task of each kind runs when nothing else is
in the kernel. Compared with bench/stream_probe.py (the bare streaming loop) and with the full
step's profile, it says whether time is lost in the GEMV, in what is fused around it, or in the
rest of the step (bench/NOTES.md v9).

    python bench/probe_programs.py [--json out.json]
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["AMK_PROFILE"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # amk without PYTHONPATH
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from gpu_tool import have_gpu, parser  # noqa: E402  (bench/ is sys.path[0] for a script)

import amk  # noqa: E402
from amk import ops  # noqa: E402
from profile_decode import marks_line, run_profiled, steps_line, task_kind  # noqa: E402

H, F = 2048, 8192


def linear_only(p, x):
    return ops.linear(x, p["w_gate"])


def down_only(p, x):
    return ops.linear(p["x8"], p["w_down"])


def many_tiles(p, x):
    return ops.linear(x, p["w_big"])


def norm_linear(p, x):
    return ops.linear(ops.rmsnorm(x, p["norm_w"]), p["w_gate"])


def _mlp_in(p, x, i):
    h = ops.rmsnorm(x, p["norm_w"])
    return ops.silu_mul(ops.linear(h, p["w_gate" + i]), ops.linear(h, p["w_up" + i]))


def _mlp(p, x, i):
    return ops.add(x, ops.linear(_mlp_in(p, x, i), p["w_down" + i]))


def mlp_in(p, x):
    return _mlp_in(p, x, "")


def mlp(p, x):
    return _mlp(p, x, "")


def two_mlps(p, x):
    return _mlp(p, _mlp(p, x, ""), "2")


def attention_x8(p, x):
    """Eight independent decode attentions (rope'd q, 1088-row caches, pos 1023): ~4 attention
    tasks a queue back to back, so a task's time can be compared with the one before it on
    the same SM (a warm instruction cache and TLB)."""
    q = ops.rope(p["q"], p["pos"], 64, inv_freq=p["inv"])
    return tuple(ops.attention(q, p[f"k{i}"], p[f"v{i}"], p["pos"], 32, 8, 64) for i in range(8))


def by_queue_rank(rows, kind_of) -> dict:
    """Mean run us of a kind's tasks by their rank among that kind on their queue (0 = first)."""
    seen, acc = {}, {}
    for tid, q, w0, w1, e, sm in sorted(rows, key=lambda r: (r[1], r[3])):
        k = kind_of(tid)
        r = seen[(q, k)] = seen.get((q, k), -1) + 1
        acc.setdefault((k, r), []).append((e - w1) / 1e3)
    return {f"{k}#{r}": sum(v) / len(v) for (k, r), v in sorted(acc.items())}


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--json", default=None)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cases", nargs="*", default=None, help="only the cases whose name has one of these")
    a = ap.parse_args(argv)
    if not have_gpu(__file__):
        return 2
    g = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s: (torch.randn(*s, device="cuda", generator=g) * 0.02).to(torch.bfloat16)  # noqa: E731
    x = rnd(1, H)
    t = {"norm_w": rnd(H) + 1, "x8": rnd(1, F), "w_big": rnd(16 * F, H), "w_gate": rnd(F, H), "w_up": rnd(F, H), "w_down": rnd(H, F),
         "w_gate2": rnd(F, H), "w_up2": rnd(F, H), "w_down2": rnd(H, F)}
    t.update({"q": rnd(1, H), "pos": torch.tensor([1023], dtype=torch.int32, device="cuda"),
              "inv": 1.0 / (10000.0 ** (torch.arange(0, 64, 2, device="cuda").float() / 64))})
    t.update({f"{c}{i}": rnd(1, 1088, 8, 64) for c in "kv" for i in range(8)})
    cases = [("attention x8", attention_x8), ("linear [8192,2048]", linear_only), ("linear [2048,8192]", down_only),
             ("linear [131072,2048]", many_tiles), ("norm+linear", norm_linear), ("norm+gate+up+silu", mlp_in),
             ("mlp", mlp), ("two mlps", two_mlps)]
    out = {}
    for name, fn in cases:
        if a.cases and not any(c in name for c in a.cases):
            continue
        args = (t, x)
        step = amk.jit(fn, backend="cuda", weights=("p",))
        exe, bindings, prog, rows, s = run_profiled(step, args, a.steps)
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev0.record()
        for _ in range(20):
            exe.run(bindings, check=False)
        ev1.record()
        torch.cuda.synchronize()
        print(f"\n== {name}: {len(prog.tasks)} tasks, span {s['span_us']:.1f} us, "
              f"call {ev0.elapsed_time(ev1) / 20 * 1e3:.1f} us, {exe.kernel.num_regs} regs")
        for k, d in sorted(s["kinds"].items(), key=lambda kv: -kv[1]["run_us"]):
            n = d["n"]
            print(f"  {k:>28} n={n:<4} run/task {d['run_us'] / n:7.2f} us  wait/task {d['wait_us'] / n:7.2f} us  "
                  f"{d['bytes'] / (d['run_us'] * 1e3):6.1f} GB/s/SM")
            if d.get("steps"):
                print(" " * 32 + steps_line(d))
            if d.get("marks"):
                print(" " * 32 + marks_line(d))
        ranks = by_queue_rank(rows, lambda tid: task_kind(prog.tasks[tid], prog.buffers))
        print("  by rank on its queue (run us): " + ", ".join(f"{k} {v:.2f}" for k, v in ranks.items()
                                                             if "attention" in k.lower()))
        out[name] = {"span_us": s["span_us"], "kinds": s["kinds"], "stages": s["stages"], "ranks": ranks}
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
