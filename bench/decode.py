"""Decode of a preset model shape (random bf16 weights; --model, default Llama-3.2-1B; --batch
sequences at one position; --quant for weight-only quantized linears) on one GPU, with a KV cache of --max-seq rows (default 8192: what a user allocates, not the
context being measured; a cache sized to the context hides what capacity costs).

Reports, from ONE run: the measured read bandwidth and the floor it implies (weight + KV bytes
over that bandwidth), AMK cuda (one persistent kernel), AMK triton (one launch per task, CUDA
graph), AMK reference VM on the GPU, eager torch, torch.compile(mode="reduce-overhead") and the
same compiled step replayed from one CUDA graph (GPU time only, as AMK cuda's), and AMK's cold
and warm compile times. Prints a table; writes JSON.

    python bench/decode.py --model qwen3-0.6b --contexts 128 1024 4096 --max-seq 8192
    python bench/decode.py --batch 16 --contexts 1024 --backends cuda
    python bench/decode.py --quant int4 --contexts 128 --backends cuda --compile-peer-at 128
"""
from __future__ import annotations

import gc
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from gpu_tool import cache_dir, have_gpu, parser, python_loop_s  # noqa: E402  (bench/ is sys.path[0] for a script)

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parent.parent))   # amk without PYTHONPATH (ab.py sets it)
from torch_llama import torch_decode_step  # noqa: E402
from torch_quant_peer import peer_params  # noqa: E402

import amk  # noqa: E402
from amk.models.model import Model  # noqa: E402
from amk.models.presets import PRESETS, random_params, with_overrides  # noqa: E402
from amk import pytree  # noqa: E402
from amk.quant import FORMATS  # noqa: E402


def time_ms(fn, iters: int, reps: int = 5) -> float:
    """Median over `reps` of the mean time of `iters` back-to-back calls (CUDA events)."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / iters)
    return statistics.median(out)


def replay_ms(fn, iters: int, warm: int = 1) -> float:
    """Per-call time of fn's GPU work captured once in a CUDA graph and replayed (no host work)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warm):
            fn()
        s.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    return time_ms(g.replay, iters=iters)


def graph_ms(step, args, iters: int) -> float:
    """Per-step time of the megakernel's launch captured in a CUDA graph (no host work)."""
    exe, bindings = step.executable(*args)
    exe.run(bindings)                          # bind this step's tensors
    ms = replay_ms(exe.launch, iters)
    exe.check()                                # a fault in any replay would show here
    return ms


