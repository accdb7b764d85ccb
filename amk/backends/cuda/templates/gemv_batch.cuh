// Tensor-core GEMV for a batch of x rows and for quantized weights (gemv_batch.py plans it):
// y[m, n_off + r] = x[m] . W[n_off + r] for the M rows of x (1..any), bf16 x, weights bf16 or
// int8 / packed int4 / fp8 E4M3 with group scales (+ zeros), seed layout (quant.py).
// Each weight vector is read once (through its warp's cp.async ring in shared memory) and
// multiplied against all rows of a pass by mma.sync m16n8k16 (bf16 x bf16 -> fp32): a warp's item is 16
// weight rows (the A operand: lane (g, t) loads rows g and g + 8) x one K segment, the pass's
// rows of x (staged in shared memory as bf16) are the B operand, NB n-tiles of 8 rows.
// The order of k inside an mma is free (a dot product): lane t's 16-byte vector of a k-block of
// 4 x VW elements supplies all its A elements, and x is staged in the order the unpack leaves
// the weights (PERM), so each lane's x fragment is 16-byte vectors too.
// Integer / fp8 weights become bf16 exactly (q - zero is an integer below 256; an E4M3 value
// is a bf16 value); the group scale multiplies the mma's sums of one k-block (the group is a
// multiple of the k-block; smaller groups stay on op_gemv, gemv_batch.py).
// Sums: part[((chunk * MP + m) * NMAT + mat) * rows16 + row] (mma_slot; CH chunks of SPI segments a window
// of KW elements of K; windows add into the same slots in order): fixed order, bit-stable.

template <int QMODE> struct MmaVec { static constexpr int VW = QMODE == 0 ? 8 : (QMODE == 2 ? 32 : 16); };

__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
  unsigned r; asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}
__device__ __forceinline__ unsigned fma_bf16x2(unsigned a, unsigned b, unsigned c) {
  unsigned r; asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c)); return r;
}
__device__ __forceinline__ void mma_bf16(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One 16-byte weight vector -> VW / 2 bf16x2 words, exact: (q - zero) for the integers, the
// value for fp8 and bf16 (z: the row's zero of this k-block's group, 0 without zeros).
// PERM orders (QMODE 2: per 8 elements 0 4 1 5 2 6 3 7; QMODE 3: per 4 elements 0 2 1 3).
template <int QMODE>
__device__ __forceinline__ void mma_unpack(uint4 v, float z, unsigned* o) {
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
  if (QMODE == 0) {
#pragma unroll
    for (int i = 0; i < 4; i++) o[i] = w[i];
  } else if (QMODE == 1) {        // 2^23 + (b ^ 0x80) - (2^23 + 128 + zero) = b - zero, exact
    const float off = 8388736.0f + z;
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const unsigned u = w[i] ^ 0x80808080u;
      const float f0 = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7440)) - off;
      const float f1 = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7441)) - off;
      const float f2 = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7442)) - off;
      const float f3 = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7443)) - off;
      o[2 * i] = pack_bf16x2(f0, f1);
      o[2 * i + 1] = pack_bf16x2(f2, f3);
    }
  } else if (QMODE == 2) {        // bf16 128 + n, times 1 plus -(136 + zero): n - 8 - zero
    const unsigned c = __float_as_uint(-(136.0f + z));
    const unsigned negc = (c >> 16) | (c & 0xffff0000u);
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
      for (int j = 0; j < 4; j++)
        o[4 * i + j] = fma_bf16x2(((w[i] >> (4 * j)) & 0x000F000Fu) | 0x43004300u, 0x3F803F80u, negc);
  } else {                        // E4M3 s eeee mmm -> bf16 s 0000eeee mmm0000, times 2^120
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
      for (int j = 0; j < 2; j++) {
        const unsigned t = (w[i] >> (8 * j)) & 0x00FF00FFu;
        o[2 * i + j] = fma_bf16x2(((t & 0x007F007Fu) << 4) | ((t & 0x00800080u) << 8), 0x7B807B80u, 0x80008000u);
      }
  }
}

