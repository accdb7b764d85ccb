"""Where a warm `amk generate` spends its time before and through the first tokens: CPU and wall
seconds of each phase as the CLI runs them (import torch, import amk's CLI, load the model,
tokenize, compile the decode step and the prefill chunks from the warm caches, each token).
Run it twice: the first run fills AMK_CACHE_DIR (the GGUF folder, programs, cubins). Writes JSON.

    python bench/generate_start.py                       # smollm2-135m, "Hello", 4 tokens
    python bench/generate_start.py --backend cuda --max-new-tokens 8
"""
import time

_C0, _W0 = time.process_time(), time.perf_counter()     # before any import below

import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parent.parent))   # amk without PYTHONPATH
from gpu_tool import parser  # noqa: E402


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt", default="Hello")
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--max-seq", type=int, default=512)
    ap.add_argument("--backend", choices=["reference", "cuda", "triton"], default=None)
    ap.add_argument("--json", default="bench/generate_start.json")
    a = ap.parse_args(argv)
    if a.max_new_tokens < 1:
        ap.error(f"--max-new-tokens must be at least 1, got {a.max_new_tokens}")
    rows: list[tuple[str, float, float]] = []
    last = [_C0, _W0]

    def mark(name: str) -> None:
        c, w = time.process_time(), time.perf_counter()
        rows.append((name, c - last[0], w - last[1]))
        last[:] = [c, w]

    import torch  # noqa: F401
    mark("import torch")
    import amk.cli as cli
    from amk.cpu_threads import apply_default
    from amk.models.prefill import compile_prefill
    apply_default()                                 # as `amk generate` does
    mark("import amk.cli")
    model = cli.load_model(a.model, a.max_seq)
    mark("load model")
    ids = cli._prompt_ids(model, a.prompt, False)
    mark("tokenize")
    model.jit(a.backend).lower(*model.example_args())
    mark("compile decode")
    compile_prefill(model, len(ids), a.backend)
    mark("compile prefill")
    model.generate(ids, a.max_new_tokens, backend=a.backend, eos_token_id=None,
                   on_token=lambda i, tok, _: mark(f"token {i}"))
    start = next(i for i, r in enumerate(rows) if r[0] == "token 0")
    to_first = (sum(r[1] for r in rows[:start + 1]), sum(r[2] for r in rows[:start + 1]))
    print(f"{'phase':<16} {'cpu s':>7} {'wall s':>7}")
    for name, c, w in rows:
        print(f"{name:<16} {c:7.3f} {w:7.3f}")
    print(f"{'to first token':<16} {to_first[0]:7.3f} {to_first[1]:7.3f}")
    Path(a.json).write_text(json.dumps({"model": a.model, "phases": rows,
                                        "to_first_token": to_first}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
