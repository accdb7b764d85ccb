// Elementwise, norms, rope, embedding, KV append, argmax, softmax, dequant, reductions.
// Each op is one CTA's work on one task; inputs are P[0..n_in), outputs P[n_in..).

template <int KIND> __device__ __forceinline__ float ew_apply(float a, float b, float scale) {
  if (KIND == EW_ADD) return a + b;
  if (KIND == EW_MUL) return a * b;
  if (KIND == EW_MULS) return a * scale;
  if (KIND == EW_SILU_MUL) return (a / (1.0f + expf(-a))) * b;
  if (KIND == EW_GELU) return 0.5f * a * (1.0f + erff(a * 0.7071067811865476f));
  return a;
}

template <int KIND, class TY, class TA, class TB>
__device__ __noinline__ void op_ew(AMK_PARAMS) {
  const int C = d.ip[P_EW_COLS], c0 = d.ip[P_EW_C0], w = d.ip[P_EW_C1] - c0;
  const long long R = d.ip[P_EW_ROWS];
  const long long ars = d.ip[P_EW_A_RS], acs = d.ip[P_EW_A_CS], brs = d.ip[P_EW_B_RS], bcs = d.ip[P_EW_B_CS];
  const float scale = d.fp[F_EW_SCALE];
  const TA* a = (const TA*)P[0];
  const TB* b = (const TB*)P[d.n_in > 1 ? 1 : 0];
  TY* y = (TY*)P[d.n_in];
  if (w <= 0) return;
  for (long long i = threadIdx.x; i < R * w; i += NT) {
    long long r = i / w; int c = c0 + (int)(i - r * w);
    const TA av = a[r * ars + c * acs];
    if (KIND == EW_COPY) { y[r * C + c] = Cast<TY, TA>::go(av); continue; }
    const float bv = to_f(b[r * brs + c * bcs]);
    y[r * C + c] = from_f<TY>(ew_apply<KIND>(to_f(av), bv, scale));
  }
}

// SUM: out (r, c) = TY(P[0] + P[1] + ... + P[NP - 1]) at (r, c), added in fp32 in input order
// (a K-split GEMV's partials, passes/tile.py; ALLREDUCE_SHARD's shards on one device); RES
// (folds.sum_add): then TO(TY's value + the residual P[NP] at (r, c)), the ADD the SUM's output
// went to. Every partial's load in flight at once: one round trip a pass.
template <class TY, class TP, int NP, bool RES, class TR, class TO>
__device__ __noinline__ void op_sum(AMK_PARAMS) {
  const int C = d.ip[P_SUM_COLS], c0 = d.ip[P_SUM_C0], w = d.ip[P_SUM_C1] - c0;
  const long long R = d.ip[P_SUM_ROWS];
  if (w <= 0) return;
  for (long long i = threadIdx.x; i < R * w; i += NT) {
    const long long r = i / w, o = r * C + c0 + (i - r * w);
    float v[NP];
#pragma unroll
    for (int p = 0; p < NP; p++) v[p] = to_f(((const TP*)P[p])[o]);
    float s = v[0];
#pragma unroll
    for (int p = 1; p < NP; p++) s += v[p];
    const TY y = from_f<TY>(s);
    if (RES) ((TO*)P[d.n_in])[o] = from_f<TO>(to_f(y) + to_f(((const TR*)P[NP])[o]));
    else ((TY*)P[d.n_in])[o] = y;
  }
}

// One row of H <= RMS_RN * NT elements, x and w in registers (one round trip, not three):
// out = round_TY((x * rsqrt(mean(x^2) + eps)) * w), to xs (fp32; PAD: at xpad_at) when xs,
// else to y. Also the norm op_gemv_direct runs itself (NORM, folds.norm_into_gemv): the same
// bits either way.
constexpr int RMS_RN = AMK_RMS_RN;     // steps.RMS_RN: folds.norm_into_gemv folds rows this fits
template <class TX, class TW, class TY, int RN = RMS_RN, bool PAD = false>
__device__ __forceinline__ void rms_row(const TX* xr, const TW* w, int H, float eps, float* xs, TY* y) {
  float xv[RN], wv[RN], ss = 0.f;
#pragma unroll
  for (int k = 0; k < RN; k++) {
    const int i = threadIdx.x + k * NT;
    xv[k] = i < H ? to_f(xr[i]) : 0.f;
    wv[k] = i < H ? to_f(w[i]) : 0.f;
  }
#pragma unroll
  for (int k = 0; k < RN; k++) ss += xv[k] * xv[k];     // the loop below's order: same bits
  ss = block_sum(ss);
  const float rs = rsqrtf(ss / (float)H + eps);
#pragma unroll
  for (int k = 0; k < RN; k++) {
    const int i = threadIdx.x + k * NT;
    if (i < H) {
      const TY o = from_f<TY>((xv[k] * rs) * wv[k]);
      if (xs) xs[xpad_at<PAD>(i)] = to_f(o); else y[i] = o;
    }
  }
}

