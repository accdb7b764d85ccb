"""What code size costs on this GPU: the SM's instruction cache, measured (NOTES v58).

One CTA of W warps runs a straight block of S KB of independent FFMAs (16 bytes each) twice, a
loop of two passes, and records clock64 around each pass. Pass 0 fetches the block from L2
(the kernel's second launch: the code is in L2 by then); pass 1 runs it again, at the issue
rate while the block fits the SM's instruction cache, and fetching it again once it does not.
The megakernel's layer runs ~100-150 KB of device functions one after another (bench/sass.py),
so the size where pass 1 slows down says whether each task starts with cold code.

    python bench/icache_probe.py --sizes 8 16 32 64 96 128 192 256 --warps 1 16

Prints cycles a KB for each size, pass and warp count; writes the table as JSON (--json).
"""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_tool import have_gpu, parser  # noqa: E402

CHAINS = 8          # independent FFMA chains: one warp issues one a cycle (latency 4)


def kernel_source(sizes_kb: list[int]) -> str:
    """One kernel a size, `probe_<S>`: the block of S KB run twice, clock64 around each pass."""
    out = ["struct Args { float* out; long long* t; };"]
    for s in sizes_kb:
        body = "\n".join(f"    a{i % CHAINS} = fmaf(a{i % CHAINS}, 1.0001f, 0.5f);" for i in range(s * 1024 // 16))
        init = " ".join(f"float a{i} = x + {i}.f;" for i in range(CHAINS))
        total = " + ".join(f"a{i}" for i in range(CHAINS))
        out.append(f"""extern "C" __global__ void probe_{s}(const __grid_constant__ Args A) {{
  const float x = A.out[threadIdx.x];
  {init}
#pragma unroll 1
  for (int r = 0; r < 2; r++) {{
    __syncthreads();
    const long long c0 = clock64();
{body}
    __syncthreads();
    const long long c1 = clock64();
    if (threadIdx.x == 0) {{ A.t[2 * r] = c0; A.t[2 * r + 1] = c1; }}
  }}
  A.out[threadIdx.x] = {total};
}}""")
    return "\n".join(out)


def measure(sizes_kb: list[int], warps: list[int]) -> list[dict]:
    import torch
    from amk.backends.cuda.compile import compile_source
    from amk.backends.cuda.driver import Kernel
    cubin = compile_source(kernel_source(sizes_kb), "sm_90a", use_cache=False).cubin
    out = torch.ones(1024, device="cuda")
    t = torch.zeros(4, dtype=torch.int64, device="cuda")
    args = struct.pack("QQ", out.data_ptr(), t.data_ptr())
    stream = torch.cuda.current_stream().cuda_stream
    rows = []
    for s in sizes_kb:
        k = Kernel(cubin, f"probe_{s}", torch.cuda.current_device(), 0)
        for w in warps:
            for launch in range(2):                     # the second launch: code in L2
                k.launch(1, 32 * w, stream, args)
                torch.cuda.synchronize()
            c = t.tolist()
            p0, p1 = c[1] - c[0], c[3] - c[2]
            rows.append({"kb": s, "warps": w, "pass0_cycles": p0, "pass1_cycles": p1,
                         "pass0_per_kb": p0 / s, "pass1_per_kb": p1 / s})
    return rows


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 64, 96, 128, 192, 256],
                    help="code sizes in KB (default %(default)s)")
    ap.add_argument("--warps", type=int, nargs="+", default=[1, 16], help="warps in the CTA")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if any(s <= 0 for s in a.sizes) or any(not 1 <= w <= 32 for w in a.warps):
        ap.error("--sizes must be positive KB and --warps in 1..32")
    if not have_gpu(__file__):
        return 2
    rows = measure(a.sizes, a.warps)
    print("KB | warps | pass 0 cycles/KB | pass 1 cycles/KB")
    print("---|---|---|---")
    for r in rows:
        print(f"{r['kb']} | {r['warps']} | {r['pass0_per_kb']:.0f} | {r['pass1_per_kb']:.0f}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
