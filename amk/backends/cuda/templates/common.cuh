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
// An E4M3 byte (s eeee mmm, bias 7, no infinities) as fp32, exactly: normal (1 + m/8) 2^(e-7)
// is the fp32 with exponent e + 120 and mantissa m << 20; subnormal m 2^-9.
__device__ __forceinline__ float fp8e4m3_to_f(unsigned b) {
  const unsigned e = (b >> 3) & 15u, m = b & 7u;
  const float v = e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : (float)m * 0.001953125f;
  return (b & 0x80u) ? -v : v;
}
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

// Rope's frequency 1 / theta^(fj / half), for models without a frequency table. Out of line:
// inlined, powf was ~110 instructions in the attention that the 1B step (a table) never runs.
__device__ __noinline__ float rope_inv_pow(float theta, int fj, int half) {
  return 1.0f / powf(theta, (float)fj / (float)half);
}

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

// Element i of a padded x staging (PAD: 4 floats after every 32, xpad_at): 16-byte reads of
// consecutive lanes' vectors (32 or 16 floats each) fall in distinct banks without rotating
// them (op_gemv_qdirect's XPAD).
template <bool PAD> __device__ __forceinline__ int xpad_at(int i) { return PAD ? i + ((i >> 5) << 2) : i; }

// xs[0:n) = x[0:n) as fp32 (PAD: at xpad_at): each thread's (up to) 16 loads issued before any
// store (a GEMV's x staging: one round trip for n <= 16 * NT, not n / NT dependent ones).
template <class TX, bool PAD = false>
__device__ __forceinline__ void stage_f32(float* xs, const TX* x, int n) {
  for (int i0 = threadIdx.x; i0 < n; i0 += 16 * NT) {
    float v[16];
#pragma unroll
    for (int k = 0; k < 16; k++) v[k] = i0 + k * NT < n ? to_f(x[i0 + k * NT]) : 0.f;
#pragma unroll
    for (int k = 0; k < 16; k++) if (i0 + k * NT < n) xs[xpad_at<PAD>(i0 + k * NT)] = v[k];
  }
}

__device__ __forceinline__ long long read_int(const void* p, int is64) {
  return is64 ? *(const long long*)p : (long long)*(const int*)p;
}

// Split-KV's live window and live shard count (regions.live_window, regions.live_shards): the
// rows [lo, hi) of [lo, lo + len) that pos allows (rows <= p; win > 0: also rows > p - win), and
// how many of `shards` shards split them, each at least `rows` rows (rows 0: all of them).
// The attention and the combine both count with these, so they agree on every step.
__device__ __forceinline__ void kv_live_window(long long p, int win, long long& lo, long long& hi) {
  if (hi > p + 1) hi = p + 1;
  if (win > 0 && lo < p + 1 - win) lo = p + 1 - win;
  if (hi < lo) hi = lo;
}
__device__ __forceinline__ int kv_live_shards(int n, int shards, int rows) {
  if (rows <= 0) return shards;
  const int l = n / rows;
  return l < 1 ? 1 : l > shards ? shards : l;
}

// Cross-CTA synchronisation.
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned ld_volatile(const unsigned* p) { return *(const volatile unsigned*)p; }
// Release at GPU scope after a __syncthreads: cumulative, so it publishes every thread's writes
// (the CUTLASS semaphore pattern); a MEMBAR.ALL, not the MEMBAR.SC of __threadfence.
__device__ __forceinline__ void red_release_add(unsigned* p, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned long long global_timer() {
  unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}
// AMK_PROFILE: AMK_MARK(k), k < AMK_PROF_MARKS, records %globaltimer (thread 0) at point k of a
// device function, in the row the scheduler points amk_mark_row at: step s < AMK_PROF_STEPS of
// the task (a plain task: 0) has the words AMK_PROF_MARK0 + s * AMK_PROF_MARKS + k
// (CudaProgram.profile_marks, bench/profile/profile_decode.py). Nothing otherwise.
#ifdef AMK_PROFILE
__shared__ unsigned long long* amk_mark_row;
#define AMK_MARK(k) do { static_assert((k) < AMK_PROF_MARKS, "AMK_MARK"); \
  if (threadIdx.x == 0 && amk_mark_row) amk_mark_row[(k)] = global_timer(); } while (0)
#else
#define AMK_MARK(k) do { } while (0)
#endif
__device__ __forceinline__ void raise_fault(KernelState* st, int code, int task, int value) {
  if (atomicCAS((int*)&st->fault, 0, code) == 0) { st->fault_task = task; st->fault_value = value; }
}

