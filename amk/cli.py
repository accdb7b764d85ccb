"""The `amk` command line: generate text, dump a model's IR stage by stage, benchmark a step.

    amk generate --model smollm2-135m --prompt "The capital of France is" --max-new-tokens 16
    amk ir --model smollm2-135m --dump DIR [--stats]
    amk bench --model smollm2-135m
    amk serve [--background | --stop | --status]     # keep torch and the models warm

The `amk` console script is amk_client.main: it hands `amk generate` to a running `amk serve`
and calls main() here for everything else (and for generate when no server runs).

stdout carries only the result (the generated text, the stats); progress and timings go to
stderr, so `amk generate ... > out.txt` captures just the text.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import contextmanager

from rich.console import Console

err = Console(stderr=True)


@contextmanager
def _status(text: str):
    t0 = time.perf_counter()
    with err.status(text):
        yield
    err.print(f"[dim]{text.rstrip('.')}: {time.perf_counter() - t0:.1f} s[/dim]")


def _place(model, args):
    """Move the weights where the backend runs: a GPU for cuda/triton when there is one."""
    import torch
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and args.backend != "reference" else "cpu"
    dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[args.dtype]
    if device != str(model.device) or dtype is not None:
        with _status(f"moving the weights to {device} {args.dtype}..."):
            model.to(device, dtype)
    return model


def load_model(name: str, max_seq: int, device: str = "cpu"):
    """A known model name (amk.models.gguf.KNOWN), a .gguf file, a local transformers directory,
    or a shape preset with random weights (amk.models.presets.PRESETS: llama-3.2-1b, ...)."""
    import os
    import amk.models as models
    from amk.errors import TraceError
    from amk.models import presets
    if name.endswith(".gguf"):
        return models.load_gguf(name, max_seq=max_seq)[0]
    if name in models.gguf.KNOWN:
        return models.load(name, max_seq=max_seq)[0]
    if name in presets.PRESETS:
        # Random weights: enough for `amk ir` and timing; meta tensors when only compiling.
        return presets.random_model(presets.PRESETS[name], device=device, max_seq=max_seq)
    if not os.path.isdir(name):
        raise TraceError(f"unknown model {name!r}: use {', '.join(sorted(models.gguf.KNOWN))}, a "
                         f".gguf file, a transformers model directory, or a random-weight preset "
                         f"({', '.join(sorted(presets.PRESETS))})")
    return models.from_pretrained(name, max_seq=max_seq)     # config.json + *.safetensors


def _prompt_ids(model, prompt: str, chat: bool) -> list[int]:
    from amk.errors import TraceError
    tok = model.tokenizer
    if tok is None:
        raise TraceError("this model has no tokenizer (a random-weight preset?): generate needs "
                         "a text model such as smollm2-135m; `amk ir` and `amk bench` take presets")
    if chat:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return tok(prompt).input_ids


def _model_key(args) -> tuple:
    """What selects a loaded model in `amk serve`'s cache: a file or folder by its absolute
    name and its files' latest modification time (a rewritten checkpoint is loaded again)."""
    name = args.model
    if os.path.exists(name):
        files = [name] + ([e.path for e in os.scandir(name)] if os.path.isdir(name) else [])
        latest = max(os.stat(f).st_mtime_ns for f in files if os.path.exists(f))
        name = f"{os.path.abspath(name)}@{latest}"
    return name, args.backend, args.max_seq, args.device, args.dtype


def cmd_generate(args, models: dict | None = None) -> int:
    """models: loaded models kept between calls (amk serve's), by _model_key."""
    from amk.cli_stream import TextStream
    from amk.models.prefill import compile_prefill
    key = _model_key(args)
    model = models.get(key) if models is not None else None
    if model is None:
        with _status(f"loading {args.model}..."):
            model = load_model(args.model, args.max_seq)
        _place(model, args)
        if models is not None:
            models[key] = model
    ids = _prompt_ids(model, args.prompt, args.chat)
    with _status(f"tracing and compiling the decode step and prefill chunks "
                 f"({args.backend or 'default backend'})..."):
        model.jit(args.backend).lower(*model.example_args())
        compile_prefill(model, len(ids), args.backend)
    # stdout: the prompt (its own line under --chat), then the answer as it streams
    if args.chat:
        print(f"user: {args.prompt}\nassistant: ", end="", flush=True)
    elif not args.no_prompt:
        print(args.prompt, end="", flush=True)
    stream = TextStream(model.decode)
    new = model.generate(ids, args.max_new_tokens, backend=args.backend,
                         eos_token_id=None if args.ignore_eos else model.tokenizer.eos_token_id,
                         temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                         seed=args.seed, on_token=lambda i, tok, _: stream.add(int(tok[0])))
    stream.close()
    s = model.last_stats
    err.print(f"[dim]{len(new)} new tokens, {s.prompt_tokens} prompt tokens in "
              f"{len(s.prefill_chunks)} prefill chunks; first token {s.first_token_s * 1e3:.0f} ms "
              f"(prefill {s.prefill_tokens_per_s:.1f} tokens/s); {s.decode_steps} decode steps in "
              f"{s.decode_s:.2f} s = {s.decode_tokens_per_s:.1f} tokens/s[/dim]")
    return 0


