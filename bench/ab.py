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

--matrix NAME runs the same A/B over a list of rows instead of one (MATRICES: the rows a change
is judged on, the most telling first), then prints a table of every row's best per variant.
--budget-s skips the rows that would end past it (the slowest row's mean run so far times the
runs a row takes), so that one device call returns every row it had time for:

    LIMIT=540; python3 bench/ab.py --matrix batch1 --budget-s $LIMIT --json ab.json _dev/main:- -
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
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


def shape_args(batch: int, quant: str | None, shape_set: list[str] = ()) -> tuple[str, ...]:
    """bench/decode.py's arguments for the batch, weight format and --set of a benchmark."""
    return ("--batch", str(batch), *(("--quant", quant) if quant else ()),
            *(("--set", *shape_set) if shape_set else ()))


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


@dataclass(frozen=True)
class Row:
    """One benchmark of a matrix: a preset at a context, batch and weight format."""
    model: str
    context: int
    batch: int = 1
    quant: str | None = None

    def name(self) -> str:
        return " ".join([self.model, f"@{self.context}", *([f"batch {self.batch}"] if self.batch > 1 else []),
                         *([self.quant] if self.quant else [])])


_BATCH1 = (Row("qwen3-0.6b", 1024), Row("llama-3.2-1b", 1024), Row("qwen3-0.6b", 4096),
           Row("llama-3.2-1b", 128), Row("llama-3-8b", 1024), Row("qwen3-0.6b", 128),
           Row("llama-3.2-1b", 4096))
MATRICES = {
    "batch1": _BATCH1,                    # a batch-1 bf16 kernel change
    "all": _BATCH1 + (Row("llama-3.2-1b", 128, quant="int4"), Row("llama-3.2-1b", 1024, batch=4),
                      Row("llama-3.2-1b", 1024, batch=16), Row("llama-3.2-1b", 128, quant="int8"),
                      Row("llama-3.2-1b", 128, quant="fp8"), Row("llama-3.2-1b", 1024, batch=64)),
}


def run_matrix(variants: list[Variant], rows: tuple[Row, ...], rounds: int, measure, budget_s: float,
               clock=time.monotonic) -> tuple[list[dict], list[str]]:
    """run() for each row in order (measure(variant, row) -> ms or None), skipping a row once
    the time used plus its runs at the slowest row's mean run so far would pass budget_s
    (0: no limit). -> (a result per row run, the names of the rows skipped)."""
    t0, longest, done, skipped = clock(), 0.0, [], []
    for row in rows:
        runs = rounds * len(variants)
        if budget_s and clock() - t0 + longest * runs > budget_s:
            skipped.append(row.name())
            print(f"skipped {row.name()}: {budget_s - (clock() - t0):.0f} s left, a run takes ~{longest:.0f} s")
            continue
        print(f"-- {row.name()}", flush=True)
        r0 = clock()
        done.append({"row": row.name(), "model": row.model, "context": row.context, "batch": row.batch,
                     "quant": row.quant or "bf16", "variants": run(variants, rounds, lambda v: measure(v, row))})
        longest = max(longest, (clock() - r0) / runs)
    return done, skipped


def matrix_table(done: list[dict]) -> str:
    """Every row's best ms per variant."""
    names = [r["variant"] for r in done[0]["variants"]]
    lines = ["row | " + " | ".join(names), "---|" + "---|" * (len(names) - 1) + "---"]
    lines += [f"{d['row']} | " + " | ".join(_ms(r["best_ms"]) for r in d["variants"]) for d in done]
    return "\n".join(lines)


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
    ap.add_argument("--context", type=int, default=None, help="default 1024")
    ap.add_argument("--model", default=None, help="a bench/decode.py preset (default llama-3.2-1b)")
    ap.add_argument("--max-seq", type=int, default=8192, help="KV cache rows")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--quant", default=None, help="a bench/decode.py --quant format")
    ap.add_argument("--set", default="", metavar="FIELD=VALUE[,...]",
                    help="bench/decode.py --set, comma-separated: a shape that is not a preset")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--timeout", type=int, default=120, help="seconds a run may take")
    ap.add_argument("--json", default=None)
    ap.add_argument("--matrix", default=None, choices=sorted(MATRICES),
                    help="the A/B over every row of this list instead of one benchmark")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="with --matrix: skip the rows that would end past this many seconds (0: none)")
    a = ap.parse_args(argv)
    variants = [parse_variant(x) for x in a.variants]
    if a.matrix:
        return _main_matrix(a, variants)
    a.context = 1024 if a.context is None else a.context
    a.model = a.model or "llama-3.2-1b"
    shape_set = [x for x in a.set.split(",") if x]
    extra = shape_args(a.batch, a.quant, shape_set)
    rows = run(variants, a.rounds,
               lambda v: decode_ms(v, a.context, a.iters, a.timeout, a.model, a.max_seq, extra))
    shape = " ".join([a.model, *shape_set, f"batch {a.batch}", a.quant or "bf16"])
    print(f"{shape}, context {a.context}, max_seq {a.max_seq}")
    print(table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps({"model": shape, "context": a.context,
                                            "max_seq": a.max_seq, "rows": rows}, indent=1))
    return 0 if all(r["best_ms"] is not None for r in rows) else 1


def _main_matrix(a, variants: list[Variant]) -> int:
    if a.set or a.batch != 1 or a.quant or a.model or a.context is not None:
        raise SystemExit("bench/ab.py: --matrix sets each row's model, context, batch and format; "
                         "drop --model / --context / --set / --batch / --quant")

    def measure(v: Variant, row: Row) -> float | None:
        return decode_ms(v, row.context, a.iters, a.timeout, row.model, a.max_seq,
                         shape_args(row.batch, row.quant))

    done, skipped = run_matrix(variants, MATRICES[a.matrix], a.rounds, measure, a.budget_s)
    print(f"matrix {a.matrix}, max_seq {a.max_seq}, best of {a.rounds} round(s), ms")
    print(matrix_table(done) if done else "no row ran")
    if skipped:
        print("skipped: " + "; ".join(skipped))
    if a.json:
        Path(a.json).write_text(json.dumps({"matrix": a.matrix, "max_seq": a.max_seq, "rounds": a.rounds,
                                            "rows": done, "skipped": skipped}, indent=1))
    ok = done and all(r["best_ms"] is not None for d in done for r in d["variants"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
