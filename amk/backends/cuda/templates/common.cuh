// Freestanding helpers: no CUDA headers needed (NVRTC built-ins only).
// bf16/f16 are 16-bit structs converted with bit ops / PTX cvt, so nothing depends on cuda_bf16.h.
#define NT AMK_NTHREADS
#define NWARPS (NT / 32)
#define AMK_ARGS d, P, smem, st
#define AMK_PARAMS const TaskDesc& d, void* const* P, char* smem, KernelState* st

struct bf16 { unsigned short x; };
struct f16 { unsigned short x; };

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(bf16 v) { return __uint_as_float(((unsigned)v.x) << 16); }
__device__ __forceinline__ float to_f(f16 v) {
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.x)); return f;
}
__device__ __forceinline__ float to_f(int v) { return (float)v; }
__device__ __forceinline__ float to_f(long long v) { return (float)v; }
__device__ __forceinline__ float to_f(signed char v) { return (float)v; }
__device__ __forceinline__ float to_f(unsigned char v) { return (float)v; }

template <class T> __device__ __forceinline__ T from_f(float f);
template <> __device__ __forceinline__ float from_f<float>(float f) { return f; }
template <> __device__ __forceinline__ bf16 from_f<bf16>(float f) {
  unsigned u = __float_as_uint(f);
  bf16 r;
  if ((u & 0x7fffffffu) > 0x7f800000u) { r.x = (unsigned short)((u >> 16) | 0x40u); return r; }
  u += 0x7fffu + ((u >> 16) & 1u);          // round to nearest even, like torch
  r.x = (unsigned short)(u >> 16);
  return r;
}
template <> __device__ __forceinline__ f16 from_f<f16>(float f) {
  f16 r; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.x) : "f"(f)); return r;
}
template <> __device__ __forceinline__ int from_f<int>(float f) { return (int)f; }
template <> __device__ __forceinline__ long long from_f<long long>(float f) { return (long long)f; }
template <> __device__ __forceinline__ signed char from_f<signed char>(float f) { return (signed char)(int)f; }
template <> __device__ __forceinline__ unsigned char from_f<unsigned char>(float f) { return (unsigned char)(int)f; }

// A cast that is exact between equal types (COPY is a plain cast, no fp32 detour).
template <class TY, class TX> struct Cast { __device__ static TY go(TX x) { return from_f<TY>(to_f(x)); } };
template <class T> struct Cast<T, T> { __device__ static T go(T x) { return x; } };

template <class T> struct VecN { static constexpr int N = 16 / sizeof(T); };

// 16-byte read-only load that skips L1 (weights: read once per step, never written in-kernel).
__device__ __forceinline__ uint4 ldg_stream(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ uint4 ld16(const void* p) { return *(const uint4*)p; }

// 16 bytes -> N floats (integer types never take this path; the template keeps them compiling).
template <class T> __device__ __forceinline__ void unpack(uint4, float*, T*) {}
__device__ __forceinline__ void unpack(uint4 v, float* o, bf16*) {
  unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; i++) { o[2 * i] = __uint_as_float(w[i] << 16); o[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u); }
}
__device__ __forceinline__ void unpack(uint4 v, float* o, f16*) {
  unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; i++) {
    f16 a, b; a.x = (unsigned short)(w[i] & 0xffffu); b.x = (unsigned short)(w[i] >> 16);
    o[2 * i] = to_f(a); o[2 * i + 1] = to_f(b);
  }
}
__device__ __forceinline__ void unpack(uint4 v, float* o, float*) {
  o[0] = __uint_as_float(v.x); o[1] = __uint_as_float(v.y); o[2] = __uint_as_float(v.z); o[3] = __uint_as_float(v.w);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Block-wide reductions; every thread gets the result. Uses a small static shared array.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float red[NWARPS];
  v = warp_sum(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = 0.f;
#pragma unroll
  for (int i = 0; i < NWARPS; i++) r += red[i];
  return r;
}
__device__ __forceinline__ float block_max(float v) {
  __shared__ float red[NWARPS];
  v = warp_max(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = red[0];
#pragma unroll
  for (int i = 1; i < NWARPS; i++) r = fmaxf(r, red[i]);
  return r;
}

__device__ __forceinline__ long long read_int(const void* p, int is64) {
  return is64 ? *(const long long*)p : (long long)*(const int*)p;
}

// Cross-CTA synchronisation.
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned ld_volatile(const unsigned* p) { return *(const volatile unsigned*)p; }
__device__ __forceinline__ unsigned long long global_timer() {
  unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}
// Bring [p, p+n) into L2 (no registers, no completion to wait for). Safe for any region: L2 is
// the coherence point, so prefetching memory another CTA will still write cannot go stale.
__device__ __forceinline__ void prefetch_l2(unsigned long long p, unsigned long long n) {
  unsigned long long lo = p & ~15ull, hi = (p + n + 15ull) & ~15ull;
  for (unsigned long long a = lo; a < hi; a += 65536ull) {
    unsigned long long c = hi - a < 65536ull ? hi - a : 65536ull;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(a), "r"((unsigned)c) : "memory");
  }
}

__device__ __forceinline__ void raise_fault(KernelState* st, int code, int task, int value) {
  if (atomicCAS((int*)&st->fault, 0, code) == 0) { st->fault_task = task; st->fault_value = value; }
}

// ---- the weight ring: GEMV weight chunks stream global -> shared with cp.async (16 B each,
// L1 bypassed). A task's chunks (ranges[ck_begin : +n_ck]) go to stage c % RING_STAGES; the
// scheduler issues the first RING_STAGES before the task's counter wait, each GEMV refills the
// stage it just consumed. One commit group per chunk slot (empty past the end), so chunk c is
// always complete after cp.async.wait_group RING_STAGES-1. Warp 0 issues no copies: its
// thread 0 spins and fences on counters and must not wait for these.
__shared__ unsigned long long amk_s_ranges;      // A.ranges, set once per launch
__device__ __forceinline__ unsigned smem_u32(const void* p) {
  unsigned r;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}
// The chunk's range: read it early (its load latency then hides behind other work).
__device__ __forceinline__ RangeDesc ring_range(const TaskDesc& d, int c) {
  RangeDesc r; r.addr = 0; r.bytes = 0;
  if (c < d.n_ck && threadIdx.x >= 32) r = ((const RangeDesc*)amk_s_ranges)[d.ck_begin + c];
  return r;
}
__device__ __forceinline__ void ring_issue_range(char* smem, int c, RangeDesc r) {
  if (r.bytes != 0) {
    const unsigned long long src = r.addr, n = r.bytes;
    const unsigned dst = smem_u32(smem + AMK_RING_OFF + (c % AMK_RING_STAGES) * AMK_CHUNK);
    for (unsigned long long o = (threadIdx.x - 32) * 16ull; o < n; o += (NT - 32) * 16ull)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst + (unsigned)o), "l"(src + o) : "memory");
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}
__device__ __forceinline__ void ring_issue(char* smem, const TaskDesc& d, int c) {
  ring_issue_range(smem, c, ring_range(d, c));
}
__device__ __forceinline__ void ring_wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(AMK_RING_STAGES - 1) : "memory");
}