// x staging: rows [m0, m0 + mc) of x, k in [k0, k0 + kw), as bf16 at xs + m * XSTRIDE bytes in
// the PERM order; zeros past K and for the pass's rows past mc (the mma reads whole n-tiles).
template <bool PERM3, bool PERM2>
__device__ __forceinline__ uint4 mma_perm(uint4 o) {
  if (PERM2)                                // 0 1 2 3 4 5 6 7 -> 0 4 1 5 2 6 3 7
    return make_uint4(__byte_perm(o.x, o.z, 0x5410), __byte_perm(o.x, o.z, 0x7632),
                      __byte_perm(o.y, o.w, 0x5410), __byte_perm(o.y, o.w, 0x7632));
  if (PERM3)                                // per 4: 0 1 2 3 -> 0 2 1 3
    return make_uint4(__byte_perm(o.x, o.y, 0x5410), __byte_perm(o.x, o.y, 0x7632),
                      __byte_perm(o.z, o.w, 0x5410), __byte_perm(o.z, o.w, 0x7632));
  return o;
}

// Out of line (and mma_stage_xn): inlined into op_gemv_mma with its ring, ptxas spilled (NVRTC 13).
template <bool PERM3, bool PERM2>
__device__ __noinline__ void mma_stage_x(char* xs, int xstride, const bf16* x, int Kd, int m0, int mc, int mp,
                                            int k0, int kw) {
  const int nvec = kw / 8, total = mp * nvec;
  for (int i0 = threadIdx.x; i0 < total; i0 += 8 * NT) {
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; u++) {
      const int i = i0 + u * NT, m = i / nvec, k = k0 + (i - m * nvec) * 8;
      v[u] = (i < total && m < mc && k < Kd) ? ld16(x + (long long)(m0 + m) * Kd + k) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < 8; u++) {
      const int i = i0 + u * NT, m = i / nvec, j = i - m * nvec;
      if (i < total) *(uint4*)(xs + m * xstride + j * 16) = mma_perm<PERM3, PERM2>(v[u]);
    }
  }
}

// NORM's slots of a row's sums of squares: one a warp's 32 vectors when a warp's vectors are
// one row's (nvec % 32 == 0), else one a vector (gemv_batch.norm_slots).
__device__ __forceinline__ int mma_norm_slots(int nvec) { return nvec % 32 == 0 ? nvec / 32 : nvec; }

