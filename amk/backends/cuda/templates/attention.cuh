// Decode attention over cache rows [kv_start, kv_start+kv_len) ∩ [0, pos+1), the position read
// on the device. One kv group at a time (its q heads share every K/V row: GQA), in chunks of NT
// positions with an online softmax: scores (thread = position) -> chunk max/exp (warp = head)
// -> P·V (thread = (dim, position group)). PARTIAL_WRITE emits the flash partial [acc | m | l].

__device__ __forceinline__ void attn_window(const TaskDesc& d, void* const* P, long long& lo, long long& hi) {
  lo = d.ip[P_ATTN_KV_START];
  hi = lo + d.ip[P_ATTN_KV_LEN];
  if (hi > d.ip[P_ATTN_MAX_SEQ]) hi = d.ip[P_ATTN_MAX_SEQ];
  if (d.ip[P_ATTN_HAS_POS]) { long long p = read_int(P[3], d.ip[P_ATTN_POS64]); if (hi > p + 1) hi = p + 1; }
  if (hi < lo) hi = lo;
}

template <class TQ, class TK, class TV, class TO>
__device__ __noinline__ void op_attention(AMK_PARAMS) {
  constexpr int HG = 8;                               // q heads per pass (registers per thread)
  const int hd = d.ip[P_ATTN_HD], nh = d.ip[P_ATTN_NH], nkv = d.ip[P_ATTN_NKV];
  const int h0 = d.ip[P_ATTN_H_OFF], hc = d.ip[P_ATTN_H_COUNT], B = d.ip[P_ATTN_B];
  const long long max_seq = d.ip[P_ATTN_MAX_SEQ];
  const bool partial = (d.ip[P_ATTN_FLAGS] & 2) != 0;
  const float scale = d.fp[F_ATTN_SCALE];
  const int rep = nh / nkv;
  long long lo, hi;
  attn_window(d, P, lo, hi);
  const int n = (int)(hi - lo);
  const TQ* q = (const TQ*)P[0]; const TK* kc = (const TK*)P[1]; const TV* vc = (const TV*)P[2];
  TO* out = (TO*)P[d.n_in];
  float* qs = (float*)smem;                          // [HG][hd]
  float* sc = qs + HG * hd;                          // [HG][NT] scores, then probabilities
  float* red = sc + HG * NT;                         // [PG][HG][hd] partial P·V sums
  __shared__ float m_run[HG], l_run[HG], alpha[HG];
  const int tid = threadIdx.x, PG = NT / hd, dd = tid % hd, pg = tid / hd;
  constexpr int KV = VecN<TK>::N;
  const bool kvec = (hd % KV) == 0;

  for (int b = 0; b < B; b++)
    for (int g = h0 / rep; g < (h0 + hc) / rep; g++)
      for (int hs0 = 0; hs0 < rep; hs0 += HG) {
        const int nhs = rep - hs0 < HG ? rep - hs0 : HG;
        const int hbase = g * rep + hs0;
        __syncthreads();
        for (int i = tid; i < nhs * hd; i += NT) qs[i] = to_f(q[((long long)b * nh + hbase) * hd + i]);
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
            if (kvec) {
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
          const int w = tid >> 5, lane = tid & 31;
          if (w < nhs) {
            float mc = -__int_as_float(0x7f800000);
            for (int i = lane; i < cn; i += 32) mc = fmaxf(mc, sc[w * NT + i]);
            mc = warp_max(mc);
            const float mold = m_run[w];
            const float mnew = fmaxf(mold, mc);
            float ls = 0.f;
            for (int i = lane; i < cn; i += 32) { const float p = expf(sc[w * NT + i] - mnew); sc[w * NT + i] = p; ls += p; }
            ls = warp_sum(ls);
            if (lane == 0) {
              const float a = expf(mold - mnew);
              alpha[w] = a; l_run[w] = l_run[w] * a + ls; m_run[w] = mnew;
            }
          }
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
              for (int u = 0; u < 8; u++) vv[u] = to_f(vcol[(long long)(i + u * PG) * vstride]);
#pragma unroll
              for (int u = 0; u < 8; u++)
#pragma unroll
                for (int j = 0; j < HG; j++) if (j < nhs) acc[j] += sc[j * NT + i + u * PG] * vv[u];
            }
            for (; i < cn; i += PG) {
              const float v = to_f(vcol[(long long)i * vstride]);
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
        for (int i = tid; i < nhs * hd; i += NT) {
          const int j = i / hd, e = i - j * hd, h = hbase + j;
          float a = 0.f;
          for (int k = 0; k < PG; k++) a += red[(k * HG + j) * hd + e];
          if (partial) {
            const long long base = ((long long)b * nh + h) * (hd + 2);
            out[base + e] = from_f<TO>(n > 0 ? a : 0.f);
            if (e == 0) {
              out[base + hd] = from_f<TO>(n > 0 ? m_run[j] : -__int_as_float(0x7f800000));
              out[base + hd + 1] = from_f<TO>(n > 0 ? l_run[j] : 0.f);
            }
          } else {
            out[((long long)b * nh + h) * hd + e] = from_f<TO>(n > 0 ? a / l_run[j] : 0.f);
          }
        }
      }
}

// L2 prefetch of the K/V rows this task will read (the window is known before the wait: the
// position is an input). Whole rows when the task covers every head, else per-row segments.
__device__ void prefetch_attention(const TaskDesc& d, const unsigned long long* ptrs, int lane) {
  void* P[4];
  for (int i = 0; i < 4 && i < d.n_in; i++) P[i] = (void*)ptrs[d.ptr_begin + i];
  long long lo, hi;
  attn_window(d, P, lo, hi);
  if (hi <= lo) return;
  const long long hd = d.ip[P_ATTN_HD], nkv = d.ip[P_ATTN_NKV], max_seq = d.ip[P_ATTN_MAX_SEQ];
  const int rep = d.ip[P_ATTN_NH] / nkv;
  const long long g0 = d.ip[P_ATTN_H_OFF] / rep, g1 = (d.ip[P_ATTN_H_OFF] + d.ip[P_ATTN_H_COUNT]) / rep;
  for (int which = 1; which <= 2; which++) {
    const long long es = which == 1 ? d.ip[P_ATTN_KES] : d.ip[P_ATTN_VES];
    const unsigned long long base = (unsigned long long)P[which];
    for (long long b = 0; b < d.ip[P_ATTN_B]; b++) {
      if (g0 == 0 && g1 == nkv) {
        if (lane == 0) prefetch_l2(base + ((b * max_seq + lo) * nkv) * hd * es, (hi - lo) * nkv * hd * es);
      } else {
        for (long long t = lo + lane; t < hi; t += 32)
          prefetch_l2(base + ((b * max_seq + t) * nkv + g0) * hd * es, (g1 - g0) * hd * es);
      }
    }
  }
}

// The same attention with the shard's K and V rows staged in shared memory by 16-byte cp.async
// (every row of a chunk in flight at once, issued before q is staged; K and V are separate
// groups, so the scores start when K has landed while V is still on its way). Rows are padded
// by 16 bytes (conflict-free 16-byte row reads across threads). Chunks of CR <= NT rows, CR
// from the work area below AMK_RING_OFF. Needs hd * sizeof(TK|TV) % 16 == 0 (lower checks).
template <class T>
__device__ __forceinline__ void attn_stage_rows(char* dst, int rs, const T* base, long long stride,
                                                int cn, int hd) {
  const int nvr = hd * (int)sizeof(T) / 16;
  for (int i = threadIdx.x; i < cn * nvr; i += NT) {
    const int r = i / nvr, v = i - r * nvr;
    cp_async16(dst + r * rs + v * 16, (const char*)(base + (long long)r * stride) + v * 16);
  }
  cp_async_commit();
}

template <class TQ, class TK, class TV, class TO>
__device__ __noinline__ void op_attention_smem(AMK_PARAMS) {
  constexpr int HG = 8;
  const int hd = d.ip[P_ATTN_HD], nh = d.ip[P_ATTN_NH], nkv = d.ip[P_ATTN_NKV];
  const int h0 = d.ip[P_ATTN_H_OFF], hc = d.ip[P_ATTN_H_COUNT], B = d.ip[P_ATTN_B];
  const long long max_seq = d.ip[P_ATTN_MAX_SEQ];
  const bool partial = (d.ip[P_ATTN_FLAGS] & 2) != 0;
  const float scale = d.fp[F_ATTN_SCALE];
  const int rep = nh / nkv;
  long long lo, hi;
  attn_window(d, P, lo, hi);
  const int n = (int)(hi - lo);
  const TQ* q = (const TQ*)P[0]; const TK* kc = (const TK*)P[1]; const TV* vc = (const TV*)P[2];
  TO* out = (TO*)P[d.n_in];
  const int krs = hd * (int)sizeof(TK) + 16, vrs = hd * (int)sizeof(TV) + 16;   // padded rows
  float* qs = (float*)smem;                                  // [HG][hd]
  const int red_f = NT * HG;                                 // [PG][HG][hd] floats, PG*hd <= NT
  int CR = (AMK_RING_OFF - HG * hd * 4) / (HG * 4 + krs + vrs);
  if (CR > NT) CR = NT;
  CR &= ~3;
  float* sc = qs + HG * hd;                                  // [HG][CR]
  char* ks = (char*)(sc + HG * CR);                          // [CR][krs]
  char* vs = ks + CR * krs;                                  // [CR][vrs]
  float* red = (CR * (krs + vrs) >= red_f * 4) ? (float*)ks : (float*)(vs + CR * vrs);   // after the last chunk
  __shared__ float m_run[HG], l_run[HG], alpha[HG];
  const int tid = threadIdx.x, PG = NT / hd, dd = tid % hd, pg = tid / hd;
  constexpr int KV = VecN<TK>::N;
  const long long rstride = (long long)nkv * hd;

  for (int b = 0; b < B; b++)
    for (int g = h0 / rep; g < (h0 + hc) / rep; g++)
      for (int hs0 = 0; hs0 < rep; hs0 += HG) {
        const int nhs = rep - hs0 < HG ? rep - hs0 : HG;
        const int hbase = g * rep + hs0;
        const TK* kbase = kc + (b * max_seq * nkv + g) * hd;
        const TV* vbase = vc + (b * max_seq * nkv + g) * hd;
        __syncthreads();                                     // the previous users of smem
        if (lo < hi) {
          const int cn0 = hi - lo < CR ? (int)(hi - lo) : CR;
          attn_stage_rows(ks, krs, kbase + lo * rstride, rstride, cn0, hd);
          attn_stage_rows(vs, vrs, vbase + lo * rstride, rstride, cn0, hd);
        }
        for (int i = tid; i < nhs * hd; i += NT) qs[i] = to_f(q[((long long)b * nh + hbase) * hd + i]);
        if (tid < HG) { m_run[tid] = -__int_as_float(0x7f800000); l_run[tid] = 0.f; }
        float acc[HG];
#pragma unroll
        for (int j = 0; j < HG; j++) acc[j] = 0.f;
        for (long long t0 = lo; t0 < hi; t0 += CR) {
          const int cn = hi - t0 < CR ? (int)(hi - t0) : CR;
          if (t0 != lo) {                                    // after the previous chunk's last barrier
            attn_stage_rows(ks, krs, kbase + t0 * rstride, rstride, cn, hd);
            attn_stage_rows(vs, vrs, vbase + t0 * rstride, rstride, cn, hd);
          }
          asm volatile("cp.async.wait_group 1;" ::: "memory");   // K (V may still be in flight)
          __syncthreads();
          if (tid < cn) {
            const char* krow = ks + tid * krs;
            float s[HG];
#pragma unroll
            for (int j = 0; j < HG; j++) s[j] = 0.f;
            for (int e0 = 0; e0 < hd; e0 += KV) {
              float kf[KV];
              unpack(*(const uint4*)(krow + e0 * (int)sizeof(TK)), kf, (TK*)0);
#pragma unroll
              for (int j = 0; j < HG; j++)
                if (j < nhs) {
                  const float4* qv = (const float4*)(qs + j * hd + e0);
#pragma unroll
                  for (int e = 0; e < KV / 4; e++) {
                    const float4 x = qv[e];
                    s[j] += x.x * kf[4 * e] + x.y * kf[4 * e + 1] + x.z * kf[4 * e + 2] + x.w * kf[4 * e + 3];
                  }
                }
            }
#pragma unroll
            for (int j = 0; j < HG; j++) if (j < nhs) sc[j * CR + tid] = s[j] * scale;
          }
          __syncthreads();
          const int w = tid >> 5, lane = tid & 31;
          if (w < nhs) {
            float mc = -__int_as_float(0x7f800000);
            for (int i = lane; i < cn; i += 32) mc = fmaxf(mc, sc[w * CR + i]);
            mc = warp_max(mc);
            const float mold = m_run[w];
            const float mnew = fmaxf(mold, mc);
            float ls = 0.f;
            for (int i = lane; i < cn; i += 32) { const float p = expf(sc[w * CR + i] - mnew); sc[w * CR + i] = p; ls += p; }
            ls = warp_sum(ls);
            if (lane == 0) {
              const float a = expf(mold - mnew);
              alpha[w] = a; l_run[w] = l_run[w] * a + ls; m_run[w] = mnew;
            }
          }
          asm volatile("cp.async.wait_group 0;" ::: "memory");   // V
          __syncthreads();
          if (pg < PG) {
#pragma unroll
            for (int j = 0; j < HG; j++) if (j < nhs) acc[j] *= alpha[j];
            const char* vcol = vs + dd * (int)sizeof(TV);
#pragma unroll 4
            for (int i = pg; i < cn; i += PG) {
              const float v = to_f(*(const TV*)(vcol + i * vrs));
#pragma unroll
              for (int j = 0; j < HG; j++) if (j < nhs) acc[j] += sc[j * CR + i] * v;
            }
          }
          __syncthreads();
        }
        if (pg < PG) {
#pragma unroll
          for (int j = 0; j < HG; j++) if (j < nhs) red[(pg * HG + j) * hd + dd] = acc[j];
        }
        __syncthreads();
        for (int i = tid; i < nhs * hd; i += NT) {
          const int j = i / hd, e = i - j * hd, h = hbase + j;
          float a = 0.f;
          for (int k = 0; k < PG; k++) a += red[(k * HG + j) * hd + e];
          if (partial) {
            const long long base = ((long long)b * nh + h) * (hd + 2);
            out[base + e] = from_f<TO>(n > 0 ? a : 0.f);
            if (e == 0) {
              out[base + hd] = from_f<TO>(n > 0 ? m_run[j] : -__int_as_float(0x7f800000));
              out[base + hd + 1] = from_f<TO>(n > 0 ? l_run[j] : 0.f);
            }
          } else {
            out[((long long)b * nh + h) * hd + e] = from_f<TO>(n > 0 ? a / l_run[j] : 0.f);
          }
        }
      }
}
