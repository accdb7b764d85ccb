"""Compile times of a preset's decode step for the cuda backend, on any machine (no GPU: meta
weights, the pass pipeline, the CUDA lowering and NVRTC for sm_90a). Per preset, a cold compile
(an empty AMK_CACHE_DIR) then a warm one (the same folder): wall and CPU seconds, each phase, and
the sha256 of kernel.cu, of the lowered tables and of the final program's repr (a change that
must not change the kernel keeps them). Prints a table; writes JSON.

    python bench/compile.py                                  # every preset but tiny-llama
    python bench/compile.py --models llama-3-8b --profile /tmp/prof   # + cProfile per compile
    python bench/compile.py --no-nvrtc                       # the Python part only
    python bench/compile.py --models llama-3.2-1b --quant int4   # quantized weights

The phases are those of bench/decode.py's compile_times() (step.lower + compile_cuda) and of
CudaProgram's setup: trace, passes (or the pass cache), lower (fold + pack, or its cache),
render, nvrtc (or the cubin cache). As on a GPU, NVRTC starts before the passes' final proof
(Jitted._compile_ahead): on a cold compile "passes" holds the CUDA lowering and the proof, and
"nvrtc" is what is left to wait for of the compile running beside them.
"""
from __future__ import annotations

import cProfile
import gc
import hashlib
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parent.parent))   # amk without PYTHONPATH
from gpu_tool import cache_dir, parser, python_loop_s  # noqa: E402
from amk.quant import FORMATS  # noqa: E402

PHASES = ("trace", "passes", "lower", "render", "nvrtc")


class Clock:
    """Wall and CPU seconds of each phase."""

    def __init__(self):
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def run(self, name, fn, *args, **kw):
        w, c = time.perf_counter(), time.process_time()
        out = fn(*args, **kw)
        self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - w
        self.cpu[name] = self.cpu.get(name, 0.0) + time.process_time() - c
        return out


def tables_digest(low) -> str:
    """sha256 of every field of the lowered tables (numpy arrays as bytes, the rest as repr)."""
    h = hashlib.sha256()
    for name in ("tasks", "waits", "ptr_refs"):
        a = getattr(low, name)
        h.update(name.encode() + repr((a.dtype.descr, a.shape)).encode() + a.tobytes())
    h.update(repr((list(low.variants), low.n_program_tasks, low.ranges, low.scratch_bytes,
                   low.queues)).encode())
    return h.hexdigest()[:16]


def compile_once(model, args, nvrtc: bool) -> tuple[Clock, dict]:
    """One compile as a GPU run does it: step.lower, then the CUDA backend's lowering, source
    and cubin (CudaProgram's setup, the SM count of the pass target)."""
    import torch
    import amk
    from amk.backends.cuda.codegen import render_lowered
    from amk.backends.cuda.compile import compile_source
    from amk.backends.cuda.lowered_cache import lower_program_cached
    clock = Clock()
    step = amk.jit(model.fn, backend="cuda", donate=("kv",))
    # a GPU run starts NVRTC before the program's final proof (Jitted._compile_ahead); meta
    # tensors would not, so this run asks for it as a GPU's would
    gpu = torch.device("cuda")
    if nvrtc and hasattr(type(step), "_compile_ahead"):   # (an older amk under A/B has none)
        step._compile_ahead = lambda backend, _device, opts: type(step)._compile_ahead(
            step, backend, gpu, opts)
    w, c = time.perf_counter(), time.process_time()
    low = step.lower(*args)
    clock.wall["trace"], clock.wall["passes"] = low.timings["trace_s"], low.timings["passes_s"]
    lowered = clock.run("lower", lower_program_cached, low.program, low.options.target.num_sms,
                        low.cuda_options)
    source = clock.run("render", render_lowered, lowered, low.cuda_options)
    hit = None
    if nvrtc:
        hit = clock.run("nvrtc", compile_source, source, "sm_90a",
                        cuda_options=low.cuda_options).cache_hit
    clock.wall["total"], clock.cpu["total"] = time.perf_counter() - w, time.process_time() - c
    # outside the timed part: the digests that a change which must not change the kernel keeps
    info = {"tasks": len(low.program.tasks), "variants": len(lowered.variants),
            "pass_cache_hit": low.timings["cache_hit"],
            "cubin_cache_hit": hit, "kernel_sha": hashlib.sha256(source.encode()).hexdigest()[:16],
            "tables_sha": tables_digest(lowered),
            "program_sha": hashlib.sha256(repr(low.program).encode()).hexdigest()[:16]}
    return clock, info