// Many short rows (a per-head norm: Qwen3's q/k norms, 16 rows of 128): a warp a row, all rows
// in flight at once and a shuffle sum, instead of one block-wide round trip a row in turn
// (NOTES v22: 16 rows took 10.8 us that way).
constexpr int RMS_WARP_H = 256;        // longest row a warp takes (8 elements a lane)
template <class TX, class TW, class TY>
__device__ __forceinline__ void rms_rows_warp(const TX* x, const TW* w, int H, int R, float eps, TY* y) {
  constexpr int E = RMS_WARP_H / 32;
  const int lane = threadIdx.x & 31;
  for (int r = threadIdx.x >> 5; r < R; r += NWARPS) {
    const TX* xr = x + (long long)r * H;
    float xv[E], ss = 0.f;
#pragma unroll
    for (int k = 0; k < E; k++) {
      const int i = lane + 32 * k;
      xv[k] = i < H ? to_f(xr[i]) : 0.f;
      ss += xv[k] * xv[k];
    }
    const float rs = rsqrtf(warp_sum(ss) / (float)H + eps);
#pragma unroll
    for (int k = 0; k < E; k++) {
      const int i = lane + 32 * k;
      if (i < H) y[(long long)r * H + i] = from_f<TY>((xv[k] * rs) * to_f(w[i]));
    }
  }
}

// TO_SMEM (one row, folds.norm_into_smem): the normalised row goes, rounded through TY, into
// the next GEMVs' fp32 x staging area at smem[0] instead of y.
template <class TX, class TW, class TY>
__device__ __noinline__ void op_rmsnorm(AMK_PARAMS) {
  const int H = d.ip[P_NORM_H], R = d.ip[P_NORM_ROWS];
  const float eps = d.fp[F_NORM_EPS];
  const TX* x = (const TX*)P[0]; const TW* w = (const TW*)P[1]; TY* y = (TY*)P[d.n_in];
  const bool to_smem = d.ip[P_NORM_TO_SMEM] != 0; float* xs = (float*)smem;   // see TO_SMEM
  if (R > 1 && H <= RMS_WARP_H && !to_smem) {
    rms_rows_warp<TX, TW, TY>(x, w, H, R, eps, y);
    return;
  }
  if (H <= RMS_RN * NT) {
    for (int r = 0; r < R; r++) rms_row<TX, TW, TY>(x + (long long)r * H, w, H, eps, to_smem ? xs : nullptr, y + (long long)r * H);
    return;
  }
  for (int r = 0; r < R; r++) {
    const TX* xr = x + (long long)r * H;
    float ss = 0.f;
    for (int i = threadIdx.x; i < H; i += NT) { float v = to_f(xr[i]); ss += v * v; }
    ss = block_sum(ss);
    const float rs = rsqrtf(ss / (float)H + eps);
    for (int i = threadIdx.x; i < H; i += NT) {
      const TY o = from_f<TY>((to_f(xr[i]) * rs) * to_f(w[i]));
      if (to_smem) xs[i] = to_f(o); else y[(long long)r * H + i] = o;
    }
  }
}

template <class TX, class TW, class TB, class TY, bool HAS_B>
__device__ __noinline__ void op_layernorm(AMK_PARAMS) {
  const int H = d.ip[P_NORM_H], R = d.ip[P_NORM_ROWS];
  const float eps = d.fp[F_NORM_EPS];
  const TX* x = (const TX*)P[0]; const TW* w = (const TW*)P[1];
  const TB* b = (const TB*)P[HAS_B ? 2 : 1]; TY* y = (TY*)P[d.n_in];
  const bool to_smem = d.ip[P_NORM_TO_SMEM] != 0; float* xs = (float*)smem;
  for (int r = 0; r < R; r++) {
    const TX* xr = x + (long long)r * H;
    float s = 0.f;
    for (int i = threadIdx.x; i < H; i += NT) s += to_f(xr[i]);
    const float mean = block_sum(s) / (float)H;
    float v = 0.f;
    for (int i = threadIdx.x; i < H; i += NT) { float c = to_f(xr[i]) - mean; v += c * c; }
    const float rs = rsqrtf(block_sum(v) / (float)H + eps);
    for (int i = threadIdx.x; i < H; i += NT) {
      float o = (to_f(xr[i]) - mean) * rs * to_f(w[i]);
      if (HAS_B) o += to_f(b[i]);
      if (to_smem) xs[i] = to_f(from_f<TY>(o)); else y[(long long)r * H + i] = from_f<TY>(o);
    }
  }
}

