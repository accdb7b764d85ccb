// Decode attention over cache rows [kv_start, kv_start+kv_len) ∩ [0, pos+1), the position read
// on the device. One kv group at a time (its q heads share every K/V row: GQA), in chunks of NT
// positions with an online softmax: scores (thread = position) -> chunk max/exp (warp = head)
// -> P·V (thread = (dim, position group)). PARTIAL_WRITE emits the flash partial [acc | m | l].
// NEW_KV: row pos is the step's new k/v row (P[4], P[5], as the cache would hold it), not the
// cache's: the append runs after the attention (passes/defer_kv_append.py).

// Element e (< hd) of kv head g's new k and v rows at position p, rounded as the cache stores
// them; K_ROPE: the k row rotated first (op_rope's formula and rounding, folds.k_rope_into_attention).
template <class TN, class TK, class TV, class TF>
__device__ __forceinline__ void attn_new_row(const TaskDesc& d, void* const* P, long long row, int e,
                                          int hd, float p, float& kx, float& vx) {
  const TN* kn = (const TN*)P[4] + row * hd;
  float x = to_f(kn[e]);
  if (d.ip[P_ATTN_K_ROPE]) {
    const int half = hd / 2, fj = e < half ? e : e - half;
    const float inv = d.ip[P_ATTN_ROPE_INV] ? to_f(((const TF*)P[d.n_in - 1])[fj])
                                             : rope_inv_pow(d.fp[F_ATTN_THETA], fj, half);
    float sn, cs;
    sincosf(p * inv, &sn, &cs);
    x = e < half ? x * cs - to_f(kn[e + half]) * sn : x * cs + to_f(kn[e - half]) * sn;
    x = to_f(from_f<TN>(x));
  }
  kx = to_f(from_f<TK>(x));
  vx = to_f(from_f<TV>(to_f(((const TN*)P[5])[row * hd + e])));
}

// The rows [lo, hi) the task reads (regions.kv_window): the static window clamped by max_seq and
// pos, then a split-KV shard's piece KV_SHARD of L pieces of that live window, L the live
// shard count (SHARD_ROWS > 0: AMK's count from the live rows, kv_live_shards; else
// KV_SHARDS). Returns false for a shard >= L: it writes nothing (the combine reads only the
// first L partials). pos: sequence b's position (pos[b] when POS_SEQ; 0 without one).
__device__ __forceinline__ bool attn_window(const TaskDesc& d, void* const* P, int b, long long& lo,
                                            long long& hi, long long& pos) {
  lo = d.ip[P_ATTN_KV_START];
  hi = lo + d.ip[P_ATTN_KV_LEN];
  if (hi > d.ip[P_ATTN_MAX_SEQ]) hi = d.ip[P_ATTN_MAX_SEQ];
  pos = 0;
  if (d.ip[P_ATTN_HAS_POS]) {
    const int i = d.ip[P_ATTN_POS_SEQ] ? b : 0, is64 = d.ip[P_ATTN_POS64];
    pos = read_int((const char*)P[3] + (long long)i * (is64 ? 8 : 4), is64);
    kv_live_window(pos, d.ip[P_ATTN_WINDOW], lo, hi);
  }
  if (hi < lo) hi = lo;
  const int shards = d.ip[P_ATTN_KV_SHARDS];
  if (shards > 1) {                    // in rows from lo: a window's rows fit an int (32-bit math)
    const int n = (int)(hi - lo), s = d.ip[P_ATTN_KV_SHARD];
    const int live = kv_live_shards(n, shards, d.ip[P_ATTN_SHARD_ROWS]);
    if (s >= live) return false;
    const int size = (n + live - 1) / live, s0 = s * size, e = n < s0 + size ? n : s0 + size;
    hi = lo + (e > s0 ? e : s0);
    lo += s0;
  }
  return true;
}

