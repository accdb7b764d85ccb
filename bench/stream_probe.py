"""How fast can one persistent CTA per SM stream a bf16 weight matrix? A research probe for the
megakernel's GEMV (bench/NOTES.md v9): small standalone kernels, compiled with NVRTC like the
megakernel, each CTA timing itself with %globaltimer (span = last end - first start), so a
15 us "stage" is measured without launch gaps.

Each config streams rows of W [rows, 2048] bf16 (4 KiB a row): CTA b takes rows
[b * rpc, (b + 1) * rpc). Knobs (one macro each):
  nt      threads a CTA              g     CTAs (132 = one per SM)
  u       16-byte loads a lane per row in flight (direct loads)
  rpw     rows a warp works on at once (direct loads)
  hint    0 plain ld.global, 1 .nc.L1::no_allocate, 2 (1) + .L2::256B
  dot     1 = the GEMV dot with x (fp32 in smem), 0 = only touch the bits
  order   0 warps interleave rows (op_gemv), 1 each warp a contiguous block of rows
  bulk    S x K: no direct loads; one thread keeps S bulk copies of K KiB in flight into smem,
          all warps consume each chunk (the bulk-copy ring)
  pf      percent of the CTA's rows (its first ones) brought into L2 by cp.async.bulk.prefetch
          before the timed stream starts, pf_us microseconds earlier (does an L2-resident share
          of a tile stream faster? NOTES v11)

    python bench/stream_probe.py [--json out.json]
"""
from __future__ import annotations

import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # amk without PYTHONPATH

import torch  # noqa: E402
from gpu_tool import cta_span_us, have_gpu, parser, sweep, warm_median, write_rows  # noqa: E402  (bench/ is sys.path[0] for a script)

from amk.backends.cuda.compile import compile_source  # noqa: E402
from amk.backends.cuda.driver import Kernel  # noqa: E402