// NORM (the window of K from k0; x from the pass's first row): x staged as bf16(x * w), the norm
// weight w applied, not yet the row's 1 / rms, which scales the row's sums in the epilogue
// (W (x w r) = r (W (x w)) for a row's scalar r): the norm is off the path to the weights' loop,
// and K may take several windows. Each vector's sum of squares (fp32, its 8 elements in order)
// goes to the row's slots of this window (sq: the window's own; a warp's 32 vectors summed by a
// butterfly first when they are one row's); mma_row_rms adds every window's slots in a fixed
// order: bit-stable, and within bf16 rounding of the unfused norm's bf16((x r) w) (not its
// bits). 4 vectors of x and 4 of w a thread in flight (8 of x with their w: the callers
// spilled, ptxas's call ABI; so did one argument more, or adding to the earlier windows' slots
// here). Out of line, as mma_stage_x.
template <bool PERM3, bool PERM2, class NW>
__device__ __noinline__ void mma_stage_xn(char* xs, int xstride, const bf16* x, int Kd, int k0, int mc, int mp,
                                          int kw, const NW* nw, float* sq) {
  const int nvec = kw / 8, total = mp * nvec, per = mma_norm_slots(nvec), lane = threadIdx.x & 31;
  for (int i0 = threadIdx.x; i0 < total; i0 += 4 * NT) {
    uint4 v[4], wv[4 * 8 / VecN<NW>::N];                 // x's and w's loads in flight together
#pragma unroll
    for (int u = 0; u < 4; u++) {
      const int i = i0 + u * NT, m = i / nvec, k = k0 + (i - m * nvec) * 8;
      const bool in = i < total && m < mc && k < Kd;
      v[u] = in ? ld16(x + (long long)m * Kd + k) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
      for (int h = 0; h < 8 / VecN<NW>::N; h++)
        wv[u * (8 / VecN<NW>::N) + h] = in ? ld16(nw + k + h * VecN<NW>::N) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < 4; u++) {
      const int i = i0 + u * NT, m = i / nvec, j = i - m * nvec;
      float f[8], w[8];
      unpack(v[u], f, (bf16*)0);
#pragma unroll
      for (int h = 0; h < 8 / VecN<NW>::N; h++) unpack(wv[u * (8 / VecN<NW>::N) + h], w + h * VecN<NW>::N, (NW*)0);
      float ss = 0.f;
#pragma unroll
      for (int e = 0; e < 8; e++) ss += f[e] * f[e];
      unsigned o[4];
#pragma unroll
      for (int e = 0; e < 4; e++) o[e] = pack_bf16x2(f[2 * e] * w[2 * e], f[2 * e + 1] * w[2 * e + 1]);
      if (per != nvec) {                          // warp-uniform: a warp's 32 vectors, one row's
        ss = warp_sum(ss);
        if (lane == 0 && i < total && m < mc) sq[m * per + j / 32] = ss;
      } else if (i < total && m < mc) {
        sq[m * per + j] = ss;
      }
      if (i < total) *(uint4*)(xs + m * xstride + j * 16) = mma_perm<PERM3, PERM2>(make_uint4(o[0], o[1], o[2], o[3]));
    }
  }
}

// NORM: rinv[m] = 1 / rms of row m < mc from its slots in the nwin windows' sq[w][m][per] (a
// warp a row, lanes' strided sums, then a butterfly: a fixed order).
template <int MP>
__device__ __noinline__ void mma_row_rms(const float* sq, int per, int nwin, int mc, int Kd, float eps, float* rinv) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int m = warp; m < mc; m += NWARPS) {
    float s = 0.f;
    for (int w = 0; w < nwin; w++)
      for (int k = lane; k < per; k += 32) s += sq[(w * MP + m) * per + k];
    s = warp_sum(s);
    if (lane == 0) rinv[m] = rsqrtf(s / (float)Kd + eps);
  }
}

// The sums: part[((chunk * MP + m) * NMAT + mat) * rows16 + row], consecutive rows at consecutive
// words, so the epilogue's threads (consecutive rows) read without bank conflicts.
__device__ __forceinline__ int mma_slot(int ch, int m, int mat, int row, int MP, int NMAT, int rows16) {
  return ((ch * MP + m) * NMAT + mat) * rows16 + row;
}