// Rotate-half rope; x viewed as rows of head_dim; pos of length NPOS, one per leading index.
template <class TX, class TY, class TF>
__device__ __noinline__ void op_rope(AMK_PARAMS) {
  const int C = d.ip[P_ROPE_COLS], c0 = d.ip[P_ROPE_C0], w = d.ip[P_ROPE_C1] - c0;
  const int hd = d.ip[P_ROPE_HD], half = hd / 2, npos = d.ip[P_ROPE_NPOS];
  const long long R = d.ip[P_ROPE_ROWS];
  const long long heads_per_pos = (R * C / hd) / npos;
  const float theta = d.fp[F_ROPE_THETA];
  const TX* x = (const TX*)P[0];
  const void* pos = P[1];
  const TF* invf = (const TF*)P[d.ip[P_ROPE_HAS_INV] ? 2 : 0];
  TY* y = (TY*)P[d.n_in];
  if (w <= 0) return;
  for (long long i = threadIdx.x; i < R * w; i += NT) {
    long long r = i / w; int c = c0 + (int)(i - r * w);
    long long flat = r * C + c;
    long long head = flat / hd; int j = (int)(flat - head * hd);
    int pi = npos > 1 ? (int)(head / heads_per_pos) : 0;
    float p = (float)read_int((const char*)pos + (long long)pi * (d.ip[P_ROPE_POS64] ? 8 : 4), d.ip[P_ROPE_POS64]);
    int fj = j < half ? j : j - half;
    float inv = d.ip[P_ROPE_HAS_INV] ? to_f(invf[fj]) : rope_inv_pow(theta, fj, half);
    float ang = p * inv;
    float cs, sn;
    sincosf(ang, &sn, &cs);
    float xv = to_f(x[flat]);
    float o = j < half ? xv * cs - to_f(x[flat + half]) * sn : xv * cs + to_f(x[flat - half]) * sn;
    y[flat] = from_f<TY>(o);
  }
}

template <class TT, class TO>
__device__ __noinline__ void op_embed(AMK_PARAMS) {
  const int B = d.ip[P_EMBED_B], H = d.ip[P_EMBED_H], V = d.ip[P_EMBED_V], ids64 = d.ip[P_EMBED_IDS64];
  const TT* table = (const TT*)P[1]; TO* y = (TO*)P[d.n_in];
  for (int b = 0; b < B; b++) {
    long long id = read_int((const char*)P[0] + (long long)b * (ids64 ? 8 : 4), ids64);
    if (id < 0 || id >= V) { if (threadIdx.x == 0) raise_fault(st, FAULT_EMBED_ID, d.task_id, (int)id); continue; }
    const TT* row = table + id * H;
    for (int i = threadIdx.x; i < H; i += NT) y[(long long)b * H + i] = Cast<TO, TT>::go(row[i]);
  }
}