// One chunk's online softmax: warp w < nhs turns head w's scores sc[w * stride + i], i < cn,
// into probabilities against the running max, written to pout[i * pi + w * pj] (in place:
// pout = sc, pi = 1, pj = stride), and updates m_run, l_run and alpha (the factor the head's
// P·V sums so far are scaled by).
// CAP (Gemma 2, cap > 0): the scores become cap * tanh(s / cap) first; a template flag, so the
// attention of a model without it carries no never-run tanh (NOTES v16).
template <bool CAP>
__device__ __forceinline__ void attn_softmax(float* sc, int stride, int cn, int nhs, float* m_run,
                                             float* l_run, float* alpha, float* pout, int pi, int pj,
                                             float cap) {
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31;
  if (w >= nhs) return;
  if (CAP)
    for (int i = lane; i < cn; i += 32) sc[w * stride + i] = tanhf(sc[w * stride + i] / cap) * cap;
  float mc = -__int_as_float(0x7f800000);
  for (int i = lane; i < cn; i += 32) mc = fmaxf(mc, sc[w * stride + i]);
  mc = warp_max(mc);
  const float mold = m_run[w];
  const float mnew = fmaxf(mold, mc);
  float ls = 0.f;
  for (int i = lane; i < cn; i += 32) { const float p = expf(sc[w * stride + i] - mnew); pout[i * pi + w * pj] = p; ls += p; }
  ls = warp_sum(ls);
  if (lane == 0) {
    const float a = expf(mold - mnew);
    alpha[w] = a; l_run[w] = l_run[w] * a + ls; m_run[w] = mnew;
  }
}

// One pass's output, heads [row0, row0 + nhs) of out: each head's P·V sums over the PG position
// groups (red: [PG][HG][hd]), divided by l, or the flash partial [acc | m | l] when partial.
template <int HG, class TO>
__device__ __forceinline__ void attn_write(TO* out, const float* red, const float* m_run, const float* l_run,
                                           int nhs, int hd, int PG, long long row0, bool partial, int n) {
  for (int i = threadIdx.x; i < nhs * hd; i += NT) {
    const int j = i / hd, e = i - j * hd;
    float a = 0.f;
    for (int k = 0; k < PG; k++) a += red[(k * HG + j) * hd + e];
    if (partial) {
      const long long base = (row0 + j) * (hd + 2);
      out[base + e] = from_f<TO>(n > 0 ? a : 0.f);
      if (e == 0) {
        out[base + hd] = from_f<TO>(n > 0 ? m_run[j] : -__int_as_float(0x7f800000));
        out[base + hd + 1] = from_f<TO>(n > 0 ? l_run[j] : 0.f);
      }
    } else {
      out[(row0 + j) * hd + e] = from_f<TO>(n > 0 ? a / l_run[j] : 0.f);
    }
  }
}

