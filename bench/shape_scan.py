"""Shapes that are not presets, compiled for sm_90a on any machine (no GPU): does each step
build, and what does ptxas spill, per device function. A template change is measured on the
presets; this shows what it does to the code they never compile (NOTES v47: a combine of 33-56
partials that spilled, a K that did not build, quantized batched GEMVs whose spills moved).
Prints a table (one row a shape x format x batch: built or the error, then the spill bytes,
stores / loads, summed over the functions) and writes it as JSON; with --base TREE, the same
for another tree's amk/ beside it (run as a subprocess with PYTHONPATH=TREE).

    python bench/shape_scan.py                              # every shape, bf16, batch 1 and 16
    python bench/shape_scan.py --fmts bf16 int4 int8 --base _dev/main
    python bench/shape_scan.py --shapes h576-gqa3 --batches 1 --json /tmp/scan.json
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parent.parent))   # amk without PYTHONPATH
from gpu_tool import parser  # noqa: E402
from sass import compile_step, spills  # noqa: E402

from amk.models.llama import DecoderConfig  # noqa: E402

_BASE = DecoderConfig(vocab=32000, hidden=2560, n_layers=2, n_heads=20, n_kv_heads=4, head_dim=128,
                      ffn=6912, max_seq=8192, dtype=torch.bfloat16, arch="llama")
# two layers each, an 8K cache: other head dims, GQA ratios, norms, biases and widths than the presets'
SHAPES = {
    "h2560-gqa5": _BASE,
    "hd256-gqa2": replace(_BASE, hidden=2048, n_heads=8, n_kv_heads=4, head_dim=256, ffn=16384),
    "mha-hd64": replace(_BASE, hidden=1536, n_heads=24, n_kv_heads=24, head_dim=64, ffn=4096),
    "qwen2-7b-mlp": replace(_BASE, hidden=3584, n_heads=28, n_kv_heads=4, ffn=18944, qkv_bias=True, arch="qwen2"),
    "h576-gqa3": replace(_BASE, hidden=576, n_heads=9, n_kv_heads=3, head_dim=64, ffn=1536, vocab=49152),
    "qwen3-h2048": replace(_BASE, hidden=2048, n_heads=16, n_kv_heads=8, ffn=6144, qk_norm=True, arch="qwen3"),
}


def scan_one(shape: str, fmt: str, batch: int) -> dict:
    """{"ok": bool, "error": str | None, "spills": {function: ptxas line}} of one step."""
    try:
        _, res = compile_step(SHAPES[shape], None if fmt == "bf16" else fmt, batch)
    except Exception as e:                       # the row says why; the scan goes on
        return {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}", "spills": {}}
    return {"ok": True, "error": None, "spills": spills(res.log)}


def totals(row: dict) -> tuple[int, int]:
    lines = " ".join(row["spills"].values())
    return (sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", lines)),
            sum(int(x) for x in re.findall(r"(\d+) bytes spill loads", lines)))


def cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if not row["ok"]:
        return "FAILS: " + row["error"]
    st, ld = totals(row)
    return "no spill" if st == ld == 0 else f"{st} / {ld} B"


def scan(shapes, fmts, batches) -> list[dict]:
    rows = []
    for s in shapes:
        for f in fmts:
            for b in batches:
                rows.append({"shape": s, "fmt": f, "batch": b, **scan_one(s, f, b)})
                print(f"  {s} {f} batch {b}: {cell(rows[-1])}", file=sys.stderr, flush=True)
    return rows


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--fmts", nargs="+", default=["bf16"], choices=["bf16", "int8", "int4", "fp8"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--base", default=None, help="another tree (a folder holding amk/) to scan beside this one")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if any(b < 1 for b in a.batches):
        ap.error("--batches must be positive")
    if a.base and not (Path(a.base) / "amk" / "__init__.py").is_file():
        ap.error(f"--base {a.base}: no amk/ package there")
    rows = scan(a.shapes, a.fmts, a.batches)
    base = None
    if a.base:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "base.json"
            cmd = [sys.executable, __file__, "--shapes", *a.shapes, "--fmts", *a.fmts,
                   "--batches", *map(str, a.batches), "--json", str(out)]
            # its exit code says whether every step built there; only a missing table is a failure
            r = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(Path(a.base).resolve())),
                               capture_output=True, text=True)
            if not out.is_file():
                print(f"bench/shape_scan.py: the scan of {a.base} failed:\n{r.stderr[-2000:]}", file=sys.stderr)
                return 1
            base = {(x["shape"], x["fmt"], x["batch"]): x for x in json.loads(out.read_text())["rows"]}
    head = "shape | fmt | batch | spills (stores / loads)" + (f" | {a.base}" if base is not None else "")
    print(head + "\n" + "---|" * (head.count("|") + 1))
    for r in rows:
        other = f" | {cell(base.get((r['shape'], r['fmt'], r['batch'])))}" if base is not None else ""
        print(f"{r['shape']} | {r['fmt']} | {r['batch']} | {cell(r)}{other}")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "base": list(base.values()) if base else None}, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