// ROPE_HD > 0: the rows are rotated first (the FUSED ROPE step before, folded in by
// folds.rope_into_append: op_rope's formula and rounding, one position), so the new k goes
// from the GEMV's output to the cache in one pass.
template <class TN, class TC, class TF>
__device__ __noinline__ void op_kv_append(AMK_PARAMS) {
  const long long rowlen = d.ip[P_KV_ROWLEN];
  const int n = d.ip[P_KV_NROWS], max_seq = d.ip[P_KV_MAX_SEQ], B = d.ip[P_KV_B];
  const int rhd = d.ip[P_KV_ROPE_HD], half = rhd / 2;
  const int seq = d.ip[P_KV_POS_SEQ], is64 = d.ip[P_KV_POS64];   // seq: sequence b at pos[b]
  const long long p = d.ip[P_KV_HAS_POS] ? read_int(P[1], is64) : (long long)d.ip[P_KV_POS_PARAM];
  for (int b = 0; b < (seq ? B : 1); b++) {
    const long long pb = seq ? read_int((const char*)P[1] + (long long)b * (is64 ? 8 : 4), is64) : p;
    if (pb < 0 || pb > max_seq - n) { if (threadIdx.x == 0) raise_fault(st, FAULT_KV_POS, d.task_id, (int)pb); return; }
  }
  const TN* src = (const TN*)P[0]; TC* cache = (TC*)P[d.n_in];
  const long long per_b = (long long)n * rowlen;
  for (long long i = threadIdx.x; i < B * per_b; i += NT) {
    long long b = i / per_b, k = i - b * per_b;
    const long long pb = seq ? read_int((const char*)P[1] + b * (is64 ? 8 : 4), is64) : p;
    TN v = src[i];
    if (rhd) {
      const int j = (int)(i % rhd), fj = j < half ? j : j - half;
      const float inv = d.ip[P_KV_ROPE_INV] ? to_f(((const TF*)P[2])[fj])
                                             : rope_inv_pow(d.fp[F_KV_THETA], fj, half);
      float sn, cs;
      sincosf((float)pb * inv, &sn, &cs);
      const float x = to_f(v);
      v = from_f<TN>(j < half ? x * cs - to_f(src[i + half]) * sn : x * cs + to_f(src[i - half]) * sn);
    }
    cache[(b * max_seq + pb) * rowlen + k] = Cast<TC, TN>::go(v);
  }
}

// (v, i) beats (b, bi): larger value, then lower index; NaN beats everything (first NaN wins),
// like torch.argmax. Visiting order does not matter.
__device__ __forceinline__ bool am_better(float v, int i, float b, int bi) {
  if (v != v) return b == b || i < bi;
  if (b != b) return false;
  return v > b || (v == b && i < bi);
}

// Every lane's (v, i) -> the warp's best in every lane (am_better is a total order: any
// reduction tree gives the same best).
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o); const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (am_better(ov, oi, v, i)) { v = ov; i = oi; }
  }
}

// Every thread's (v, i) -> the block's best in thread 0 (am_better order).
__device__ __forceinline__ void block_argmax(float& v, int& i) {
  __shared__ float sv[NWARPS]; __shared__ int si[NWARPS];
  warp_argmax(v, i);
  __syncthreads();                                   // sv, si: their last readers are done
  if ((threadIdx.x & 31) == 0) { sv[threadIdx.x >> 5] = v; si[threadIdx.x >> 5] = i; }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int k = 1; k < NWARPS; k++)
      if (am_better(sv[k], si[k], v, i)) { v = sv[k]; i = si[k]; }
}

__device__ __forceinline__ void argmax_store(const TaskDesc& d, void* const* P, int r, int i) {
  if (i == 0x7fffffff) i = 0;
  if (d.ip[P_ARGMAX_OUT64]) ((long long*)P[d.n_in])[r] = i; else ((int*)P[d.n_in])[r] = i;
}

// The argmax of each row from the (value, index bits) partials its GEMV tiles wrote (V = the
// partials a row, rows after rows; argmax_fold.py). A warp a row, the rows in parallel: one row
// after another through block_argmax's barriers took 1.5 us a row (batch 64: 99 us at the end
// of the step, NOTES v54). am_better is a total order, so the token is the one any order gives.
__device__ __noinline__ void op_argmax_parts(AMK_PARAMS) {
  const int n = d.ip[P_ARGMAX_V], R = d.ip[P_ARGMAX_ROWS], lane = threadIdx.x & 31;
#pragma unroll 1
  for (int r = threadIdx.x >> 5; r < R; r += NWARPS) {
    const float2* pv = (const float2*)P[0] + (long long)r * n;
    float best = -__int_as_float(0x7f800000); int bi = 0x7fffffff;
#pragma unroll 4
    for (int k = lane; k < n; k += 32) {
      const float2 p = pv[k];
      if (am_better(p.x, __float_as_int(p.y), best, bi)) { best = p.x; bi = __float_as_int(p.y); }
    }
    warp_argmax(best, bi);
    if (lane == 0) argmax_store(d, P, r, bi);
  }
}