template <class TQ, class TK, class TV, class TO, class TN, class TF, bool CAP>
__device__ __noinline__ void op_attention(AMK_PARAMS) {
  constexpr int HG = 8;                               // q heads per pass (registers per thread)
  const int hd = d.ip[P_ATTN_HD], nh = d.ip[P_ATTN_NH], nkv = d.ip[P_ATTN_NKV];
  const int h0 = d.ip[P_ATTN_H_OFF], hc = d.ip[P_ATTN_H_COUNT];
  const int b0 = d.ip[P_ATTN_B_OFF], b1 = b0 + d.ip[P_ATTN_B_COUNT];
  const long long max_seq = d.ip[P_ATTN_MAX_SEQ];
  const bool partial = (d.ip[P_ATTN_FLAGS] & 2) != 0;
  const float scale = d.fp[F_ATTN_SCALE];
  const int rep = nh / nkv;
  long long lo, hi, pb;                 // sequence b0's window first: its pos load overlaps the setup
  bool live = attn_window(d, P, b0, lo, hi, pb);
  if (!live && b1 - b0 == 1) return;                         // not a live shard this step
  const TQ* q = (const TQ*)P[0]; const TK* kc = (const TK*)P[1]; const TV* vc = (const TV*)P[2];
  TO* out = (TO*)P[d.n_in];
  float* qs = (float*)smem;                          // [HG][hd]
  float* sc = qs + HG * hd;                          // [HG][NT] scores, then probabilities
  const int tid = threadIdx.x, PG = NT / hd, dd = tid % hd, pg = tid / hd;
  float* red = sc + HG * NT;                         // [PG][HG][hd] partial P·V sums
  float* kn = red + PG * HG * hd;                    // NEW_KV: the new k and v rows [2][hd]
  const bool new_kv = d.ip[P_ATTN_NEW_KV] != 0;
  __shared__ float m_run[HG], l_run[HG], alpha[HG];
  constexpr int KV = VecN<TK>::N;
  const bool kvec = (hd % KV) == 0;

  for (int b = b0; b < b1; b++) {
    if (b > b0) live = attn_window(d, P, b, lo, hi, pb);
    if (!live) continue;                                     // not a live shard of b this step
    const int n = (int)(hi - lo);
    const long long pos = new_kv ? pb : -1;
    for (int g = h0 / rep; g < (h0 + hc) / rep; g++)
      for (int hs0 = 0; hs0 < rep; hs0 += HG) {
        const int nhs = rep - hs0 < HG ? rep - hs0 : HG;
        const int hbase = g * rep + hs0;
        __syncthreads();
        for (int i = tid; i < nhs * hd; i += NT) qs[i] = to_f(q[((long long)b * nh + hbase) * hd + i]);
        if (new_kv && tid < hd) attn_new_row<TN, TK, TV, TF>(d, P, (long long)b * nkv + g, tid, hd, (float)pos, kn[tid], kn[hd + tid]);
        if (tid < HG) { m_run[tid] = -__int_as_float(0x7f800000); l_run[tid] = 0.f; }
        float acc[HG];
#pragma unroll
        for (int j = 0; j < HG; j++) acc[j] = 0.f;
        __syncthreads();
        for (long long t0 = lo; t0 < hi; t0 += NT) {
          const int cn = hi - t0 < NT ? (int)(hi - t0) : NT;
          if (tid < cn) {
            const TK* krow = kc + ((b * max_seq + t0 + tid) * nkv + g) * hd;
            float s[HG];
#pragma unroll
            for (int j = 0; j < HG; j++) s[j] = 0.f;
            if (t0 + tid == pos) {                             // NEW_KV's row (pos < 0 otherwise)
              for (int e = 0; e < hd; e++) {
#pragma unroll
                for (int j = 0; j < HG; j++) if (j < nhs) s[j] += qs[j * hd + e] * kn[e];
              }
            } else if (kvec) {
              for (int e0 = 0; e0 < hd; e0 += 4 * KV) {      // 4 row vectors in flight
                uint4 kr[4];
#pragma unroll
                for (int u = 0; u < 4; u++) kr[u] = e0 + u * KV < hd ? ld16(krow + e0 + u * KV) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
                for (int u = 0; u < 4; u++) {
                  if (e0 + u * KV < hd) {
                    float kf[KV];
                    unpack(kr[u], kf, (TK*)0);
#pragma unroll
                    for (int j = 0; j < HG; j++)
                      if (j < nhs) {
#pragma unroll
                        for (int e = 0; e < KV; e++) s[j] += qs[j * hd + e0 + u * KV + e] * kf[e];
                      }
                  }
                }
              }
            } else {
              for (int e = 0; e < hd; e++) {
                const float kf = to_f(krow[e]);
#pragma unroll
                for (int j = 0; j < HG; j++) if (j < nhs) s[j] += qs[j * hd + e] * kf;
              }
            }
#pragma unroll
            for (int j = 0; j < HG; j++) if (j < nhs) sc[j * NT + tid] = s[j] * scale;
          }
          __syncthreads();
          attn_softmax<CAP>(sc, NT, cn, nhs, m_run, l_run, alpha, sc, 1, NT, d.fp[F_ATTN_SOFTCAP]);
          __syncthreads();
          if (pg < PG) {
#pragma unroll
            for (int j = 0; j < HG; j++) if (j < nhs) acc[j] *= alpha[j];
            const TV* vcol = vc + ((b * max_seq + t0) * nkv + g) * hd + dd;
            const long long vstride = (long long)nkv * hd;
            int i = pg;
            for (; i + 7 * PG < cn; i += 8 * PG) {          // 8 independent loads in flight
              float vv[8];
#pragma unroll
              for (int u = 0; u < 8; u++) vv[u] = t0 + i + u * PG == pos ? kn[hd + dd] : to_f(vcol[(long long)(i + u * PG) * vstride]);
#pragma unroll
              for (int u = 0; u < 8; u++)
#pragma unroll
                for (int j = 0; j < HG; j++) if (j < nhs) acc[j] += sc[j * NT + i + u * PG] * vv[u];
            }
            for (; i < cn; i += PG) {
              const float v = t0 + i == pos ? kn[hd + dd] : to_f(vcol[(long long)i * vstride]);
#pragma unroll
              for (int j = 0; j < HG; j++) if (j < nhs) acc[j] += sc[j * NT + i] * v;
            }
          }
          __syncthreads();
        }
        if (pg < PG) {
#pragma unroll
          for (int j = 0; j < HG; j++) if (j < nhs) red[(pg * HG + j) * hd + dd] = acc[j];
        }
        __syncthreads();
        attn_write<HG>(out, red, m_run, l_run, nhs, hd, PG, (long long)b * nh + hbase, partial, n);
      }
  }
}