def read_bandwidth() -> float:
    """Bytes/s of a large streaming read (a sum over 4 GiB), the median of a few."""
    x = torch.randn(2 * 1024 ** 3 // 2, device="cuda").to(torch.bfloat16)   # 2 GiB
    y = torch.cat([x, x])                                                   # 4 GiB
    del x
    nbytes = y.numel() * y.element_size()
    ms = time_ms(lambda: y.sum(dtype=torch.float32), iters=5)
    y = None                      # free the 4 GiB before the model loads
    torch.cuda.empty_cache()
    return nbytes / (ms * 1e-3)


def weight_bytes(params: dict, batch: int = 1) -> int:
    """Bytes a step reads of the weights: every distinct tensor, a quantized weight's codes,
    scales and zeros included; an embedding the LM head does not share (a quantized head)
    only its `batch` looked-up rows."""
    embed, head = params.get("embed"), params.get("lm_head")
    untied = isinstance(embed, torch.Tensor) and not (
        isinstance(head, torch.Tensor) and head.data_ptr() == embed.data_ptr())
    seen, total = set(), 0
    for t in _leaves(params):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            n = t.numel() * t.element_size()
            total += n // t.shape[0] * min(batch, t.shape[0]) if untied and t is embed else n
    return total


def _leaves(x) -> list[torch.Tensor]:
    """The tensors of a params tree by AMK's pytree (a QuantizedWeight is a node of tensors:
    a walk over dicts and lists alone dropped them, and the quantized floors counted only the
    embedding, NOTES v25)."""
    return pytree.flatten(x, with_paths=False)[0]


def quantized(cfg, params: dict, fmt: str | None) -> dict:
    """params with every linear weight and the LM head quantized to fmt (the bf16 tensors stay
    as they were: the torch peers read them), or params itself without a format."""
    if fmt is None:
        return params
    q = {**params, "layers": [dict(layer) for layer in params["layers"]]}
    return Model(cfg, q).quantize(fmt).params


def bench_context(cfg, params, ctx: int, backends: list[str], iters: int, bw: float,
                  compile_peer: bool, batch: int = 1, amk_params: dict | None = None,
                  quant: str | None = None) -> dict:
    """One context's row. params: the bf16 weights the torch peers read; amk_params: what AMK
    runs (the quantized weights under --quant; default params); quant: also time torch's own
    weight-only kernels in that format (with the torch.compile peer)."""
    amk_params = params if amk_params is None else amk_params
    m = Model(cfg, amk_params)
    kv = m.new_kv(batch)
    token = torch.full((batch,), 17, dtype=torch.int32, device="cuda")
    pos = torch.tensor([ctx - 1], dtype=torch.int32, device="cuda")
    kv_bytes = batch * 2 * cfg.n_layers * ctx * cfg.n_kv_heads * cfg.head_dim * 2
    floor_ms = (weight_bytes(amk_params, batch) + kv_bytes) / bw * 1e3
    row = {"context": ctx, "batch": batch, "floor_ms": floor_ms}

    row["eager_ms"] = time_ms(lambda: torch_decode_step(m.config, params, token, pos, kv), iters=10)
    if compile_peer:
        t0 = time.perf_counter()
        # Static addresses: the caches (updated in place) keep CUDA graphs on, and the weights
        # (lifted as graph inputs) are not copied into the graph's buffers at every replay.
        # Without it this column showed 3.1 ms; with it 1.34-1.45, but 3.09 in one run on a
        # machine warm from an unmarked compile (a stale inductor cache?): bench/NOTES.md v17f.
        # torch_compile_graph_ms below has no cudagraph trees and read 1.44-1.45 in every run.
        for t in [t for layer in kv for t in layer.values()] + list(_leaves(params)):
            torch._dynamo.mark_static_address(t)
        comp = torch.compile(lambda t, p: torch_decode_step(m.config, params, t, p, kv),
                             mode="reduce-overhead", fullgraph=True)
        for _ in range(3):
            comp(token, pos)
        torch.cuda.synchronize()
        row["compile_peer_s"] = time.perf_counter() - t0
        row["torch_compile_ms"] = time_ms(lambda: comp(token, pos), iters=iters)
        # The same step compiled without cudagraphs of its own, replayed from one CUDA graph as
        # amk_cuda_ms is: GPU time only, whatever reduce-overhead's replay does on the host.
        plain = torch.compile(lambda t, p: torch_decode_step(m.config, params, t, p, kv), fullgraph=True)
        row["torch_compile_graph_ms"] = replay_ms(lambda: plain(token, pos), iters, warm=3)
        if quant:
            row.update(quant_peer(m.config, params, quant, token, pos, kv, iters))

    for be in backends:
        try:
            step = amk.jit(m.fn, backend=be, donate=("kv",))
            t0 = time.perf_counter()
            args = (amk_params, token, pos, kv)
            step(*args)
            torch.cuda.synchronize()
            row[f"amk_{be}_first_call_s"] = time.perf_counter() - t0
            n = 3 if be == "reference" else iters
            # The Python call: flatten the pytrees, bind, launch, check the kernel's fault word.
            row[f"amk_{be}_call_ms"] = time_ms(lambda: step(*args), iters=n,
                                               reps=2 if be == "reference" else 5)
            if be == "cuda":       # the kernel alone: its one launch replayed from a CUDA graph
                row["amk_cuda_ms"] = graph_ms(step, args, iters)
                row["amk_cuda_tasks"] = len(step.lower(*args).program.tasks)
            elif be == "triton":   # already a CUDA-graph replay inside the call
                row["amk_triton_ms"] = row["amk_triton_call_ms"]
            else:
                row[f"amk_{be}_ms"] = row[f"amk_{be}_call_ms"]
        except Exception as e:  # report, keep benchmarking the rest
            row[f"amk_{be}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    if "amk_cuda_ms" in row:
        row["fraction_of_floor"] = floor_ms / row["amk_cuda_ms"]
    return row


def quant_peer(cfg, params: dict, fmt: str, token, pos, kv, iters: int) -> dict:
    """torch's weight-only fmt kernels in the same step (torch_quant_peer.py), compiled and
    replayed from one CUDA graph, and their logits' distance from the bf16 step's; or why not."""
    try:
        qp = peer_params(params, fmt)
        _, ref = torch_decode_step(cfg, params, token, pos, kv)
        _, got = torch_decode_step(cfg, qp, token, pos, kv)
        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        comp = torch.compile(lambda t, p: torch_decode_step(cfg, qp, t, p, kv), fullgraph=True)
        return {"torch_quant_graph_ms": replay_ms(lambda: comp(token, pos), iters, warm=3),
                "torch_quant_rel_err": err}
    except Exception as e:  # no such kernel on this stack: the row says so
        return {"torch_quant_error": f"{type(e).__name__}: {str(e)[:300]}"}


def compile_times(cfg, params, batch: int = 1) -> dict:
    """Cold (empty cache: trace + passes + NVRTC) and warm (disk cache) compile of the cuda step."""
    out = {}
    m = Model(cfg, params)
    args = m.example_args(batch)
    with tempfile.TemporaryDirectory() as d, cache_dir(d):
        for label in ("cold", "warm"):
            step = amk.jit(m.fn, backend="cuda", donate=("kv",))
            low = None        # the warm compile as a new process runs it: without the cold
            gc.collect()      # one's program and stages on the heap the GC scans
            t0 = time.perf_counter()
            low = step.lower(*args)
            low.compile_cuda()
            out[f"{label}_compile_s"] = time.perf_counter() - t0
        out["tasks"] = len(low.program.tasks)
        out["counters"] = len(low.program.counters)
    out["python_loop_s"] = python_loop_s()      # the host's CPU speed, which the compile follows
    return out


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--model", default="llama-3.2-1b", choices=sorted(PRESETS),
                    help="the preset shape (amk/models/presets.py; default %(default)s)")
    ap.add_argument("--set", nargs="+", default=[], metavar="FIELD=VALUE",
                    help="change the preset's shape (a shape that is not a preset), e.g. --set "
                         "hidden=1536 n_heads=12 n_kv_heads=4 ffn=6144 (amk/models/llama.py DecoderConfig)")
    ap.add_argument("--max-seq", type=int, default=8192,
                    help="KV cache rows, for every context (default %(default)s)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096])
    ap.add_argument("--backends", nargs="+", default=["cuda", "triton", "reference"])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--compile-peer-at", type=int, nargs="*", default=[1024],
                    help="contexts at which to run torch.compile (it takes a minute each; the bare flag: "
                         "none; default %(default)s)")
    ap.add_argument("--batch", type=int, default=1, help="sequences a step (default %(default)s)")
    ap.add_argument("--quant", choices=sorted(FORMATS), default=None,
                    help="AMK runs weight-only quantized linears and LM head (Model.quantize); "
                         "the torch peers keep the bf16 weights, and with the torch.compile peer torch's own "
                         "weight-only kernels in the format run too (torch_quant_graph_ms; fp8: none)")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (quick checks)")
    ap.add_argument("--json", default="bench/results.json")
    a = ap.parse_args(argv)
    if a.batch < 1:
        ap.error(f"--batch must be at least 1, got {a.batch}")
    if a.max_seq < max(a.contexts) or min(a.contexts) < 1:
        ap.error(f"--max-seq {a.max_seq} must hold every context (1..{a.max_seq}), got {a.contexts}")
    try:
        cfg = with_overrides(replace(PRESETS[a.model], max_seq=a.max_seq), a.set)
    except ValueError as e:
        ap.error(str(e))
    cfg = cfg if a.layers is None else replace(cfg, n_layers=a.layers)
    if not have_gpu(__file__):
        return 2
    params = random_params(cfg, device="cuda", seed=0)
    amk_params = quantized(cfg, params, a.quant)
    bw = read_bandwidth()
    result = {"model": " ".join([a.model, *a.set]), "max_seq": a.max_seq, "batch": a.batch,
              "quant": a.quant,
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "read_bandwidth_TBps": bw / 1e12, "weight_GB": weight_bytes(amk_params, a.batch) / 1e9,
              "rows": []}
    if "cuda" in a.backends:
        try:
            result["compile"] = compile_times(cfg, amk_params, a.batch)
        except Exception as e:
            result["compile"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    for ctx in a.contexts:
        row = bench_context(cfg, params, ctx, a.backends, a.iters, bw, ctx in a.compile_peer_at,
                            a.batch, amk_params, a.quant)
        result["rows"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(result, indent=2))
    print_table(result)
    return 0


def print_table(r: dict) -> None:
    print(f"\n{r['model']}  batch {r.get('batch', 1)}  {r.get('quant') or 'bf16'}  "
          f"max_seq {r['max_seq']}  {r['device']}  torch {r['torch']}  "
          f"read bandwidth {r['read_bandwidth_TBps']:.2f} TB/s  weights {r['weight_GB']:.2f} GB")
    if "compile" in r:
        print("compile:", ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                   for k, v in r["compile"].items()))
    cols = ["floor_ms", "amk_cuda_ms", "fraction_of_floor", "amk_cuda_call_ms", "amk_triton_ms",
            "amk_reference_ms", "eager_ms", "torch_compile_ms", "torch_compile_graph_ms",
            "torch_quant_graph_ms"]
    print(f"{'context':>8} " + " ".join(f"{c:>18}" for c in cols))
    for row in r["rows"]:
        cells = []
        for c in cols:
            v = row.get(c)
            cells.append(f"{v:>18.3f}" if isinstance(v, float) else f"{'-':>18}")
        print(f"{row['context']:>8} " + " ".join(cells))
        for k, v in row.items():
            if k.endswith("_error"):
                print(f"{'':>8} {k}: {v}")


if __name__ == "__main__":
    sys.exit(main())