template <class TX>
__device__ __noinline__ void op_argmax(AMK_PARAMS) {
  constexpr int VN = VecN<TX>::N, U = 8;               // 8 x 16-byte loads in flight per thread
  const int R = d.ip[P_ARGMAX_ROWS], V = d.ip[P_ARGMAX_V];
  const TX* x = (const TX*)P[0];
  for (int r = 0; r < R; r++) {
    const TX* xr = x + (long long)r * V;
    float best = -__int_as_float(0x7f800000); int bi = 0x7fffffff;
    int i = 0;
    if ((((unsigned long long)xr) & 15ull) == 0) {
      const int nvec = V / VN;
      for (int v0 = threadIdx.x; v0 < nvec; v0 += NT * U) {
        uint4 q[U];
#pragma unroll
        for (int u = 0; u < U; u++) q[u] = v0 + u * NT < nvec ? ld16(xr + (long long)(v0 + u * NT) * VN) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int u = 0; u < U; u++) {
          if (v0 + u * NT < nvec) {
            float f[VN];
            unpack(q[u], f, (TX*)0);
#pragma unroll
            for (int e = 0; e < VN; e++) {
              const int idx = (v0 + u * NT) * VN + e;
              if (am_better(f[e], idx, best, bi)) { best = f[e]; bi = idx; }
            }
          }
        }
      }
      i = nvec * VN;
    }
    for (int k = i + threadIdx.x; k < V; k += NT) {
      const float v = to_f(xr[k]);
      if (am_better(v, k, best, bi)) { best = v; bi = k; }
    }
    block_argmax(best, bi);
    if (threadIdx.x == 0) argmax_store(d, P, r, bi);
  }
}

template <class TX, class TY>
__device__ __noinline__ void op_softmax(AMK_PARAMS) {
  const int R = d.ip[P_SOFTMAX_ROWS], H = d.ip[P_SOFTMAX_H];
  const TX* x = (const TX*)P[0]; TY* y = (TY*)P[d.n_in];
  for (int r = 0; r < R; r++) {
    const TX* xr = x + (long long)r * H;
    float m = -__int_as_float(0x7f800000);
    for (int i = threadIdx.x; i < H; i += NT) m = fmaxf(m, to_f(xr[i]));
    m = block_max(m);
    float s = 0.f;
    for (int i = threadIdx.x; i < H; i += NT) s += expf(to_f(xr[i]) - m);
    s = block_sum(s);
    for (int i = threadIdx.x; i < H; i += NT) y[(long long)r * H + i] = from_f<TY>(expf(to_f(xr[i]) - m) / s);
  }
}

template <class TQ, class TS, class TZ, class TY, bool ZEROS>
__device__ __noinline__ void op_dequant(AMK_PARAMS) {
  const long long N = d.ip[P_DEQ_N], Kd = d.ip[P_DEQ_K], ldq = d.ip[P_DEQ_LDQ];
  const int group = d.ip[P_DEQ_GROUP], ng = d.ip[P_DEQ_NGROUPS], packed = d.ip[P_DEQ_PACKED];
  const TQ* q = (const TQ*)P[0]; const TS* s = (const TS*)P[1]; const TZ* z = (const TZ*)P[ZEROS ? 2 : 1];
  TY* y = (TY*)P[d.n_in];
  for (long long i = threadIdx.x; i < N * Kd; i += NT) {
    long long n = i / Kd; int k = (int)(i - n * Kd);
    float qv;
    if (packed == 1) { unsigned byte = ((const unsigned char*)q)[n * ldq + (k >> 1)]; qv = (float)((k & 1 ? byte >> 4 : byte) & 15u) - 8.0f; }
    else if (packed == 2) qv = fp8e4m3_to_f(((const unsigned char*)q)[n * ldq + k]);   // fp8 E4M3
    else qv = to_f(q[n * ldq + k]);
    int g = k / group; if (g > ng - 1) g = ng - 1;
    if (ZEROS) qv = qv - to_f(z[n * ng + g]);
    y[i] = from_f<TY>(qv * to_f(s[n * ng + g]));
  }
}

// The partials this step's combine merges: the first kv_live_shards(...) of its np (AMK's live
// count, SHARD_ROWS > 0: from the attention's window params and pos, the input after the
// partials; regions.combine_live), else all np. The shards past them wrote nothing this step.
// Row b's position (pos[b] when POS_SEQ).
__device__ __forceinline__ int comb_live(const TaskDesc& d, void* const* P, int np, int b) {
  const int rows = d.ip[P_COMB_SHARD_ROWS];
  if (rows <= 0) return np;
  long long lo = d.ip[P_COMB_KV_START], hi = lo + d.ip[P_COMB_KV_LEN];
  const int is64 = d.ip[P_COMB_POS64], i = d.ip[P_COMB_POS_SEQ] ? b : 0;
  kv_live_window(read_int((const char*)P[np] + (long long)i * (is64 ? 8 : 4), is64), d.ip[P_COMB_WINDOW], lo, hi);
  return kv_live_shards((int)(hi - lo), np, rows);
}