def cmd_ir(args) -> int:
    # Thin on purpose: the stage texts and dumps belong to amk.passes (the lead's), this only
    # picks the model and the output folder.
    from pathlib import Path
    from amk.passes.dump import dump_stages
    with _status(f"loading {args.model}..."):
        model = load_model(args.model, args.max_seq, device="meta")   # presets: no memory
    if str(model.device) != "meta":
        _place(model, args)
    with _status("tracing and running the passes..."):
        low = model.lower(args.backend)
    dump_stages(low, Path(args.dump).resolve())
    if args.stats:
        from amk.passes.stats import stats_line
        target = low.options.target
        print(f"graph: {len(low.graph.eqns)} equations; target {target.name} ({target.num_sms} SMs)")
        for name, prog in low.programs.items():      # one line per stage
            print(f"{name:<18} {stats_line(prog, target)}")
        print(" ".join(f"{k}={v * 1e3:.1f}ms" if isinstance(v, float) else f"{k}={v}"
                       for k, v in low.timings.items()))
    return 0


def cmd_bench(args) -> int:
    # Thin: one model, one context, one backend. The full comparison (floor, eager torch,
    # torch.compile, every backend, every context) is bench/decode.py.
    import torch
    with _status(f"loading {args.model}..."):
        model = load_model(args.model, args.max_seq)
    _place(model, args)
    step = model.jit(args.backend)
    params, token, pos, kv = model.example_args()
    pos.fill_(min(args.context, model.config.max_seq - 1))
    for _ in range(args.warmup):
        _, _, kv = step(params, token, pos, kv)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        _, _, kv = step(params, token, pos, kv)
    sync()
    dt = (time.perf_counter() - t0) / args.iters
    print(f"{args.model} backend={args.backend or 'default'} context={int(pos[0])}: "
          f"{dt * 1e3:.3f} ms/step ({1 / dt:.1f} steps/s)")
    return 0


def cmd_serve(args) -> int:
    from amk import serve
    from amk_client.main import serve_control
    if args.stop or args.status:
        return serve_control("--stop" if args.stop else "--status")
    if args.background:
        return serve.start_background(args.idle_timeout)
    return serve.serve(args.idle_timeout)


def _int_at_least(lo: int):
    """argparse type: an int >= lo (a clear usage error instead of a silent default or a crash)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v
    parse.__name__ = f"integer >= {lo}"
    return parse


def _model_help() -> str:
    from amk.models import presets
    from amk.models.gguf import KNOWN
    return (f"a bundled model ({', '.join(sorted(KNOWN))}), a .gguf file, a checkpoint folder "
            f"(config.json + *.safetensors), or a random-weight preset "
            f"({', '.join(sorted(presets.PRESETS))})")


def _parser() -> argparse.ArgumentParser:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = argparse.ArgumentParser(prog="amk", description="AMK: a model's decode step as one megakernel",
                                formatter_class=fmt)
    sub = p.add_subparsers(dest="cmd", required=True)
    positive, non_negative = _int_at_least(1), _int_at_least(0)

    def model_args(sp, max_seq=2048):
        sp.add_argument("--model", default="smollm2-135m", help=_model_help())
        sp.add_argument("--backend", choices=["reference", "cuda", "triton"], default=None,
                        help="default: cuda with a GPU, else reference (AMK_BACKEND overrides)")
        sp.add_argument("--max-seq", type=positive, default=max_seq, help="KV cache length")
        sp.add_argument("--device", default="auto", help="auto: cuda for cuda/triton with a GPU, else cpu")
        sp.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                        help="weight and activation dtype (auto: as loaded, float32 for GGUF)")

    g = sub.add_parser("generate", help="generate text: chunked prefill, then the compiled decode step",
                       formatter_class=fmt)
    model_args(g, max_seq=512)
    g.add_argument("--prompt", default="The capital of France is", help="the text to continue")
    g.add_argument("--max-new-tokens", type=positive, default=16, help="tokens to generate")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    g.add_argument("--no-prompt", action="store_true", help="print only the continuation")
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    g.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass, in (0, 1]")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (repeats the text)")
    g.add_argument("--no-serve", action="store_true",
                   help="run in this process even when an `amk serve` server runs")
    g.set_defaults(fn=cmd_generate)

    i = sub.add_parser("ir", help="dump the graph and every pass's program text", formatter_class=fmt)
    model_args(i, max_seq=512)
    i.add_argument("--dump", required=True, metavar="DIR")
    i.add_argument("--stats", action="store_true", help="print graph/program sizes and pass timings")
    i.set_defaults(fn=cmd_ir)

    b = sub.add_parser("bench", help="time one decode step of a model (full comparison: bench/decode.py)",
                       formatter_class=fmt)
    model_args(b)
    b.add_argument("--context", type=non_negative, default=0, help="decode position timed")
    b.add_argument("--iters", type=positive, default=20, help="timed steps")
    b.add_argument("--warmup", type=non_negative, default=3, help="untimed steps first")
    b.set_defaults(fn=cmd_bench)

    s = sub.add_parser("serve", formatter_class=fmt,
                       help="keep torch and the models warm for `amk generate` (a Unix socket in "
                            "AMK_CACHE_DIR)")
    what = s.add_mutually_exclusive_group()
    what.add_argument("--background", action="store_true", help="start it detached and return")
    what.add_argument("--stop", action="store_true", help="stop the running server")
    what.add_argument("--status", action="store_true", help="say whether one runs, and what it holds")
    s.add_argument("--idle-timeout", type=_int_at_least(1), default=1800, metavar="SECONDS",
                   help="exit after this long without a request")
    s.set_defaults(fn=cmd_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from amk.cpu_threads import apply_default
    apply_default()          # the CPU reference's small ops: do not oversubscribe the cores
    return run(args, args.fn)


def run(args, fn) -> int:
    """fn(args), with AMK's errors as one clear line and exit code 1 (amk serve runs this too)."""
    from amk.errors import AmkError
    try:
        return fn(args)
    except AmkError as e:
        err.print(f"[red]amk {args.cmd}: {type(e).__name__}: {e}[/red]")
        return 1


if __name__ == "__main__":
    sys.exit(main())