// The same attention with the shard's K and V rows staged in shared memory by 16-byte cp.async,
// issued as soon as pos gives the shard its piece of the live window (regions.kv_window): the
// first chunk (the whole shard when it fits: up to NT rows, the work area and the staging
// area, AMK_STAGE_BYTES) is in flight before q is read, and the task's loads take one round
// trip, not one per phase (NOTES v9). K and V are separate groups: the scores start when K has landed. Rows are
// padded by 16 bytes (conflict-free 16-byte row reads). Q_ROPE: q is rotated while it is staged
// (the FUSED ROPE step before, folded in by folds.rope_into_attention: op_rope's formula and
// rounding). NEW_KV: the staged row pos (stale) is overwritten with the new row, read into
// registers with q, once its group has landed. Needs hd * sizeof(TK|TV) % 16 == 0 (encoders.py checks).
// t0, nt: the issuing threads (attn_early: warps 1-15).
template <class T>
__device__ __forceinline__ void attn_stage_rows(char* dst, int rs, const T* base, long long stride,
                                                int cn, int hd, int t0 = threadIdx.x, int nt = NT) {
  const int nvr = hd * (int)sizeof(T) / 16;
#pragma unroll 1                                   // unrolled, its remainder paths were 2 x 111 never-run instructions
  for (int i = t0; i < cn * nvr; i += nt) {
    const int r = i / nvr, v = i - r * nvr;
    cp_async16(dst + r * rs + v * 16, (const char*)(base + (long long)r * stride) + v * 16);
  }
  cp_async_commit();
}

// A window longer than one chunk: the next chunk's K and V rows, as the first chunk's. Out of
// line: the 1B step's shards fit one chunk, and inlined this was never-run code in the attention.
template <class TK, class TV>
__device__ __noinline__ void attn_restage(char* ks, int krs, const TK* kb, char* vs, int vrs, const TV* vb,
                                          long long stride, int cn, int hd) {
  attn_stage_rows(ks, krs, kb, stride, cn, hd);
  attn_stage_rows(vs, vrs, vb, stride, cn, hd);
}

// op_attention_smem's shared memory: qs [hg][hd], the new rows [2][hd], scores [hg][cr],
// probabilities [cr][hgp], then K [cr][krs] at byte ks and V [cr][vrs] at byte vs: cr positions
// a chunk, as many as fit below AREA (the work area + the staging area, below the next
// task's preload, AMK_PRE_OFF). Rows are padded by 16 bytes (conflict-free 16-byte row reads).
struct AttnLayout { int cr, krs, vrs, ks, vs; };
__device__ __forceinline__ AttnLayout attn_layout(int hd, int kes, int ves, int hg) {
  constexpr int AREA = AMK_PRE && AMK_PRE_OFF < AMK_STAGE_OFF + AMK_STAGE_BYTES ? AMK_PRE_OFF : AMK_STAGE_OFF + AMK_STAGE_BYTES;
  const int hgp = (hg + 3) & ~3;
  AttnLayout L;
  L.krs = hd * kes + 16; L.vrs = hd * ves + 16;
  int cr = (AREA - (hg + 2) * hd * 4) / ((hg + hgp) * 4 + L.krs + L.vrs);
  if (cr > NT) cr = NT;
  L.cr = cr & ~3;
  L.ks = ((hg + 2) * hd + (hg + hgp) * L.cr) * 4;
  L.vs = L.ks + L.cr * L.krs;
  return L;
}