// combine_direct's merge of one head's outputs dd .. dd + V - 1 over the first np of NPC partials
// (part(p): that head's [acc | m | l] in partial p). The m of COMB_MG partials are loaded at
// once (-inf past np), then the l and values of COMB_GROUP partials at a time: a max or a sum
// fed by each load (a predicated load into the running max, a break after each partial) made
// them one L2 round trip after another, 16 in a row at 16 partials (NOTES v47: batch 16 -5%).
// Up to COMB_MG partials every m stays in a register for the second pass; past it (a model of
// 2-4 kv heads at an 8K cache: 33-56 partials) each m is loaded again with its l, and both
// passes are loops: unrolled, the compiler hoisted every group's loads, and combine_direct
// spilled 20 / 24 B, the scheduler 32 / 88 B (v47). Partials past np add +0 to sums that
// start at +0 and never become -0: the bits of the staged path's loop over the np alone, in the
// same order. (That loop reads shared memory; grouped like this it lost 1-3% at batch 1, v47.)
#define COMB_GROUP 4
#define COMB_MG 16
// COMB_GROUP partials' l and values (and m, unless kept), issued together, then their shares
template <class TP, int NPC, int V, bool KEEP, class Part>
__device__ __forceinline__ void comb_group(Part part, int p0, int np, int hd, int dd, const float* mp, float mx,
                                           float& L, float (&acc)[4]) {
  float mq[COMB_GROUP], lp[COMB_GROUP], v[COMB_GROUP][V];
#pragma unroll
  for (int g = 0; g < COMB_GROUP; g++) {
    const int p = p0 + g;
    mq[g] = 0.f;
    lp[g] = 0.f;
#pragma unroll
    for (int k = 0; k < V; k++) v[g][k] = 0.f;
    if (p < NPC && p < np) {
      const TP* pp = part(p);
      if (!KEEP) mq[g] = to_f(pp[hd]);
      lp[g] = to_f(pp[hd + 1]);
#pragma unroll
      for (int k = 0; k < V; k++) v[g][k] = to_f(pp[dd + k]);
    }
  }
#pragma unroll
  for (int g = 0; g < COMB_GROUP; g++) {
    const int p = p0 + g;
    if (p >= NPC) break;
    const float w = lp[g] > 0.f ? expf((KEEP ? mp[p] : mq[g]) - mx) : 0.f;
    L += lp[g] * w;
#pragma unroll
    for (int k = 0; k < V; k++) acc[k] += v[g][k] * w;
  }
}

template <class TP, int NPC, int V, class Part>
__device__ __forceinline__ void comb_merge(Part part, int np, int hd, int dd, float& L, float (&acc)[4]) {
  constexpr bool KEEP = NPC <= COMB_MG;
  float mp[KEEP ? NPC : COMB_MG], mx = -__int_as_float(0x7f800000);
  if constexpr (KEEP) {
#pragma unroll
    for (int p = 0; p < NPC; p++) { mp[p] = mx; if (p < np) mp[p] = to_f(part(p)[hd]); }
#pragma unroll
    for (int p = 0; p < NPC; p++) mx = fmaxf(mx, mp[p]);
  } else {          // COMB_MG at a time, a loop (as the groups below)
#pragma unroll 1
    for (int p0 = 0; p0 < NPC; p0 += COMB_MG) {
#pragma unroll
      for (int g = 0; g < COMB_MG; g++) {
        mp[g] = mx;
        if (p0 + g < NPC && p0 + g < np) mp[g] = to_f(part(p0 + g)[hd]);
      }
#pragma unroll
      for (int g = 0; g < COMB_MG; g++) mx = fmaxf(mx, mp[g]);
    }
  }
  L = 0.f;
#pragma unroll
  for (int k = 0; k < 4; k++) acc[k] = 0.f;
  if constexpr (KEEP) {
#pragma unroll
    for (int p0 = 0; p0 < NPC; p0 += COMB_GROUP) comb_group<TP, NPC, V, true>(part, p0, np, hd, dd, mp, mx, L, acc);
  } else {          // a loop: unrolled, the compiler hoisted every group's loads (spills)
#pragma unroll 1
    for (int p0 = 0; p0 < NPC; p0 += COMB_GROUP) comb_group<TP, NPC, V, false>(part, p0, np, hd, dd, mp, mx, L, acc);
  }
}