// The sums of the pass's rows (part, every chunk added in order) through the epilogue EPI. Out of
// line: inlined, the scheduler spilled (ptxas, NVRTC 13).
// NORM: each row's sums times its 1 / rms (rinv, mma_row_rms) first.
template <class TY, class TS, int EPI, bool BIAS, int NMAT, class TR, class TO, bool NORM>
__device__ __noinline__ void mma_epilogue(const TaskDesc& d, void* const* P, const float* part, int rows16, int MP,
                                             int CH, int m0, int mc, int N, int n_off, int n_tile, const float* rinv) {
  const TS* bias = (const TS*)P[d.ip[P_GEMV_BIAS_AT]];
  const TR* res = (const TR*)P[d.n_in - 1];
  const int cstride = MP * NMAT * rows16;            // from one chunk's sums to the next
  if (EPI == 3) {                 // a warp a row of x: the tile's best (am_better) to its slot
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int m = warp; m < mc; m += NWARPS) {
      float best = -__int_as_float(0x7f800000); int bi = 0x7fffffff;
      for (int r = lane; r < n_tile; r += 32) {
        const float* sl = part + mma_slot(0, m, 0, r, MP, NMAT, rows16);
        float s = 0.f;
#pragma unroll 1
        for (int c = 0; c < CH; c++) s += sl[c * cstride];
        if (NORM) s *= rinv[m];
        const int col = n_off + r;
        if (BIAS) s += to_f(bias[col]);
        const TY o = from_f<TY>(s);
        ((TY*)P[d.n_in])[(long long)(m0 + m) * N + col] = o;
        if (am_better(to_f(o), col, best, bi)) { best = to_f(o); bi = col; }
      }
      warp_argmax(best, bi);
      if (lane == 0) {
        float* pa = (float*)P[d.n_in + 1] + 2 * ((long long)(m0 + m) * d.ip[P_GEMV_ARG_SLOTS] + d.ip[P_GEMV_ARG_SLOT]);
        pa[0] = best; pa[1] = __int_as_float(bi);
      }
    }
    return;
  }
  const int per = EPI == 2 ? n_tile : NMAT * n_tile;
  for (int i = threadIdx.x; i < per * mc; i += NT) {
    const int m = i / per, r = i - m * per, mat = r / n_tile, row = r - mat * n_tile, col = n_off + row;
    const float* sl = part + mma_slot(0, m, mat, row, MP, NMAT, rows16);
    float s = 0.f;
#pragma unroll 1
    for (int c = 0; c < CH; c++) s += sl[c * cstride];
    if (NORM) s *= rinv[m];
    const long long o = (long long)(m0 + m) * N + col;
    if (EPI == 2) {
      const float* su = part + mma_slot(0, m, 1, row, MP, NMAT, rows16);
      float u = 0.f;
#pragma unroll 1
      for (int c = 0; c < CH; c++) u += su[c * cstride];
      if (NORM) u *= rinv[m];
      ((TO*)P[d.n_in])[o] = from_f<TO>(ew_apply<EW_SILU_MUL>(to_f(from_f<TY>(s)), to_f(from_f<TY>(u)), 0.f));
    } else {
      if (BIAS) s += to_f(bias[col]);
      if (EPI == 1) ((TO*)P[d.n_in])[o] = from_f<TO>(to_f(from_f<TY>(s)) + to_f(res[o]));
      else ((TY*)P[d.n_in + mat])[o] = from_f<TY>(s);
    }
  }
}

// The group of k-block kb's scales (the last group holds the rest of K).
__device__ __forceinline__ int mma_group(int kb, int group, int ng) {
  const int gi = kb / group; return gi > ng - 1 ? ng - 1 : gi;
}

// A scale or zero of type T as the 4-byte word that holds it (cp.async copies 4, 8 or 16 bytes).
template <class T> __device__ __forceinline__ const void* mma_word(const T* p, long long i) {
  return (const char*)p + ((i * (long long)sizeof(T)) & ~3LL);
}
// odd: the element's index is odd (a 2-byte type: the word's high half)
__device__ __forceinline__ float mma_from_word(unsigned w, int, const float*) { return __uint_as_float(w); }
__device__ __forceinline__ float mma_from_word(unsigned w, int odd, const bf16*) {
  bf16 h; h.x = (unsigned short)(odd ? w >> 16 : w); return to_f(h);
}
__device__ __forceinline__ float mma_from_word(unsigned w, int odd, const f16*) {
  f16 h; h.x = (unsigned short)(odd ? w >> 16 : w); return to_f(h);
}