// qs[0:n) = heads of q (fp32), rotated at position p when the descriptor says Q_ROPE; and when
// kn (NEW_KV's new k row of the kv head, and vn its v row), nrow[0:2 hd) = those rows as the
// cache stores them, k rotated first when K_ROPE. One loop: one inlined sin/cos (a second copy
// raised the register pressure of every device function, NOTES v11).
// QKN (folds.norm_into_attention): q's heads and/or the new k row are RMS-normalised here
// first, per head, with the weights at the inputs QKN_ARGS names (q: & 255, k: >> 8): op_rmsnorm's
// formula, summation order and rounding (rms_rows_warp), so the bits of the unfused steps.
template <bool QKN, class T>
__device__ __forceinline__ float attn_in(const T* src, int i, int hd, const float* rs, const T* w) {
  const float x = to_f(src[i]);
  return QKN && w ? to_f(from_f<T>((x * rs[i / hd]) * to_f(w[i % hd]))) : x;
}

template <class TQ, class TK, class TV, class TN, class TF, bool QKN>
__device__ __forceinline__ void attn_stage_q(const TaskDesc& d, void* const* P, float* qs, const TQ* q,
                                             int n, int hd, float p, const TN* kn, const TN* vn, float* nrow) {
  const int half = hd / 2, nk = kn ? hd : 0;
  __shared__ float nrs[9];                           // QKN: 1 / rms of each q head of the pass, then k
  const int qa = QKN ? d.ip[P_ATTN_QKN_ARGS] & 255 : 0, ka = QKN ? d.ip[P_ATTN_QKN_ARGS] >> 8 : 0;
  const TQ* wq = qa ? (const TQ*)P[qa] : nullptr;
  const TN* wk = kn && ka ? (const TN*)P[ka] : nullptr;
  if (QKN) {
    const int nq = n / hd, w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (w < nq + 1 && (w < nq ? wq != nullptr : wk != nullptr)) {
      float ss = 0.f;
      for (int i = lane; i < hd; i += 32) {
        const float x = w < nq ? to_f(q[w * hd + i]) : to_f(kn[i]);
        ss += x * x;
      }
      ss = warp_sum(ss);
      if (lane == 0) nrs[w] = rsqrtf(ss / (float)hd + d.fp[F_ATTN_QKN_EPS]);
    }
    __syncthreads();
  }
  const float* k_rs = nrs + n / hd;
  for (int i = threadIdx.x; i < n + nk; i += NT) {
    const bool isk = i >= n;
    const int ii = isk ? i - n : i, j = ii % hd;
    const float x = isk ? attn_in<QKN>(kn, ii, hd, k_rs, wk) : attn_in<QKN>(q, ii, hd, nrs, wq);
    float r = x;
    if (d.ip[isk ? P_ATTN_K_ROPE : P_ATTN_Q_ROPE]) {
      const int fj = j < half ? j : j - half, pi = j < half ? ii + half : ii - half;
      const float inv = d.ip[P_ATTN_ROPE_INV] ? to_f(((const TF*)P[d.n_in - 1])[fj])
                                               : rope_inv_pow(d.fp[F_ATTN_THETA], fj, half);
      float sn, cs;
      sincosf(p * inv, &sn, &cs);                    // one range reduction for both
      const float xp = isk ? attn_in<QKN>(kn, pi, hd, k_rs, wk) : attn_in<QKN>(q, pi, hd, nrs, wq);
      const float o = j < half ? x * cs - xp * sn : x * cs + xp * sn;
      r = isk ? to_f(from_f<TN>(o)) : to_f(from_f<TQ>(o));
    }
    if (!isk) { qs[ii] = r; continue; }
    nrow[ii] = to_f(from_f<TK>(r));
    nrow[hd + ii] = to_f(from_f<TV>(to_f(vn[ii])));
  }
}