// The bulk copies into shared memory (a GEMV tile's preload, a combine's partials) complete on
// mbarriers; one that never lands raises FAULT_COPY after the watchdog (mbar_wait_slow).
// AMK_INIT_THREAD (not thread 0: thread 0 spins and fences on counters) sets this up.
#define AMK_INIT_THREAD 32
struct BulkWatch {
  unsigned dead, pad0;
  unsigned long long watchdog_ns;
  KernelState* st;
};
__shared__ BulkWatch amk_bw;
// AMK_PRE: the next task's first GEMV rows (preload.py), bulk-copied to smem + AMK_PRE_OFF by
// thread 0 during the task before it, complete phase amk_pre_n - 1 of amk_pre_bar (amk_pre_n:
// preloads this CTA issued). amk_pre_ranges[slot]: the running task's ranges to copy (the
// descriptor slot's), amk_pre_pending of them not yet issued (thread 0's bookkeeping).
__shared__ __align__(8) unsigned long long amk_pre_bar;
__shared__ unsigned amk_pre_n;
__shared__ int amk_pre_pending, amk_pre_slot;
__shared__ RangeDesc amk_pre_ranges[2][AMK_PRE ? 2 : 1];
__device__ __forceinline__ unsigned smem_u32(const void* p) {
  unsigned r;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}
// Per-thread asynchronous copies global -> shared (cp.async), completed by commit groups.
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" :: "r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {   // L2 only, not L1
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(smem_u32(dst)), "l"(src) : "memory");
}
// 16 zero bytes, reading nothing (src-size 0): a copy past the end of a row
__device__ __forceinline__ void cp_async16_zero(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, 0;" :: "r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}
__device__ __forceinline__ void mbar_init(unsigned long long* b, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_u32(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned long long* b, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_u32(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(unsigned long long* b, unsigned parity) {
  unsigned ok;
  asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
               : "=r"(ok) : "r"(smem_u32(b)), "r"(parity) : "memory");
  return ok != 0;
}
// Wait for phase `parity` of b to complete. A copy that never lands (a bug, never a schedule
// property: copies depend on nothing) raises FAULT_COPY after the watchdog instead of hanging.
__device__ __noinline__ bool mbar_wait_slow(unsigned long long* b, unsigned parity) {
  const unsigned long long t0 = global_timer();
  for (;;) {
    if (mbar_try_wait(b, parity)) return true;
    if (amk_bw.dead || global_timer() - t0 > amk_bw.watchdog_ns) {
      amk_bw.dead = 1;
      raise_fault(amk_bw.st, FAULT_COPY, -1, 0);
      atomicExch(&amk_bw.st->abort, 1u);
      return false;
    }
  }
}
__device__ __forceinline__ bool mbar_wait(unsigned long long* b, unsigned parity) {
  return mbar_try_wait(b, parity) || mbar_wait_slow(b, parity);
}
// global -> shared by the bulk-copy engine (16-byte aligned addresses and size), completing
// `bytes` of b's transaction count. A 1-CTA cluster is implicit, so shared::cluster is ours.
__device__ __forceinline__ void bulk_g2s(const void* dst, unsigned long long src, unsigned bytes,
                                         unsigned long long* b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(b)) : "memory");
}
// Orders this thread's view of earlier generic-proxy shared-memory accesses (made its view by a
// barrier) before its later bulk copies (async proxy) into the same bytes.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// The split-KV combine's bulk copies of its partials (op_combine): the barrier completes once per
// use; amk_comb_uses counts the completed uses (the next completes phase parity amk_comb_uses & 1).
// op_combine reads it on entry and thread 0 counts the use once every thread has waited.
__shared__ __align__(8) unsigned long long amk_comb_bar;
__shared__ unsigned amk_comb_uses;
// Thread 0: issue the pending preload, once (the staged attention calls it after its own loads
// are issued; the scheduler when the task ends).
__device__ __forceinline__ void preload_next(char* smem) {
  if (!AMK_PRE || amk_pre_pending == 0) return;
  const RangeDesc* r = amk_pre_ranges[amk_pre_slot];
  unsigned total = 0;
#pragma unroll 1                          // a range or two: unrolled, 85 never-run instructions a caller
  for (int i = 0; i < amk_pre_pending; i++) total += (unsigned)r[i].bytes;
  mbar_expect_tx(&amk_pre_bar, total);
#pragma unroll 1
  for (int i = 0, off = 0; i < amk_pre_pending; off += (int)r[i].bytes, i++)
    bulk_g2s(smem + AMK_PRE_OFF + off, r[i].addr, (unsigned)r[i].bytes, &amk_pre_bar);
  amk_pre_n++;
  amk_pre_pending = 0;
}