// A warp's jobs, in the order it runs them: in each window, its items it = warp + q NWARPS (q <
// IW, the warp's items a window: every window has the same), each in its SPI segments. A segment
// past its window's end (K, or the window: the last chunk's) is a job without loads. The weights
// do not depend on x, so the warp's ring issues jobs RD - 1 ahead of its compute, across its
// items and windows (gemv_batch.py). MmaCursor: the next job to issue.
struct MmaCursor {
  int k0, q, s, slot;
  __device__ __forceinline__ void next(int SPI, int IW, int KW, int RD) {
    if (++s == SPI) { s = 0; if (++q == IW) { q = 0; k0 += KW; } }
    if (++slot == RD) slot = 0;
  }
};

// A stage of a warp's ring: one job's loads, [h][u][lane] 16-byte weight vectors (rows rlo + g
// + 8h of the tile, vectors vb + 4u + t), then (quantized) [h][u][g] the words holding row rlo +
// g + 8h's scale of k-block u, then its zeros'. The 4 lanes of a row (t) share a k-block's group,
// so its t = 0 lane copies them; the rest read them after a __syncwarp.
template <int QMODE, int KU> struct MmaStage {
  static constexpr int W = 2 * KU * 32 * 16, Q = 2 * KU * 8 * 4;
  static constexpr int BYTES = W + (QMODE == 0 ? 0 : 2 * Q);
};

template <int QMODE, int KU, bool ZEROS, class TS, class TZ>
__device__ __forceinline__ void mma_issue(char* st, const char* W, long long rbytes, int n_off, int rlo, int n_tile,
                                          int nv, int ks, const TS* sp, const TZ* zp, int ng, int group) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  constexpr int VW = MmaVec<QMODE>::VW, KB = 4 * VW;
  using S = MmaStage<QMODE, KU>;
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const int r = rlo + g + 8 * h;
#pragma unroll
    for (int u = 0; u < KU; u++) {
      const int v = ks / VW + 4 * u + t, at = (h * KU + u) * 32 + lane;
      if (r < n_tile && v < nv) cp_async16(st + at * 16, W + (long long)r * rbytes + (long long)v * 16);
      else cp_async16_zero(st + at * 16, W);
      if (QMODE != 0 && t == 0 && r < n_tile) {
        const long long si = (long long)(n_off + r) * ng + mma_group(ks + u * KB, group, ng);
        const int qa = ((h * KU + u) * 8 + g) * 4;
        cp_async4(st + S::W + qa, mma_word(sp, si));
        if (ZEROS) cp_async4(st + S::W + S::Q + qa, mma_word(zp, si));
      }
    }
  }
}

// XR: the pass's MP rows of x over a job's segment into the job's stage, after its weights:
// [m][16-byte vector] with rows of KU * 64 bytes (KU 1: lanes (g, t) read row g's vector t, 8
// lanes of a phase two whole rows: no bank conflicts); zeros past K and for rows past mc.
template <int KU, int MP>
__device__ __forceinline__ void mma_issue_x(char* st, const bf16* x, int Kd, int m0, int mc, int ks) {
  constexpr int CV = KU * 4;                               // 16-byte vectors a row's segment
#pragma unroll
  for (int i = threadIdx.x & 31; i < MP * CV; i += 32) {
    const int m = i / CV, k = ks + (i - m * CV) * 8;
    if (m < mc && k < Kd) cp_async16(st + i * 16, x + (long long)(m0 + m) * Kd + k);
    else cp_async16_zero(st + i * 16, x);
  }
}

__device__ __forceinline__ void mma_ring_wait(int RD) {       // the job RD - 1 groups back is in
  if (RD >= 6) cp_async_wait<5>();
  else if (RD == 5) cp_async_wait<4>();
  else if (RD == 4) cp_async_wait<3>();
  else if (RD == 3) cp_async_wait<2>();
  else if (RD == 2) cp_async_wait<1>();
  else cp_async_wait<0>();
}

