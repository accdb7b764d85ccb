"""cuBLAS batch-1 GEMV speed on the Llama-3.2-1B weight shapes: the rate one GEMV op reaches on
this GPU (torch's x @ W.T, 20 calls in one CUDA graph), to compare with the megakernel's GB/s
per SM in bench/profile_decode.py. Prints a table; writes JSON with --json.

    python bench/gemv_reference.py --json gemv.json
"""
from __future__ import annotations

import sys
import time

import torch
from gpu_tool import have_gpu, parser, write_rows  # noqa: E402  (bench/ is sys.path[0] for a script)

SHAPES = {"gate+up": (16384, 2048), "down": (2048, 8192), "q / o": (2048, 2048),
          "lm_head": (128256, 2048)}


def gemv_us(n: int, k: int, calls: int = 20, reps: int = 10) -> float:
    W = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        x @ W.t()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            x @ W.t()
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (reps * calls) * 1e6


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not have_gpu(__file__):
        return 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    print(f"{'weight':>10} {'shape':>14} {'us':>8} {'TB/s':>6} {'GB/s/SM':>8}")
    for name, (n, k) in SHAPES.items():
        us = gemv_us(n, k)
        tbs = n * k * 2 / us / 1e6
        rows.append({"weight": name, "n": n, "k": k, "us": us, "TBps": tbs, "GBps_per_sm": tbs * 1e3 / sms})
        print(f"{name:>10} {f'[{n},{k}]':>14} {us:8.1f} {tbs:6.2f} {tbs * 1e3 / sms:8.1f}")
    write_rows(a.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