// op_combine when its partials cannot be staged in shared memory (the 1B step's 16 live partials
// at context 4096 are 135 KB, the staging area below the o tile's preload 68 KB; a batch's):
// read from global memory. A thread merges 4 consecutive outputs of one head of one row, as the
// staged path does (comb_merge: same order, same bits), the partials' loads issued together: a
// scalar loop over the partials, an output a thread, was two dependent L2 round trips a
// partial, 13 us a task at 4096 (NOTES v22). Out of line:
// never-run code inside a hot function costs time (NOTES v16). The first np of its NPC
// partials; with a position a row (POS_SEQ), row b's own count.
template <class TP, class TO, int NPC>
__device__ __noinline__ void combine_direct(const TaskDesc& d, void* const* P, char* smem, int hd, int np0) {
  const int nh = d.ip[P_COMB_NH], h0 = d.ip[P_COMB_H_OFF], hc = d.ip[P_COMB_H_COUNT], B = d.ip[P_COMB_B];
  const bool to_smem = d.ip[P_COMB_TO_SMEM] != 0; float* xs = (float*)smem;
  TO* y = (TO*)P[d.n_in];
  const int n = B * hc * hd, V = hd % 4 == 0 ? 4 : 1;     // outputs a thread: 4 of one head
  for (int i0 = V * threadIdx.x; i0 < n; i0 += V * NT) {
    const int b = i0 / (hc * hd), r = i0 - b * hc * hd, h = h0 + r / hd, dd = r % hd;
    const long long base = ((long long)b * nh + h) * (hd + 2);
    const int np = d.ip[P_COMB_POS_SEQ] ? comb_live(d, P, NPC, b) : np0;
    const auto part = [&](int p) { return (const TP*)P[p] + base; };
    float L, acc[4];
    if (V == 4) comb_merge<TP, NPC, 4>(part, np, hd, dd, L, acc);
    else comb_merge<TP, NPC, 1>(part, np, hd, dd, L, acc);
#pragma unroll
    for (int k = 0; k < 4; k++) {
      if (k >= V) break;
      const TO o = from_f<TO>(acc[k] / fmaxf(L, 1e-20f));
      if (to_smem) xs[h * hd + dd + k] = to_f(o); else y[((long long)b * nh + h) * hd + dd + k] = o;
    }
  }
}


// The largest power of two S <= 32 whose 4 S divides the head dim: a lane's 4 outputs S apart,
// S lanes of a warp reading consecutive words (64: 16, 128 and 256: 32, 80: 4).
__host__ __device__ constexpr int comb_stride(int hd) {
  int s = 32;
  while (s > 1 && hd % (4 * s) != 0) s /= 2;
  return s;
}

// The staged combine's merge of head h's outputs dd, dd + S, dd + 2 S, dd + 3 S over the first np
// of NPC partials staged at st: the same operations, in the same order, for any S.
template <class TP, class TO, int NPC, int S>
__device__ __forceinline__ void comb_staged(const char* st, int span, int v0, int np, int hd, int h, int dd,
                                            bool to_smem, float* xs, TO* y) {
  float mx = -__int_as_float(0x7f800000);
#pragma unroll
  for (int p = 0; p < NPC; p++) {
    if (p >= np) break;
    mx = fmaxf(mx, to_f(((const TP*)(st + (p * span - v0) * 16))[h * (hd + 2) + hd]));
  }
  float L = 0.f, acc[4];
#pragma unroll
  for (int k = 0; k < 4; k++) acc[k] = 0.f;
#pragma unroll
  for (int p = 0; p < NPC; p++) {
    if (p >= np) break;
    const TP* pp = (const TP*)(st + (p * span - v0) * 16) + h * (hd + 2);
    const float lp = to_f(pp[hd + 1]);
    const float w = lp > 0.f ? expf(to_f(pp[hd]) - mx) : 0.f;
    L += lp * w;
#pragma unroll
    for (int k = 0; k < 4; k++) acc[k] += to_f(pp[dd + k * S]) * w;
  }
#pragma unroll
  for (int k = 0; k < 4; k++) {
    const TO o = from_f<TO>(acc[k] / fmaxf(L, 1e-20f));
    if (to_smem) xs[h * hd + dd + k * S] = to_f(o); else y[(long long)h * hd + dd + k * S] = o;
  }
}