// The batched / quantized GEMV (gemv_batch.gemv_mma). NB n-tiles of 8 rows of x a pass (MP = 8
// NB rows; M > MP: passes, each reading the weights again); K in windows of KW (ip), a window's
// K in CH chunks of SPI segments of SEG elements (KU k-blocks: 4 lanes x 16-byte vectors), one
// item a (matrix, 16-row group, chunk). A warp's weights come through its ring of RD stages in
// shared memory (cp.async; ip RD): issued RD - 1 jobs ahead, across its items and windows, so a
// window's x staging (and norm) overlaps the loads. EPI as op_gemv_direct's, for every row m
// of x: 0 store (+ bias), 1 ADD the residual's row m, 2 (NMAT 2) silu(gate) * up, 3 store and
// the tile's argmax partial of row m at parts[(m ARG_SLOTS + ARG_SLOT) 2]. NORM: x is the
// RMSNorm of P[0] with weight P[n_in - 1] (its windows' sums of squares added). XR (bf16, no
// NORM): no x window: each job's stage also holds x's rows over its segment (mma_issue_x), one k-block a job (KU 1), so
// x streams with the weights RD - 1 jobs ahead (a tile of one 16-row group reads x once either
// way: o and down at batch 16, whose x windows cost 4 barriers and stagings a tile).
// P: x, W_1..W_NMAT, [scales_1..NMAT, [zeros_1..NMAT]] (quantized), [bias], [residual | norm weight],
// then the outputs. KS: only K's slice [KLO, KHI) (ip; a split GEMV's partial sums, passes/tile.py,
// whole segments): x's rows and the weights' keep their strides, k stays absolute.
template <class TY, class TS, class TZ, int QMODE, int NMAT, int EPI, bool BIAS, bool ZEROS, int NB,
          class TR = float, class TO = TY, bool NORM = false, class NW = float, bool XR = false,
          bool KS = false>