// Two adjacent values of a V row (its dims 2 d2, 2 d2 + 1) as floats.
__device__ __forceinline__ void attn_v2(const char* p, float& a, float& b, bf16*) {
  const unsigned u = *(const unsigned*)p; a = __uint_as_float(u << 16); b = __uint_as_float(u & 0xffff0000u);
}
__device__ __forceinline__ void attn_v2(const char* p, float& a, float& b, f16*) {
  const f16* h = (const f16*)p; a = to_f(h[0]); b = to_f(h[1]);
}
__device__ __forceinline__ void attn_v2(const char* p, float& a, float& b, float*) {
  const float2 f = *(const float2*)p; a = f.x; b = f.y;
}

// The staged attention's early phase (ATTN EARLY, encoders._early: one sequence, one pass), run
// by warps 1-15 while thread 0 polls the task's counters (scheduler.cu run_early): nothing this
// step writes feeds pos or the cache rows it copies, so the pos load and the first chunk's K and
// V copies (two cp.async groups a thread, waited for by the task) overlap the wait instead of
// following it. The window goes to amk_attn_early for the task.
struct AttnEarly { long long lo, hi, pos; int live; };
__shared__ AttnEarly amk_attn_early;
template <class TQ, class TK, class TV, class TO, class TN, class TF, int HG, int HDC, bool CAP, bool QKN = false>
__device__ __noinline__ void attn_early(AMK_PARAMS) {
  const int b = d.ip[P_ATTN_B_OFF], g = d.ip[P_ATTN_H_OFF] / (d.ip[P_ATTN_NH] / d.ip[P_ATTN_NKV]);
  long long lo, hi, pos;
  const bool live = attn_window(d, P, b, lo, hi, pos);
  if (threadIdx.x == 32) amk_attn_early = AttnEarly{lo, hi, pos, live ? 1 : 0};
  if (!live) { cp_async_commit(); cp_async_commit(); return; }
  const AttnLayout L = attn_layout(HDC, (int)sizeof(TK), (int)sizeof(TV), HG);
  const long long nkv = d.ip[P_ATTN_NKV], rstride = nkv * HDC, row0 = ((long long)b * d.ip[P_ATTN_MAX_SEQ] + lo) * nkv + g;
  const int n = (int)(hi - lo), cn0 = n < L.cr ? n : L.cr;
  attn_stage_rows(smem + L.ks, L.krs, (const TK*)P[1] + row0 * HDC, rstride, cn0, HDC, threadIdx.x - 32, NT - 32);
  attn_stage_rows(smem + L.vs, L.vrs, (const TV*)P[2] + row0 * HDC, rstride, cn0, HDC, threadIdx.x - 32, NT - 32);
}