K_COLS = 2048
SRC = r"""
#define NWARPS (NT / 32)
struct Args { unsigned long long W, x, y, t; int rpc, n_rows; };
__device__ __forceinline__ unsigned long long gtimer() {
  unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ uint4 ld(const char* p) {
  uint4 v;
#if HINT == 0
  asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#elif HINT == 1
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#else
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#endif
  return v;
}
__device__ __forceinline__ float dot8(float a, uint4 w, const float* x) {
#if DOT
  const unsigned u[4] = {w.x, w.y, w.z, w.w};
  const float4 x0 = ((const float4*)x)[0], x1 = ((const float4*)x)[1];
  a += __uint_as_float(u[0] << 16) * x0.x + __uint_as_float(u[0] & 0xffff0000u) * x0.y
     + __uint_as_float(u[1] << 16) * x0.z + __uint_as_float(u[1] & 0xffff0000u) * x0.w
     + __uint_as_float(u[2] << 16) * x1.x + __uint_as_float(u[2] & 0xffff0000u) * x1.y
     + __uint_as_float(u[3] << 16) * x1.z + __uint_as_float(u[3] & 0xffff0000u) * x1.w;
  return a;
#else
  return a + __uint_as_float((w.x ^ w.y ^ w.z ^ w.w) & 0x3fffffffu);
#endif
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ unsigned smem_u32(const void* p) {
  unsigned r; asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p)); return r; }

extern "C" __global__ void __launch_bounds__(NT, 1) probe(const __grid_constant__ Args a) {
  extern __shared__ __align__(16) float xs[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const long long row_bytes = KC * 2;
  const int r0 = blockIdx.x * a.rpc;
  int r1 = r0 + a.rpc; if (r1 > a.n_rows) r1 = a.n_rows;
  const char* W = (const char*)a.W;
#if PF > 0
  {
    const unsigned long long ts = gtimer();
    const long long pf_bytes = (long long)(r1 - r0) * PF / 100 * row_bytes;
    if (threadIdx.x == 0)
      for (long long o = 0; o < pf_bytes; o += 65536)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(W + r0 * row_bytes + o),
                     "r"((unsigned)(pf_bytes - o < 65536 ? pf_bytes - o : 65536)) : "memory");
    while (gtimer() - ts < PF_US * 1000ull) { }
    __syncthreads();
  }
#endif
  const unsigned long long t0 = gtimer();
  for (int i = threadIdx.x; i < KC; i += NT) xs[i] = ((const float*)a.x)[i];
  __syncthreads();
  float* y = (float*)a.y;
  constexpr int NV = KC / 8;                       // 16-byte vectors a row
#if BULK_S == 0
  const int per_warp = (a.rpc + NWARPS - 1) / NWARPS;
  const int wb = ORDER == 0 ? r0 + warp * RPW : r0 + warp * per_warp;
  const int we = ORDER == 0 ? r1 : min(r1, wb + per_warp);
  const int step = ORDER == 0 ? NWARPS * RPW : RPW;
  for (int rb = wb; rb < we; rb += step) {
    float acc[RPW];
#pragma unroll
    for (int r = 0; r < RPW; r++) acc[r] = 0.f;
    for (int v0 = lane; v0 < NV; v0 += 32 * U) {
      uint4 w[RPW][U];
#pragma unroll
      for (int r = 0; r < RPW; r++)
#pragma unroll
        for (int u = 0; u < U; u++) {
          const int v = v0 + 32 * u;
          w[r][u] = (rb + r < we && v < NV) ? ld(W + (long long)(rb + r) * row_bytes + v * 16ll) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
      for (int r = 0; r < RPW; r++)
#pragma unroll
        for (int u = 0; u < U; u++)
          if (v0 + 32 * u < NV) acc[r] = dot8(acc[r], w[r][u], xs + (v0 + 32 * u) * 8);
    }
#pragma unroll
    for (int r = 0; r < RPW; r++) {
      const float s = warp_sum(acc[r]);
      if (lane == 0 && rb + r < we) y[rb + r] = s;
    }
  }
#else
  // bulk-copy ring: chunk c = BULK_K bytes of this CTA's contiguous rows, S stages after x.
  __shared__ __align__(8) unsigned long long bar[BULK_S];
  char* ring = (char*)(xs + KC);
  const long long base = (long long)r0 * row_bytes, total = (long long)(r1 - r0) * row_bytes;
  const int n_chunks = (int)((total + BULK_K - 1) / BULK_K);
  if (threadIdx.x == 0) {
    for (int s = 0; s < BULK_S; s++) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_u32(&bar[s])));
    asm volatile("fence.mbarrier_init.release.cluster;\n\tfence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](int c) {
    const long long off = (long long)c * BULK_K;
    const unsigned n = (unsigned)(total - off < BULK_K ? total - off : BULK_K);
    unsigned long long* b = &bar[c % BULK_S];
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_u32(b)), "r"(n) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem_u32(ring + (c % BULK_S) * BULK_K)), "l"(W + base + off), "r"(n), "r"(smem_u32(b)) : "memory");
  };
  if (threadIdx.x == 0) for (int c = 0; c < BULK_S && c < n_chunks; c++) issue(c);
  float acc = 0.f;
  for (int c = 0; c < n_chunks; c++) {
    unsigned ok = 0;
    while (!ok)
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(ok) : "r"(smem_u32(&bar[c % BULK_S])), "r"((unsigned)((c / BULK_S) & 1)) : "memory");
    const uint4* st = (const uint4*)(ring + (c % BULK_S) * BULK_K);
    for (int i = threadIdx.x; i < BULK_K / 16; i += NT) acc = dot8(acc, st[i], xs + (i % NV) * 8);
    __syncthreads();
    if (threadIdx.x == 0 && c + BULK_S < n_chunks) issue(c + BULK_S);
  }
  acc = warp_sum(acc);
  if (lane == 0) y[r0 + warp] = acc;
#endif
  __syncthreads();
  if (threadIdx.x == 0) {
    ((unsigned long long*)a.t)[2 * blockIdx.x] = t0;
    ((unsigned long long*)a.t)[2 * blockIdx.x + 1] = gtimer();
  }
}
"""