__device__ __noinline__ void op_gemv_mma(AMK_PARAMS) {
  constexpr int VW = MmaVec<QMODE>::VW, KB = 4 * VW, KU = XR ? 1 : 2, SEG = KU * KB, MP = 8 * NB;
  constexpr bool PERM2 = QMODE == 2, PERM3 = QMODE == 3;
  static_assert(!XR || (QMODE == 0 && !NORM), "x through the ring: bf16 weights, no norm");
  static_assert(!KS || !NORM, "a K slice has no whole rows to normalise");
  using S = MmaStage<QMODE, KU>;
  constexpr int SB = S::BYTES + (XR ? MP * KU * 64 : 0);  // a stage: the job's weights, then (XR) its x
  const int M = d.ip[P_GEMV_M], Kd = d.ip[P_GEMV_K], N = d.ip[P_GEMV_N];
  const int KLO = KS ? d.ip[P_GEMV_KLO] : 0, KHI = KS ? d.ip[P_GEMV_KHI] : Kd;
  const int n_off = d.ip[P_GEMV_N_OFF], n_tile = d.ip[P_GEMV_N_TILE];
  const int KW = d.ip[P_GEMV_KW], SPI = d.ip[P_GEMV_SPI], RD = d.ip[P_GEMV_RD];
  const int group = d.ip[P_GEMV_GROUP], ng = d.ip[P_GEMV_NGROUPS];
  const long long rbytes = QMODE == 0 ? (long long)d.ip[P_GEMV_LDW] * 2 : (long long)d.ip[P_GEMV_LDW];
  const int nv = Kd / VW;                                  // 16-byte vectors a row
  const int xstride = XR ? 0 : KW * 2 + (QMODE == 0 ? 64 : 16);   // lanes' 16-byte x loads: no bank conflicts
  const int xrow = XR ? KU * 64 : xstride;                 // a row of x where the mma reads it
  const int rows16 = (n_tile + 15) & ~15, groups = rows16 / 16;
  const int CH = (KW + SPI * SEG - 1) / (SPI * SEG), items = NMAT * groups * CH;
  const bf16* x = (const bf16*)P[0];
  char* xs = smem;
  float* part = (float*)(smem + ((MP * xstride + 15) & ~15));
  const int per = NORM ? mma_norm_slots(KW / 8) : NWARPS;  // NORM: a row's slots of sums of squares
  float* sq = part + NMAT * rows16 * MP * CH;              // [windows][MP][per], then rinv [MP]
  float* rinv = sq + (NORM ? (Kd + KW - 1) / KW : 1) * MP * per;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  // aligned as an offset from smem, so the ring is read by LDS (through an integer cast the
  // compiler lost that it is shared memory and read it by generic 64-bit loads: bf16 batch 16
  // -4%, v47)
  char* ring = smem + ((((char*)(rinv + MP) - smem) + 15) & ~15) + warp * RD * SB;
  AMK_MARK(0);
  for (int m0 = 0; m0 < M; m0 += MP) {
    const int mc = M - m0 < MP ? M - m0 : MP;
    const int IW = warp < items ? (items - warp + NWARPS - 1) / NWARPS : 0;
    MmaCursor ic = {KLO, 0, 0, 0};                         // the next job to issue
    auto issue = [&]() {
      if (IW > 0 && ic.k0 < KHI) {
        const int it = warp + ic.q * NWARPS, mat = it / (groups * CH), grp = (it - mat * groups * CH) / CH;
        const int ks = ic.k0 + (it % CH) * SPI * SEG + ic.s * SEG;
        if (ks < KHI && ks < ic.k0 + KW) {
          mma_issue<QMODE, KU, ZEROS, TS, TZ>(ring + ic.slot * SB, (const char*)P[1 + mat] + (long long)n_off * rbytes,
                                              rbytes, n_off, grp * 16, n_tile, nv, ks, (const TS*)P[1 + NMAT + mat],
                                              (const TZ*)P[ZEROS ? 1 + 2 * NMAT + mat : 1 + NMAT + mat], ng, group);
          if (XR) mma_issue_x<KU, MP>(ring + ic.slot * SB + S::BYTES, x, Kd, m0, mc, ks);
        }
      }
      cp_async_commit();                                   // empty past the last job: the count stays
      ic.next(SPI, IW, KW, RD);
    };
    int slot = 0;                                          // the next job's stage
    for (int k0 = KLO; k0 < KHI; k0 += KW) {
      __syncthreads();                                     // the last window's (the last pass's) readers are done
      // x's loads first, then the ring's first RD - 1 jobs (behind x: issued before it, they
      // delayed the staging)
      if (NORM)                                            // the window's slots: sq[k0 / KW][m][per]
        mma_stage_xn<PERM3, PERM2, NW>(xs, xstride, x + (long long)m0 * Kd, Kd, k0, mc, MP, KW, (const NW*)P[d.n_in - 1],
                                       sq + k0 / KW * MP * per);
      else if (!XR) mma_stage_x<PERM3, PERM2>(xs, xstride, x, Kd, m0, mc, MP, k0, KW);
      if (k0 == KLO)
        for (int p = 1; p < RD; p++) issue();
      if (!XR) __syncthreads();
      AMK_MARK(1);
#pragma unroll 1
      for (int q = 0; q < IW; q++) {
        const int it = warp + q * NWARPS, mat = it / (groups * CH), grp = (it - mat * groups * CH) / CH, ch = it % CH;
        const int kc0 = k0 + ch * SPI * SEG;               // the chunk's first k
        float acc[NB][4];
#pragma unroll
        for (int b = 0; b < NB; b++) acc[b][0] = acc[b][1] = acc[b][2] = acc[b][3] = 0.f;
#pragma unroll 1
        for (int s = 0; s < SPI; s++) {
          issue();
          mma_ring_wait(RD);
          if (QMODE != 0 || XR) __syncwarp();              // the t = 0 lanes' scale words, other lanes' x
          const char* stg = ring + slot * SB;
          slot = slot + 1 == RD ? 0 : slot + 1;
          const int ks = kc0 + s * SEG;
          if (ks >= KHI || ks >= k0 + KW) continue;        // past the window: no loads, no sums
#pragma unroll
          for (int u = 0; u < KU; u++) {
            const int kb = ks + u * KB;                    // the k-block's first k
            if (kb >= KHI) break;
            float sc[2] = {1.f, 1.f}, zz[2] = {0.f, 0.f};
            if (QMODE != 0) {
#pragma unroll
              for (int h = 0; h < 2; h++) {
                const int r = grp * 16 + g + 8 * h, qa = ((h * KU + u) * 8 + g) * 4;
                if (r < n_tile) {
                  const int odd = ((n_off + r) * ng + mma_group(kb, group, ng)) & 1;   // (parity: 32 bits suffice)
                  sc[h] = mma_from_word(*(const unsigned*)(stg + S::W + qa), odd, (const TS*)0);
                  if (ZEROS) zz[h] = mma_from_word(*(const unsigned*)(stg + S::W + S::Q + qa), odd, (const TZ*)0);
                }
              }
            }
            unsigned a0[VW / 2], a1[VW / 2];
            mma_unpack<QMODE>(*(const uint4*)(stg + ((0 * KU + u) * 32 + lane) * 16), zz[0], a0);
            mma_unpack<QMODE>(*(const uint4*)(stg + ((1 * KU + u) * 32 + lane) * 16), zz[1], a1);
            const char* xk = (XR ? stg + S::BYTES + (u * KB + t * VW) * 2 : xs + (kb - k0 + t * VW) * 2) + g * xrow;
            float ct[NB][4];
#pragma unroll
            for (int b = 0; b < NB; b++) ct[b][0] = ct[b][1] = ct[b][2] = ct[b][3] = 0.f;
#pragma unroll
            for (int b = 0; b < NB; b++) {
#pragma unroll
              for (int h = 0; h < VW / 8; h++) {           // 8 x values (two mma k-steps) a 16-byte load
                const uint4 xv = *(const uint4*)(xk + b * 8 * xrow + h * 16);
                float (&c)[4] = QMODE != 0 ? ct[b] : acc[b];
                mma_bf16(c, a0[4 * h], a1[4 * h], a0[4 * h + 1], a1[4 * h + 1], xv.x, xv.y);
                mma_bf16(c, a0[4 * h + 2], a1[4 * h + 2], a0[4 * h + 3], a1[4 * h + 3], xv.z, xv.w);
              }
            }
            if (QMODE != 0) {                              // the group scale of each row
#pragma unroll
              for (int b = 0; b < NB; b++) {
                acc[b][0] += sc[0] * ct[b][0]; acc[b][1] += sc[0] * ct[b][1];
                acc[b][2] += sc[1] * ct[b][2]; acc[b][3] += sc[1] * ct[b][3];
              }
            }
          }
        }
        // c0, c1: row g, x rows 2t, 2t + 1 of the n-tile; c2, c3: row g + 8
#pragma unroll
        for (int b = 0; b < NB; b++)
#pragma unroll
          for (int e = 0; e < 4; e++) {
            const int row = grp * 16 + g + 8 * (e >> 1), m = b * 8 + 2 * t + (e & 1);
            float* sum = part + mma_slot(ch, m, mat, row, MP, NMAT, rows16);
            if (k0 == KLO) *sum = acc[b][e]; else *sum += acc[b][e];
          }
      }
      AMK_MARK(2);
    }
    if (NORM) mma_row_rms<MP>(sq, per, (Kd + KW - 1) / KW, mc, Kd, d.fp[F_GEMV_EPS], rinv);   // items done
    cp_async_wait<0>();                                    // the ring's groups past the last job (empty)
    __syncthreads();
    AMK_MARK(3);
    mma_epilogue<TY, TS, EPI, BIAS, NMAT, TR, TO, NORM>(d, P, part, rows16, MP, CH, m0, mc, N, n_off, n_tile, rinv);
  }
  AMK_MARK(4);
}