// HG: the q heads of one pass, a template constant (encoders.py: the largest divisor of the heads a
// kv group has, up to 8), so the per-head sums are registers with no predicates (a pass of
// nhs < HG heads leaves the rest of pt, alpha and acc stale: never written out). Phases:
// scores one (head, position) a thread; softmax a warp a head, writing probabilities
// transposed (pt: [position][HGP], HGP = HG rounded up to 4: float4 reads); P.V a thread per 2
// dims and position group (a warp = a row of 32 dim pairs for hd = 64), each position one
// 4-byte V read and HGP/4 16-byte reads (NOTES v10: the old loop was an LDS latency chain).
// AMK_MARK (profile builds; a pass's last chunk): 0 entered, 1 the pass's smem free (its
// window read), 2 K/V copies issued, 3 q staged, 4 K landed, 5 scores, 6 softmax and V landed,
// 7 P.V, 8 written.
template <class TQ, class TK, class TV, class TO, class TN, class TF, int HG, int HDC, bool CAP, bool QKN = false>
__device__ __noinline__ void op_attention_smem(AMK_PARAMS) {
  constexpr int HGP = (HG + 3) & ~3;
  const int hd = HDC, nh = d.ip[P_ATTN_NH], nkv = d.ip[P_ATTN_NKV];   // HDC: the head dim, a constant
  const int h0 = d.ip[P_ATTN_H_OFF], hc = d.ip[P_ATTN_H_COUNT];
  const int b0 = d.ip[P_ATTN_B_OFF], b1 = b0 + d.ip[P_ATTN_B_COUNT];
  const long long max_seq = d.ip[P_ATTN_MAX_SEQ];
  const bool partial = (d.ip[P_ATTN_FLAGS] & 2) != 0;
  const float scale = d.fp[F_ATTN_SCALE];
  const int rep = nh / nkv;
  AMK_MARK(0);
  const bool early = d.ip[P_ATTN_EARLY] != 0;   // attn_early read the window, issued the first chunk
  long long lo, hi, pos;                // sequence b0's window first: its pos load overlaps the setup
  bool live;
  if (early) {
    const AttnEarly e = amk_attn_early;
    lo = e.lo; hi = e.hi; pos = e.pos; live = e.live != 0;
  } else {
    live = attn_window(d, P, b0, lo, hi, pos);
  }
  if (!live && b1 - b0 == 1) return;                         // not a live shard this step
  const TQ* q = (const TQ*)P[0]; const TK* kc = (const TK*)P[1]; const TV* vc = (const TV*)P[2];
  TO* out = (TO*)P[d.n_in];
  const AttnLayout L = attn_layout(hd, (int)sizeof(TK), (int)sizeof(TV), HG);
  const int krs = L.krs, vrs = L.vrs, CR = L.cr;
  const int tid = threadIdx.x, hd2 = hd / 2, PG = NT / hd2, d2 = tid % hd2, pg = tid / hd2;
  float* qs = (float*)smem;                                  // [HG][hd]
  float* nrow = qs + HG * hd;                                // NEW_KV: the new k, v rows [2][hd]
  const int red_f = PG * HG * hd;                            // [PG][HG][hd] partial P.V sums
  float* sc = nrow + 2 * hd;                                 // [HG][CR] scores
  float* pt = sc + HG * CR;                                  // [CR][HGP] probabilities
  char* ks = smem + L.ks;                                    // [CR][krs]
  char* vs = smem + L.vs;                                    // [CR][vrs]
  float* red = (CR * (krs + vrs) >= red_f * 4) ? (float*)ks : (float*)(vs + CR * vrs);   // after the last chunk
  __shared__ float m_run[HG], l_run[HG], alpha[HG];
  constexpr int KV = VecN<TK>::N;
  const long long rstride = (long long)nkv * hd;

  for (int b = b0; b < b1; b++) {
    if (b > b0) live = attn_window(d, P, b, lo, hi, pos);
    if (!live) continue;                                     // not a live shard of b this step
    const int n = (int)(hi - lo);                            // the live window: the shard's rows
    for (int g = h0 / rep; g < (h0 + hc) / rep; g++)
      for (int hs0 = 0; hs0 < rep; hs0 += HG) {
        const int nhs = rep - hs0 < HG ? rep - hs0 : HG;      // == HG unless HG does not divide rep
        const int hbase = g * rep + hs0;
        const TK* kbase = kc + (b * max_seq * nkv + g) * hd;
        const TV* vbase = vc + (b * max_seq * nkv + g) * hd;
        __syncthreads();                                     // the previous users of smem
        AMK_MARK(1);
        const int cn0 = n < CR ? n : CR;
        if (!early) {
          attn_stage_rows(ks, krs, kbase + lo * rstride, rstride, cn0, hd);   // before q
          attn_stage_rows(vs, vrs, vbase + lo * rstride, rstride, cn0, hd);
        }
        AMK_MARK(2);
        // NEW_KV: the window holds pos (hi = pos + 1): the new rows, to smem (registers spill)
        const int new_r = d.ip[P_ATTN_NEW_KV] && n > 0 && hi == pos + 1 ? n - 1 : -1;   // its row - lo
        const long long nro = ((long long)b * nkv + g) * hd;
        attn_stage_q<TQ, TK, TV, TN, TF, QKN>(d, P, qs, q + ((long long)b * nh + hbase) * hd, nhs * hd, hd, (float)pos,
                                         new_r >= 0 ? (const TN*)P[4] + nro : nullptr,
                                         new_r >= 0 ? (const TN*)P[5] + nro : nullptr, nrow);
        AMK_MARK(3);
        if (threadIdx.x == 0) preload_next(smem);            // the next task's rows, behind ours
        if (tid < HG) { m_run[tid] = -__int_as_float(0x7f800000); l_run[tid] = 0.f; }
        float acc[HG][2];
#pragma unroll
        for (int j = 0; j < HG; j++) acc[j][0] = acc[j][1] = 0.f;
        for (long long t0 = lo; t0 < hi; t0 += CR) {
          const int cn = hi - t0 < CR ? (int)(hi - t0) : CR;
          if (t0 != lo)                                      // after the previous chunk's last barrier
            attn_restage(ks, krs, kbase + t0 * rstride, vs, vrs, vbase + t0 * rstride, rstride, cn, hd);
          cp_async_wait<1>();                                // K (V may still be in flight)
          __syncthreads();
          AMK_MARK(4);
          // the new row's index in this chunk: in [0, cn) in the last chunk only (an earlier
          // chunk has nr >= cn: writing there ran past the staged rows, into the next task's
          // preload or out of shared memory, once a shard held more than one chunk)
          const int nr = new_r - (int)(t0 - lo);
          const bool new_here = nr >= 0 && nr < cn;
          if (new_here) {
            if (tid < hd) ((TK*)(ks + nr * krs))[tid] = from_f<TK>(nrow[tid]);   // its own write
            __syncthreads();
          }
          // scores: one (head, position) a thread, every thread busy (one position a thread
          // with all heads was latency-bound on cn threads); each 16-byte K vector's dot is its
          // own short chain, added to the score: independent chains (NOTES v9)
          for (int w = tid; w < cn * nhs; w += NT) {
            const int j = w / cn, r = w - j * cn;
            const char* krow = ks + r * krs;
            const float* qj = qs + j * hd;
            float sj = 0.f;
#pragma unroll 4
            for (int e0 = 0; e0 < hd; e0 += KV) {
              float kf[KV];
              unpack(*(const uint4*)(krow + e0 * (int)sizeof(TK)), kf, (TK*)0);
              const float4* qv = (const float4*)(qj + e0);
              float t = 0.f;
#pragma unroll
              for (int e = 0; e < KV / 4; e++) {
                const float4 x = qv[e];
                t += x.x * kf[4 * e] + x.y * kf[4 * e + 1] + x.z * kf[4 * e + 2] + x.w * kf[4 * e + 3];
              }
              sj += t;
            }
            sc[j * CR + r] = sj * scale;
          }
          __syncthreads();
          AMK_MARK(5);
          attn_softmax<CAP>(sc, CR, cn, nhs, m_run, l_run, alpha, pt, HGP, 1, d.fp[F_ATTN_SOFTCAP]);
          cp_async_wait<0>();                                // V
          __syncthreads();
          AMK_MARK(6);
          if (new_here) {
            if (tid < hd) ((TV*)(vs + nr * vrs))[tid] = from_f<TV>(nrow[hd + tid]);
            __syncthreads();
          }
          if (pg < PG) {
#pragma unroll
            for (int j = 0; j < HG; j++) { acc[j][0] *= alpha[j]; acc[j][1] *= alpha[j]; }   // j >= nhs: unused
            const char* vcol = vs + 2 * d2 * (int)sizeof(TV);
#pragma unroll 4
            for (int i = pg; i < cn; i += PG) {
              float v0, v1;
              attn_v2(vcol + i * vrs, v0, v1, (TV*)0);
              const float4* pv = (const float4*)(pt + i * HGP);
#pragma unroll
              for (int c = 0; c < HGP / 4; c++) {
                const float4 p4 = pv[c];
                const float pj[4] = {p4.x, p4.y, p4.z, p4.w};
#pragma unroll
                for (int e = 0; e < 4; e++)
                  if (4 * c + e < HG) { acc[4 * c + e][0] += pj[e] * v0; acc[4 * c + e][1] += pj[e] * v1; }
              }
            }
          }
          __syncthreads();
        }
        cp_async_wait<0>();            // an empty window never waited for its staged rows: red aliases them
        __syncthreads();
        AMK_MARK(7);
        if (pg < PG) {
#pragma unroll
          for (int j = 0; j < HG; j++)
            if (j < nhs) *(float2*)(red + (pg * HG + j) * hd + 2 * d2) = make_float2(acc[j][0], acc[j][1]);
        }
        __syncthreads();
        attn_write<HG>(out, red, m_run, l_run, nhs, hd, PG, (long long)b * nh + hbase, partial, n);
        AMK_MARK(8);
      }
  }
}