// Split-KV combine: online-softmax merge of P partials [B, NH, HD+2] = [acc | m | l].
// TO_SMEM (batch 1, every head; folds.norm_into_smem): the result goes, rounded through TO,
// into the next GEMVs' fp32 x staging area at smem[0] instead of y.
// Staged path (batch 1, in the staging area: AMK_STAGE_BYTES): the task's heads of every partial
// (the 16-byte vectors [v0, v0 + span) that hold them) are copied into shared memory, one bulk
// copy a partial, one round trip for the whole combine (NOTES v9, v13e); then a thread merges 4
// consecutive outputs of one head from there. Under AMK_PRE only below AMK_PRE_OFF: the next GEMV's first
// rows may be landing above it (preload.py). TO_SMEM from the end of x.
// HDC, NPC: the head dim and the number of partials, template constants (encoders.py): the
// per-output index math and the loops over partials compile to shifts and straight code. Only
// the first np <= NPC (the live shards, comb_live) are copied and merged: the loops keep NPC
// as their bound, np is a predicate; np == 1 is the one partial's acc / l.
// AMK_MARK (profile builds): 0 entered, 1 live count read, 2 copies issued, 3 landed, 4 merged.
template <class TP, class TO, int HDC, int NPC>
__device__ __noinline__ void op_combine(AMK_PARAMS) {
  AMK_MARK(0);
  const int hd = HDC, nh = d.ip[P_COMB_NH], h0 = d.ip[P_COMB_H_OFF], hc = d.ip[P_COMB_H_COUNT];
  const int B = d.ip[P_COMB_B], np = comb_live(d, P, NPC, 0);
  AMK_MARK(1);
  const bool to_smem = d.ip[P_COMB_TO_SMEM] != 0; float* xs = (float*)smem;
  TO* y = (TO*)P[d.n_in];
  const int n = B * hc * hd;
  const int rb = (hd + 2) * (int)sizeof(TP);                // bytes of one head's [acc | m | l]
  const int v0 = h0 * rb / 16, span = ((h0 + hc) * rb + 15) / 16 - v0;   // its heads' vectors
  // a combine into x (the fold) stages from its x's end (1024-aligned), in the work area, up to
  // the preload; others in the staging area (smem.py)
  const int top = AMK_PRE ? AMK_PRE_OFF : AMK_STAGE_OFF + AMK_STAGE_BYTES;
  const int st_off = to_smem ? (((h0 + hc) * hd * 4 + 1023) & ~1023) : AMK_STAGE_OFF;
  const int st_room = top - st_off;
  bool staged = B == 1 && hd % 4 == 0 && (nh * rb) % 16 == 0 && (long long)np * span * 16 <= st_room;
  for (int p = 0; p < np && staged; p++) staged = ((unsigned long long)P[p] & 15ull) == 0;
  if (staged) {
    char* st = smem + st_off;
    const unsigned ph = amk_comb_uses;
    if (threadIdx.x < 32) {                       // one bulk copy a partial
      fence_proxy_async();                        // the area held the attention's cp.async rows
      if (threadIdx.x == 0) mbar_expect_tx(&amk_comb_bar, (unsigned)(np * span * 16));
      __syncwarp();
      for (int p = threadIdx.x; p < np; p += 32)
        bulk_g2s(st + (long long)p * span * 16, (unsigned long long)((const char*)P[p] + v0 * 16), (unsigned)(span * 16),
                 &amk_comb_bar);
    }
    AMK_MARK(2);
    mbar_wait(&amk_comb_bar, ph & 1u);
    __syncthreads();
    AMK_MARK(3);
    if (threadIdx.x == 0) amk_comb_uses = ph + 1;
    // 4 outputs of one head a lane, S apart (comb_stride), a warp 128 consecutive outputs:
    // lane-consecutive reads of shared memory (S = 1, 4 consecutive outputs a lane, was a 4-way
    // bank conflict on every value read at head dim 128, NOTES v58)
    constexpr int S = comb_stride(HDC);
    for (int c = (threadIdx.x >> 5) * 128; c < n; c += NWARPS * 128) {
      const int lane = threadIdx.x & 31, r = c + (lane / S) * 4 * S + lane % S;
      if (r < n) comb_staged<TP, TO, NPC, S>(st, span, v0, np, hd, h0 + r / hd, r % hd, to_smem, xs, y);
    }
    AMK_MARK(4);
    return;
  }
  combine_direct<TP, TO, NPC>(d, P, smem, hd, np);
}