BASE = dict(nt=512, g=132, u=8, rpw=2, hint=1, dot=1, order=0, bulk=(0, 0), rpc=128, pf=0, pf_us=20)
CONFIGS = [
    dict(name="op_gemv shape (512 thr, 2x8, nc)"),
    dict(name="no dot", dot=0),
    dict(name="plain ld", hint=0),
    dict(name="L2::256B", hint=2),
    dict(name="rows blocked a warp", order=1),
    dict(name="rpw 1 u 8", rpw=1),
    dict(name="rpw 4 u 4", rpw=4, u=4),
    dict(name="rpw 1 u 16", rpw=1, u=16),
    dict(name="rpw 4 u 8", rpw=4, u=8),
    dict(name="256 thr", nt=256),
    dict(name="1024 thr rpw 1", nt=1024, rpw=1),
    dict(name="1024 thr rpw 2 u 4", nt=1024, rpw=2, u=4),
    dict(name="bulk 4x32K", bulk=(4, 32768)),
    dict(name="bulk 6x32K", bulk=(6, 32768)),
    dict(name="bulk 12x16K", bulk=(12, 16384)),
    dict(name="bulk 6x32K no dot", bulk=(6, 32768), dot=0),
    dict(name="bulk 3x64K", bulk=(3, 65536)),
    dict(name="66 CTAs", g=66),
    dict(name="33 CTAs", g=33),
    dict(name="16 CTAs", g=16),
    dict(name="264 CTAs 256 thr rpc 64", g=264, nt=256, rpc=64),
    dict(name="528 CTAs 128 thr rpc 32", g=528, nt=128, rpc=32),
    dict(name="long: rpc 1024", rpc=1024),
    dict(name="long bulk 6x32K", rpc=1024, bulk=(6, 32768)),
    dict(name="L2 prefetch 25%", pf=25),
    dict(name="L2 prefetch 50%", pf=50),
    dict(name="L2 prefetch 75%", pf=75),
    dict(name="L2 prefetch 100%", pf=100),
    dict(name="L2 prefetch 50%, 5 us ahead", pf=50, pf_us=5),
    dict(name="L2 prefetch 100%, 16 CTAs", pf=100, g=16),
    dict(name="long 528x128 rpc 256", g=528, nt=128, rpc=256),
]


def build(cfg: dict) -> Kernel:
    s, kb = cfg["bulk"]
    defs = (f"#define NT {cfg['nt']}\n#define U {cfg['u']}\n#define RPW {cfg['rpw']}\n#define HINT {cfg['hint']}\n"
            f"#define DOT {cfg['dot']}\n#define ORDER {cfg['order']}\n#define BULK_S {s}\n#define BULK_K {kb or 1}\n"
            f"#define KC {K_COLS}\n#define PF {cfg['pf']}\n#define PF_US {cfg['pf_us']}\n")
    res = compile_source(defs + SRC, "sm_90a")
    smem = K_COLS * 4 + s * kb
    return Kernel(res.cubin, "probe", torch.cuda.current_device(), smem)


def run(cfg: dict, W: torch.Tensor, reps: int = 7) -> dict:
    k = build(cfg)
    g, rpc = cfg["g"], cfg["rpc"]
    rows = min(g * rpc, W.shape[0])
    x = torch.randn(K_COLS, device="cuda")
    y = torch.empty(max(rows, g * 32), device="cuda")
    t = torch.zeros(2 * g, dtype=torch.int64, device="cuda")
    spans, means = [], []
    for i in range(reps):
        off = (i * rows) % (W.shape[0] - rows + 1)          # a fresh region each rep (no L2 reuse)
        args = struct.pack("QQQQii", W.data_ptr() + off * K_COLS * 2, x.data_ptr(), y.data_ptr(),
                           t.data_ptr(), rpc, rows)
        k.launch(g, cfg["nt"], torch.cuda.current_stream().cuda_stream, args)
        torch.cuda.synchronize()
        spans.append(cta_span_us(t, g))
        tt = t.view(g, 2).double()
        means.append(float((tt[:, 1] - tt[:, 0]).mean() / 1e3))
    span, mean = warm_median(spans), warm_median(means)
    nbytes = rows * K_COLS * 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return {**cfg, "bulk": list(cfg["bulk"]), "rows": rows, "span_us": span, "cta_mean_us": mean,
            "TBps": nbytes / span / 1e6, "GBps_per_sm": nbytes / span / 1e3 / min(g, sms),
            "regs": k.num_regs, "local_bytes": k.local_bytes}


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default=None, help="run the configs whose name contains this text")
    a = ap.parse_args(argv)
    if not have_gpu(__file__):
        return 2
    W = torch.randn(8 * 132 * 1024, K_COLS, device="cuda").to(torch.bfloat16)   # 2.2 GB
    print(f"{'config':<34} {'MB':>6} {'span us':>8} {'cta us':>8} {'TB/s':>6} {'GB/s/SM':>8} {'regs':>5}")
    cfgs = [{**BASE, **c} for c in CONFIGS]
    cfgs = [cfg for i, cfg in enumerate(cfgs) if not a.only or a.only in cfg["name"] or i == 0]
    rows = sweep(cfgs, lambda cfg: run(cfg, W),
                 lambda r: (f"{r['name']:<34} {r['rows'] * K_COLS * 2 / 1e6:6.1f} {r['span_us']:8.1f} "
                            f"{r['cta_mean_us']:8.1f} {r['TBps']:6.2f} {r['GBps_per_sm']:8.1f} {r['regs']:5d}"),
                 label=lambda cfg: f"{cfg['name']:<34}")
    write_rows(a.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
