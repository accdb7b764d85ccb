"""Same-call A/B of the cuda decode step: trees and knob settings, alternated round by round.

Each VARIANT is `[TREE:]KNOBS`: TREE a directory holding another version of amk/ (e.g.
`git archive <commit> amk | tar -x -C _dev/<name>`; default: this tree), KNOBS
`NAME=VAL[,NAME=VAL...]` set in the environment, or `-` for none. Every round runs every
variant once, in the given order, each as its own process of THIS tree's `bench/decode.py
--backends cuda` with PYTHONPATH = the variant's tree: one benchmark (model, cache size,
context), only amk/ differs. Alternating rounds keep slow drift (clocks, other tenants)
out of the comparison; count a difference only when it is well above the spread of the rounds
(bench/NOTES.md: ~5 us at context 1024).

    python3 bench/ab.py --rounds 2 - AMK_SPIN_NS=256 _dev/main:- _dev/main:AMK_PRELOAD=0

Prints one line per run, then a table (ms per round, best) and writes it as JSON (--json).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_tool import parser  # noqa: E402

THIS_TREE = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Variant:
    name: str                    # as given on the command line
    tree: Path
    env: dict[str, str]


def parse_variant(arg: str) -> Variant:
    """`[TREE:]KNOBS` -> Variant; a clear error for a missing tree or a knob without '='."""
    tree, knobs = arg.split(":", 1) if ":" in arg else ("", arg)
    path = Path(tree).resolve() if tree else THIS_TREE
    if not (path / "amk" / "__init__.py").is_file():
        raise SystemExit(f"bench/ab.py: variant {arg!r}: {path} holds no amk/ package")
    env = {}
    for kv in ([] if knobs in ("", "-") else knobs.split(",")):
        name, eq, value = kv.partition("=")
        if not eq or not name:
            raise SystemExit(f"bench/ab.py: variant {arg!r}: {kv!r} is not NAME=VAL")
        env[name] = value
    return Variant(arg, path, env)


def decode_ms(v: Variant, context: int, iters: int, timeout: int, model: str = "llama-3.2-1b",
              max_seq: int = 8192, extra: tuple[str, ...] = ()) -> float | None:
    """One bench/decode.py run of the variant: its AMK cuda ms, or None (printed why)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "decode.json"
        cmd = [sys.executable, str(THIS_TREE / "bench" / "decode.py"), "--contexts", str(context),
               "--backends", "cuda", "--compile-peer-at", "--iters", str(iters), "--json", str(out),
               "--model", model, "--max-seq", str(max_seq), *extra]
        env = dict(os.environ, PYTHONPATH=str(v.tree), PYTHONUNBUFFERED="1", **v.env)
        try:
            r = subprocess.run(cmd, cwd=v.tree, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"  {v.name}: no result in {timeout} s")
            return None
        if r.returncode != 0 or not out.is_file():
            print(f"  {v.name}: exit {r.returncode}: {(r.stderr or r.stdout).strip()[-300:]}")
            return None
        row = json.loads(out.read_text())["rows"][0]
        if "amk_cuda_ms" not in row:        # the step failed: decode.py says why in the row
            print(f"  {v.name}: {row.get('amk_cuda_error', 'no amk_cuda_ms in the row')}")
            return None
        return float(row["amk_cuda_ms"])


def run(variants: list[Variant], rounds: int, measure) -> list[dict]:
    """measure(variant) -> ms or None, `rounds` times over the variants in order: a row each."""
    ms: dict[str, list[float | None]] = {v.name: [] for v in variants}
    for r in range(rounds):
        for v in variants:
            ms[v.name].append(measure(v))
            print(f"round {r + 1} {v.name}: {ms[v.name][-1]}", flush=True)
    rows = []
    for v in variants:
        got = [m for m in ms[v.name] if m is not None]
        rows.append({"variant": v.name, "tree": str(v.tree), "knobs": v.env, "ms": ms[v.name],
                     "best_ms": min(got) if got else None})
    return rows


def _ms(m: float | None) -> str:
    return "-" if m is None else f"{m:.3f}"


def table(rows: list[dict]) -> str:
    lines = ["variant | " + " | ".join(f"round {i + 1}" for i in range(len(rows[0]["ms"]))) + " | best",
             "---|" + "---|" * len(rows[0]["ms"]) + "---"]
    lines += [f"{r['variant']} | " + " | ".join(_ms(m) for m in r["ms"]) + f" | {_ms(r['best_ms'])}"
              for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("variants", nargs="+", metavar="VARIANT")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--model", default="llama-3.2-1b", help="a bench/decode.py preset")
    ap.add_argument("--max-seq", type=int, default=8192, help="KV cache rows")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--quant", default=None, help="a bench/decode.py --quant format")
    ap.add_argument("--set", default="", metavar="FIELD=VALUE[,...]",
                    help="bench/decode.py --set, comma-separated: a shape that is not a preset")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--timeout", type=int, default=120, help="seconds a run may take")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    variants = [parse_variant(x) for x in a.variants]
    shape_set = [x for x in a.set.split(",") if x]
    extra = ("--batch", str(a.batch), *(("--quant", a.quant) if a.quant else ()),
             *(("--set", *shape_set) if shape_set else ()))
    rows = run(variants, a.rounds,
               lambda v: decode_ms(v, a.context, a.iters, a.timeout, a.model, a.max_seq, extra))
    shape = " ".join([a.model, *shape_set, f"batch {a.batch}", a.quant or "bf16"])
    print(f"{shape}, context {a.context}, max_seq {a.max_seq}")
    print(table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps({"model": shape, "context": a.context,
                                            "max_seq": a.max_seq, "rows": rows}, indent=1))
    return 0 if all(r["best_ms"] is not None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