def measure(name: str, layers: int | None, nvrtc: bool, profile_dir: str | None,
            batch: int = 1, quant: str | None = None) -> dict:
    from amk.models.model import Model
    from amk.models.presets import PRESETS, random_params
    cfg = PRESETS[name]
    cfg = cfg if layers is None else replace(cfg, n_layers=layers)
    model = Model(cfg, random_params(cfg, device="meta"))
    if quant:
        model.quantize(quant)
    args = model.example_args(batch)
    label = name + (f" b{batch}" if batch != 1 else "") + (f" {quant}" if quant else "")
    out = {"model": label, "layers": cfg.n_layers, "batch": batch, "quant": quant}
    with tempfile.TemporaryDirectory() as d, cache_dir(d):
        for label in ("cold", "warm"):
            prof = cProfile.Profile() if profile_dir else None
            if prof:
                prof.enable()
            clock, info = compile_once(model, args, nvrtc)
            if prof:
                prof.disable()
                os.makedirs(profile_dir, exist_ok=True)
                prof.dump_stats(os.path.join(profile_dir, f"{name}-{label}.prof"))
            out[label] = {"wall": clock.wall, "cpu": clock.cpu, **info}
            del clock, info
            gc.collect()      # the warm compile as a new process has it: no cold heap to scan
    return out


def table(rows: list[dict]) -> str:
    head = f"{'model':<20} {'run':<5} {'wall s':>7} {'cpu s':>7}  " + " ".join(
        f"{p:>7}" for p in PHASES) + "  variants  kernel.cu / tables / program sha256"
    lines = [head, "-" * len(head)]
    for r in rows:
        for label in ("cold", "warm"):
            x = r[label]
            phases = " ".join(f"{x['wall'].get(p, float('nan')):7.2f}" for p in PHASES)
            lines.append(f"{r['model']:<20} {label:<5} {x['wall']['total']:7.2f} "
                         f"{x['cpu']['total']:7.2f}  {phases}  {x['variants']:>8}  "
                         f"{x['kernel_sha']} / {x['tables_sha']} / {x['program_sha']}")
    lines.append("(phases: wall seconds; trace and passes from Lowered.timings)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--models", nargs="+", default=["llama-3.2-1b", "qwen3-0.6b", "llama-3-8b"])
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (quick checks)")
    ap.add_argument("--batch", type=int, default=1, help="sequences a step (default %(default)s)")
    ap.add_argument("--quant", choices=sorted(FORMATS), default=None,
                    help="weight-only quantized linears and LM head (Model.quantize)")
    ap.add_argument("--no-nvrtc", action="store_true", help="skip NVRTC (the Python part only)")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="write a cProfile file per compile: DIR/MODEL-{cold,warm}.prof")
    ap.add_argument("--json", default="bench/compile.json")
    a = ap.parse_args(argv)
    from amk.models.presets import PRESETS
    bad = [m for m in a.models if m not in PRESETS]
    if bad:
        ap.error(f"unknown preset(s) {bad}; choose from {sorted(PRESETS)}")
    if a.layers is not None and a.layers < 1:
        ap.error(f"--layers must be at least 1, got {a.layers}")
    loop_s = python_loop_s()                 # compile times are CPU-bound: the host's speed
    rows = [measure(m, a.layers, not a.no_nvrtc, a.profile, a.batch, a.quant) for m in a.models]
    for r in rows:
        r["python_loop_s"] = loop_s
    print(table(rows))
    print(f"(host: a 2e7-step Python loop took {loop_s:.2f} s; NOTES v29 compares hosts by it)")
    Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
