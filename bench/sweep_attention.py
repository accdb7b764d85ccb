"""v6 sweep: the attention variant (AMK_ATTN_SMEM=1 cp.async K/V staging, 0 = v5 loads) x the
split-KV count P, Llama-3.2-1B shape, batch 1, bf16, one context; graph-replay ms per step
(bench/decode.py's graph_ms) and the step's output token for each.

    python bench/sweep_attention.py --context 1024 --splits 4 8 16 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # amk without PYTHONPATH
from decode import graph_ms  # noqa: E402

import amk  # noqa: E402
from amk.models.model import Model  # noqa: E402
from amk.models.presets import LLAMA_3_2_1B, random_params  # noqa: E402
from amk.passes.options import PassOptions  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--splits", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--attn", nargs="+", default=["1", "0"])   # AMK_ATTN_SMEM values
    ap.add_argument("--baseline-splits", type=int, nargs="*", default=[])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    cfg = replace(LLAMA_3_2_1B, max_seq=a.context + 64)
    params = random_params(cfg, device="cuda", seed=0)
    m = Model(cfg, params)
    token = torch.tensor([17], dtype=torch.int32, device="cuda")
    pos = torch.tensor([a.context - 1], dtype=torch.int32, device="cuda")
    rows = []
    for attn in a.attn:
        os.environ["AMK_ATTN_SMEM"] = attn
        for P in [None] + (a.splits if attn != "0" else a.baseline_splits):
            kv = m.new_kv()
            opts = PassOptions.for_backend("cuda")
            if P is not None:
                opts = opts.with_(attn_splits=P)
            step = amk.jit(m.fn, backend="cuda", donate=("kv",), options=opts)
            out = step(params, token, pos, kv)
            tok = int(out.flatten()[0]) if isinstance(out, torch.Tensor) else str(out)[:40]
            ms = graph_ms(step, (params, token, pos, kv), a.iters)
            ms2 = graph_ms(step, (params, token, pos, kv), a.iters)
            n = len(step.lower(params, token, pos, kv).program.tasks)
            rows.append({"attn_smem": attn, "P": P or "default", "ms": ms, "ms_again": ms2,
                         "tasks": n, "token": tok})
            print(rows[-1], flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    print("\n| attn smem | P | ms (graph) | again | tasks | token |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['attn_smem']} | {r['P']} | {r['ms']:.3f} | {r['ms_again']:.3f} | {r['tasks']} | {r['token']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
