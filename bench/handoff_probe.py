"""What does one stage hand-off cost, and how much would a flag-in-the-data hand-off save? A
research probe for the megakernel's stage boundaries (bench/NOTES.md v15).

One CTA per SM runs R rounds. A round streams the CTA's rows of a bf16 W [.., 2048] (a GEMV
stage of `rpc` rows a CTA; rows never reused, so they come from HBM) against x, then the first
128 CTAs each produce 16 values of the next round's x (2048 floats), which every CTA needs
before its next round: the megakernel's down -> q/k/v or o -> gate/up boundary. Modes:
  counter  the megakernel's way: plain stores, CTA barrier, thread 0's `red.release.gpu` on a
           counter; the consumer's thread 0 polls it with `ld.acquire` and __nanosleep backoff,
           barrier, then every thread loads x (a second round trip)
  ll       NCCL's LL protocol: each value goes out as one 8-byte word (value, round flag), a
           single-copy-atomic store with no fence; every consumer thread polls its own words
           (4 adjacent ones) until their flags are the round's, so the data is the signal
  ll-coal  the same, each thread's words NT apart (a warp's loads coalesced)
  none     no hand-off at all (x is not waited for): the rounds' streaming alone
The in-flight depth U (16-byte loads a lane per row) and the poll's longest sleep vary too.
Each CTA times its rounds with %globaltimer; span = last end - first start, per round. The
consumers check every value they got (wrong values are counted and printed: a race shows).

    python bench/handoff_probe.py [--json out.json]
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
NT = 512
PRODUCERS = 128          # x = 128 producers x 16 values
SRC = r"""
#define NWARPS (NT / 32)
struct Args { unsigned long long W, x, ll, cnt, t, sink, bad; int rounds, rpc, n_rows; };
__device__ __forceinline__ unsigned long long gtimer() {
  unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ uint4 ld_nc(const char* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ float dot8(float a, uint4 w, const float* x) {
  const unsigned u[4] = {w.x, w.y, w.z, w.w};
  const float4 x0 = ((const float4*)x)[0], x1 = ((const float4*)x)[1];
  return a + __uint_as_float(u[0] << 16) * x0.x + __uint_as_float(u[0] & 0xffff0000u) * x0.y
           + __uint_as_float(u[1] << 16) * x0.z + __uint_as_float(u[1] & 0xffff0000u) * x0.w
           + __uint_as_float(u[2] << 16) * x1.x + __uint_as_float(u[2] & 0xffff0000u) * x1.y
           + __uint_as_float(u[3] << 16) * x1.z + __uint_as_float(u[3] & 0xffff0000u) * x1.w;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v; asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ unsigned long long ld_relaxed64(const unsigned long long* p) {
  unsigned long long v; asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ void st_relaxed64(unsigned long long* p, unsigned long long v) {
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" :: "l"(p), "l"(v) : "memory"); }
// the value every producer writes for x[i] of round r (exact in fp32)
__device__ __forceinline__ float xval(int r, int i) { return (float)((r * 7 + i) & 1023) * 0.25f; }

extern "C" __global__ void __launch_bounds__(NT, 1) probe(const __grid_constant__ Args a) {
  __shared__ __align__(16) float xs[KC];
  __shared__ float sums[NWARPS];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, b = blockIdx.x;
  const long long row_bytes = KC * 2;
  float* x = (float*)a.x;                                   // [rounds + 1][KC] (counter mode)
  unsigned long long* ll = (unsigned long long*)a.ll;       // [rounds + 1][KC] (ll mode): no reuse
  unsigned* cnt = (unsigned*)a.cnt;
  unsigned bad = 0;
  float keep = 0.f;
  for (int i = threadIdx.x; i < KC; i += NT) xs[i] = xval(0, i);
  __syncthreads();
  const unsigned long long t0 = gtimer();
  for (int r = 0; r < a.rounds; r++) {
    // the stage's stream: rows [(r * G + b) * rpc, +rpc) of W (wrapping), two rows a warp
    const long long rb0 = ((long long)(r * gridDim.x + b) * a.rpc) % (a.n_rows - a.rpc + 1);
    float acc = 0.f;
    for (int rw = warp * 2; rw < a.rpc; rw += NWARPS * 2) {
      float s0 = 0.f, s1 = 0.f;
      uint4 w0[U], w1[U];
      const char* p0 = (const char*)a.W + (rb0 + rw) * row_bytes;
      const char* p1 = p0 + (rw + 1 < a.rpc ? row_bytes : 0);
#pragma unroll
      for (int k0 = 0; k0 < KC / 256; k0 += U) {          // U 16-byte loads of each row in flight a lane
#pragma unroll
        for (int u = 0; u < U; u++) {
          w0[u] = ld_nc(p0 + ((k0 + u) * 32 + lane) * 16); w1[u] = ld_nc(p1 + ((k0 + u) * 32 + lane) * 16);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
          s0 = dot8(s0, w0[u], xs + ((k0 + u) * 32 + lane) * 8); s1 = dot8(s1, w1[u], xs + ((k0 + u) * 32 + lane) * 8);
        }
      }
      acc += warp_sum(s0) + warp_sum(s1);
    }
    if (lane == 0) sums[warp] = acc;
    __syncthreads();                                         // xs and sums: read and written
    if (threadIdx.x == 0) { float s = 0.f; for (int w = 0; w < NWARPS; w++) s += sums[w]; keep += s; }
    // produce: 16 values of the next round's x (the stream's sum kept alive in `keep`)
    const int nr = r + 1;
    if (b < PRODUCERS && threadIdx.x < 16) {
      const int i = b * 16 + threadIdx.x;
#if MODE == 0
      x[nr * KC + i] = xval(nr, i);
#elif MODE != 2
      st_relaxed64(ll + nr * KC + i, ((unsigned long long)(unsigned)nr << 32) | __float_as_uint(xval(nr, i)));
#endif
    }
#if MODE == 0
    __syncthreads();
    if (threadIdx.x == 0 && b < PRODUCERS)
      asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(cnt), "r"(1u) : "memory");
    if (threadIdx.x == 0) {
      unsigned ns = 16;
      while (ld_acquire(cnt) < (unsigned)(PRODUCERS * nr)) { __nanosleep(ns); if (ns < SPIN) ns <<= 1; }
    }
    __syncthreads();
    {
      const float4 v = ((const float4*)(x + nr * KC))[threadIdx.x];   // KC == 4 NT
      ((float4*)xs)[threadIdx.x] = v;
    }
#elif MODE == 1
    {
      const unsigned long long* src = ll + nr * KC + 4 * threadIdx.x;
      unsigned long long v[4];
      unsigned ns = 16;
      for (;;) {
#pragma unroll
        for (int k = 0; k < 4; k++) v[k] = ld_relaxed64(src + k);
        bool ok = true;
#pragma unroll
        for (int k = 0; k < 4; k++) ok = ok && (unsigned)(v[k] >> 32) == (unsigned)nr;
        if (ok) break;
        __nanosleep(ns); if (ns < SPIN) ns <<= 1;
      }
#pragma unroll
      for (int k = 0; k < 4; k++) xs[4 * threadIdx.x + k] = __uint_as_float((unsigned)v[k]);
    }
#elif MODE == 3
    {
      const unsigned long long* src = ll + nr * KC + threadIdx.x;     // coalesced: word k NT + t
      unsigned long long v[4];
      unsigned ns = 16;
      for (;;) {
#pragma unroll
        for (int k = 0; k < 4; k++) v[k] = ld_relaxed64(src + k * NT);
        bool ok = true;
#pragma unroll
        for (int k = 0; k < 4; k++) ok = ok && (unsigned)(v[k] >> 32) == (unsigned)nr;
        if (ok) break;
        __nanosleep(ns); if (ns < SPIN) ns <<= 1;
      }
#pragma unroll
      for (int k = 0; k < 4; k++) xs[k * NT + threadIdx.x] = __uint_as_float((unsigned)v[k]);
    }
#else
    for (int i = threadIdx.x; i < KC; i += NT) xs[i] = xval(nr, i);
#endif
    __syncthreads();
#if MODE != 2
    for (int i = threadIdx.x; i < KC; i += NT) bad += xs[i] != xval(nr, i);
#endif
  }
  const unsigned long long t1 = gtimer();
  if (bad) atomicAdd((unsigned*)a.bad, bad);
  if (threadIdx.x == 0) {
    ((float*)a.sink)[b] = keep;
    ((unsigned long long*)a.t)[2 * b] = t0;
    ((unsigned long long*)a.t)[2 * b + 1] = t1;
  }
}
"""

MODES = {"counter": 0, "ll": 1, "none": 2, "ll-coal": 3}
CONFIGS = ([dict(rpc=rpc, mode=m, spin=128, u=u) for u in (8, 4, 2) for rpc in (0, 24, 128)
            for m in ("counter", "none") if rpc or u == 8]
           + [dict(rpc=rpc, mode=m, spin=s, u=8) for m in ("ll", "ll-coal") for rpc in (0, 24, 128)
              for s in (32, 128)])


def source(cfg: dict) -> str:
    """The probe kernel's CUDA source for one config (its knobs as macros)."""
    return (f"#define NT {NT}\n#define KC {K_COLS}\n#define PRODUCERS {PRODUCERS}\n"
            f"#define MODE {MODES[cfg['mode']]}\n#define SPIN {cfg['spin']}\n#define U {cfg['u']}\n" + SRC)


def build(cfg: dict) -> Kernel:
    res = compile_source(source(cfg), "sm_90a")
    return Kernel(res.cubin, "probe", torch.cuda.current_device(), 0)


def run(cfg: dict, W: torch.Tensor, rounds: int = 32, reps: int = 7) -> dict:
    k = build(cfg)
    g = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.zeros((rounds + 1) * K_COLS, device="cuda")
    ll = torch.zeros((rounds + 1) * K_COLS, dtype=torch.int64, device="cuda")
    cnt = torch.zeros(1, dtype=torch.int32, device="cuda")
    t = torch.zeros(2 * g, dtype=torch.int64, device="cuda")
    sink = torch.zeros(g, device="cuda")
    bad = torch.zeros(1, dtype=torch.int32, device="cuda")
    spans = []
    for _ in range(reps):
        for z in (x, ll, cnt):
            z.zero_()
        args = struct.pack("QQQQQQQiii", W.data_ptr(), x.data_ptr(), ll.data_ptr(), cnt.data_ptr(),
                           t.data_ptr(), sink.data_ptr(), bad.data_ptr(), rounds, cfg["rpc"], W.shape[0])
        k.launch(g, NT, torch.cuda.current_stream().cuda_stream, args)
        torch.cuda.synchronize()
        spans.append(cta_span_us(t, g) / rounds)
    return {**cfg, "us_per_round": warm_median(spans), "bad_values": int(bad.item()), "regs": k.num_regs,
            "local_bytes": k.local_bytes}


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not have_gpu(__file__):
        return 2
    W = torch.randn(4 * 132 * 1024, K_COLS, device="cuda").to(torch.bfloat16)   # 1.1 GB
    print(f"{'rows a CTA':>10} {'mode':>8} {'u':>3} {'spin':>5} {'us/round':>9} {'bad':>5} {'regs':>5}")
    rows = sweep(CONFIGS, lambda cfg: run(cfg, W),
                 lambda r: (f"{r['rpc']:>10} {r['mode']:>8} {r['u']:>3} {r['spin']:>5} {r['us_per_round']:9.2f} "
                            f"{r['bad_values']:5d} {r['regs']:5d}"))
    write_rows(a.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
