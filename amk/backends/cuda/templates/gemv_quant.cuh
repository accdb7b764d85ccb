// The batch-1 GEMV of weight-only quantized weights on CUDA cores (gemv_quant.py chooses it):
// int8, packed int4 or fp8 E4M3 with group scales (+ zeros), seed layout (quant.py), streamed as
// op_gemv_direct streams float weights: up to 16 direct 16-byte loads a lane in flight (8 rolling),
// dequantised in registers against x in shared memory (fp32), the group scale on each 32-bit
// word's partial sum (the FMA path, qfma: on each vector's).

// QMODE 1 int8 / 3 fp8: 16 weights a 16-byte vector; 2 int4: 32. GU vectors a row a lane: an
// item's K segment is 32 x GU x VW = 2048 weights, and RI rows x GU = 16 loads at most (8 with
// zeros or a rolling buffer: their registers made ptxas spill).
template <int QMODE> struct QVec {
  static constexpr int VW = QMODE == 2 ? 32 : 16;
  static constexpr int GU = QMODE == 2 ? 2 : 4;
};

// The vector's words rotated by r (word i is word (i + r) & 3): a lane reads its x words in that
// order, so the 8 lanes of a shared-memory phase hit distinct banks (int8 / fp8: r = (lane >> 1)
// & 3, conflict-free; int4: r = lane & 3, two lanes a bank as the bf16 GEMV).
__device__ __forceinline__ uint4 rot_words(uint4 v, int r) {
  if (r & 1) v = make_uint4(v.y, v.z, v.w, v.x);
  if (r & 2) v = make_uint4(v.z, v.w, v.x, v.y);
  return v;
}

// An E4M3 pair (bits 0-7, 8-15 of h) as two fp32, exactly (sm_89+: one conversion instruction).
__device__ __forceinline__ void fp8x2_to_f32(unsigned h, float& lo, float& hi) {
#if __CUDA_ARCH__ >= 890
  unsigned p;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(p) : "h"((unsigned short)h));
  asm("{.reg .f16 l, u;\n mov.b32 {l, u}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, u;}"
      : "=f"(lo), "=f"(hi) : "r"(p));
#else
  lo = fp8e4m3_to_f(h & 0xffu); hi = fp8e4m3_to_f((h >> 8) & 0xffu);
#endif
}

// A float's high bits C, opaque to ptxas (or'd with the dynamic shared memory size >> 30, which
// is 0: a CTA has less than 1 GiB): with the constant in the permute's immediate slot, ptxas kept
// each byte selector in a register and re-made it from a uniform register at every use (~0.8
// moves a weight in the 1B int4 loop); with the constant in a register the selectors are
// immediates. qmagic(): 2^23 (the exact path); qhalf(): 0.5 (the FMA path).
template <unsigned C> __device__ __forceinline__ unsigned qconst() {
  unsigned m;
  asm("{.reg .u32 t;\n mov.u32 t, %%dynamic_smem_size;\n shr.u32 t, t, 30;\n or.b32 %0, t, %1;}" : "=r"(m) : "n"(C));
  return m;
}
__device__ __forceinline__ unsigned qmagic() { return qconst<0x4B000000u>(); }
__device__ __forceinline__ unsigned qhalf() { return qconst<0x3F000000u>(); }

// a + sum (w_e - zero) x_e over one 32-bit word of weights and its x (xa; int4: xa, xb). off: int8 2^23
// + 128 + zero, int4 2^23 + 8 + zero (a byte b becomes the fp32 2^23 + b by one byte permute,
// exact), fp8 the zero (ZEROS only).
template <int QMODE, bool ZEROS>
__device__ __forceinline__ float qdot_word(float a, unsigned w, float off, const float4& xa, const float4& xb) {
  if (QMODE == 1) {
    const unsigned M = qmagic(), u = w ^ 0x80808080u;     // signed byte b -> unsigned b + 128
    a += (__uint_as_float(__byte_perm(u, M, 0x7440)) - off) * xa.x;
    a += (__uint_as_float(__byte_perm(u, M, 0x7441)) - off) * xa.y;
    a += (__uint_as_float(__byte_perm(u, M, 0x7442)) - off) * xa.z;
    a += (__uint_as_float(__byte_perm(u, M, 0x7443)) - off) * xa.w;
  } else if (QMODE == 2) {                                // byte j: elements 2j (low), 2j + 1
    const unsigned M = qmagic(), lo = w & 0x0F0F0F0Fu, hi = (w >> 4) & 0x0F0F0F0Fu;
    a += (__uint_as_float(__byte_perm(lo, M, 0x7440)) - off) * xa.x;
    a += (__uint_as_float(__byte_perm(hi, M, 0x7440)) - off) * xa.y;
    a += (__uint_as_float(__byte_perm(lo, M, 0x7441)) - off) * xa.z;
    a += (__uint_as_float(__byte_perm(hi, M, 0x7441)) - off) * xa.w;
    a += (__uint_as_float(__byte_perm(lo, M, 0x7442)) - off) * xb.x;
    a += (__uint_as_float(__byte_perm(hi, M, 0x7442)) - off) * xb.y;
    a += (__uint_as_float(__byte_perm(lo, M, 0x7443)) - off) * xb.z;
    a += (__uint_as_float(__byte_perm(hi, M, 0x7443)) - off) * xb.w;
  } else {
    float f0, f1, f2, f3;
    fp8x2_to_f32(w & 0xffffu, f0, f1);
    fp8x2_to_f32(w >> 16, f2, f3);
    if (ZEROS) { f0 -= off; f1 -= off; f2 -= off; f3 -= off; }
    a += f0 * xa.x + f1 * xa.y + f2 * xa.z + f3 * xa.w;
  }
  return a;
}

// The FMA path (qfma: int4 items of two rows or more, int8 ones of at most 8 loads a lane): a
// weight's bits go into the mantissa of 0.5 by one permute, exactly, so a weight costs a permute
// and an FMA: a + sum (0.5 + q / 2^K) x over one word (xa; int4 xa, xb). int8: bytes + 128 at
// bits 8-15, 0.5 + u / 2^16, into a. int4: the low nibbles (w & 0x0F0F0F0F) at bits 16-19, 0.5 +
// q / 2^8, into a; the high ones masked in place (w & 0xF0F0F0F0, no shift) at bits 12-15, 0.5 +
// q / 2^12, into b (bit 23 is the exponent's, so a nibble at bits 20-23 would not do). The
// offsets come off once a vector (qdot_slot), against x's sums, which the item's rows share.
template <int QMODE>
__device__ __forceinline__ void qdot_word_half(float& a, float& b, unsigned w, const float4& xa, const float4& xb) {
  const unsigned H = qhalf();
  if (QMODE == 1) {
    const unsigned u = w ^ 0x80808080u;                   // signed byte b -> unsigned b + 128
    a = fmaf(__uint_as_float(__byte_perm(u, H, 0x7404)), xa.x, a);
    a = fmaf(__uint_as_float(__byte_perm(u, H, 0x7414)), xa.y, a);
    a = fmaf(__uint_as_float(__byte_perm(u, H, 0x7424)), xa.z, a);
    a = fmaf(__uint_as_float(__byte_perm(u, H, 0x7434)), xa.w, a);
  } else {                                                // byte j: elements 2j (low), 2j + 1
    const unsigned lo = w & 0x0F0F0F0Fu, hi = w & 0xF0F0F0F0u;
    a = fmaf(__uint_as_float(__byte_perm(lo, H, 0x7044)), xa.x, a);
    b = fmaf(__uint_as_float(__byte_perm(hi, H, 0x7404)), xa.y, b);
    a = fmaf(__uint_as_float(__byte_perm(lo, H, 0x7144)), xa.z, a);
    b = fmaf(__uint_as_float(__byte_perm(hi, H, 0x7414)), xa.w, b);
    a = fmaf(__uint_as_float(__byte_perm(lo, H, 0x7244)), xb.x, a);
    b = fmaf(__uint_as_float(__byte_perm(hi, H, 0x7424)), xb.y, b);
    a = fmaf(__uint_as_float(__byte_perm(lo, H, 0x7344)), xb.z, a);
    b = fmaf(__uint_as_float(__byte_perm(hi, H, 0x7434)), xb.w, b);
  }
}

// Whether an item of RI rows takes the FMA path: x's sum is shared by two rows or more, and int8
// items of 16 loads a lane kept the exact path (with the FMA path Qwen3-0.6B int8's scheduler
// kept its step counter in local memory).
template <int QMODE, int RI>
__device__ constexpr bool qfma() { return RI >= 2 && (QMODE == 2 || (QMODE == 1 && RI * QVec<QMODE>::GU <= 8)); }

// Slot u of an item (RI rows x one vector a lane) against x in shared memory, into acc: each
// vector's words rotated (rot_words; XPAD: x padded instead, xpad_at, and no rotation), x of a
// word read once for all the item's rows, the scale on each word's sum (the FMA path: on the
// vector's, after its offsets). Vectors past the row (v >= nv) add nothing.
template <int QMODE, bool ZEROS, int RI, bool XPAD>
__device__ __forceinline__ void qdot_slot(uint4 (&wv)[RI][QVec<QMODE>::GU], const float (&sc)[RI][QVec<QMODE>::GU],
                                          const float (&zz)[RI][QVec<QMODE>::GU], float (&acc)[RI], int u,
                                          const float* xs, int v, int nv, int rot, float off0) {
  constexpr int VW = QVec<QMODE>::VW;
  if (v >= nv) return;
  if (!XPAD) {
#pragma unroll
    for (int i = 0; i < RI; i++) wv[i][u] = rot_words(wv[i][u], rot);
  }
  constexpr bool FMA = qfma<QMODE, RI>();
  // FMA: x's sums over the vector (int4: its low- and high-nibble elements apart), the rows' sums
  float xs0 = 0.f, xs1 = 0.f, hs[RI], hh[RI];
#pragma unroll
  for (int i = 0; i < RI; i++) hs[i] = hh[i] = 0.f;
#pragma unroll
  for (int j = 0; j < 4; j++) {
    const float* xw = XPAD ? xs + xpad_at<true>(v * VW) + j * (VW / 4) : xs + v * VW + ((j + rot) & 3) * (VW / 4);
    const float4 xa = *(const float4*)xw;
    const float4 xb = QMODE == 2 ? *(const float4*)(xw + 4) : xa;
    if (FMA && QMODE == 2) {
      xs0 += (xa.x + xa.z) + (xb.x + xb.z);
      xs1 += (xa.y + xa.w) + (xb.y + xb.w);
    } else if (FMA) {
      xs0 += (xa.x + xa.y) + (xa.z + xa.w) + 0.f;   // + 0.f: the int8 code measured (v48: without it
                                                    // ptxas schedules the loop anew, unmeasured)
    }
#pragma unroll
    for (int i = 0; i < RI; i++) {
      const unsigned w = j == 0 ? wv[i][u].x : j == 1 ? wv[i][u].y : j == 2 ? wv[i][u].z : wv[i][u].w;
      if (FMA) qdot_word_half<QMODE>(hs[i], hh[i], w, xa, xb);
      else acc[i] += sc[i][u] * qdot_word<QMODE, ZEROS>(0.f, w, off0 + zz[i][u], xa, xb);
    }
  }
  if (FMA) {
    // sum (q - off - zero) x = 2^K hs - (2^(K-1) + off + zero) xsum, K = 16 (int8, off 128);
    // int4 (off 8): 2^8 hs - (2^7 + 8 + zero) xs0 + 2^12 hh - (2^11 + 8 + zero) xs1
#pragma unroll
    for (int i = 0; i < RI; i++) {
      if (QMODE == 1) {
        acc[i] += sc[i][u] * fmaf(65536.f, hs[i], -(32768.f + 128.f + zz[i][u]) * xs0);
      } else {
        const float lo = fmaf(256.f, hs[i], -(128.f + 8.f + zz[i][u]) * xs0);
        acc[i] += sc[i][u] * (lo + fmaf(4096.f, hh[i], -(2048.f + 8.f + zz[i][u]) * xs1));
      }
    }
  }
}

// An item's row sums (a warp's lanes added) into part[row, seg], rows past the tile dropped.
template <int NMAT, int RI>
__device__ __forceinline__ void qitem_store(const float (&acc)[RI], float* part, int g, int seg, int nseg,
                                            int n_tile, int lane) {
  constexpr int RPM = RI / NMAT;
#pragma unroll
  for (int i = 0; i < RI; i++) {
    const float s = warp_sum(acc[i]);
    const int mat = i / RPM, r = g * RPM + i % RPM;
    if (lane == 0 && r < n_tile) part[(mat * n_tile + r) * nseg + seg] = s;
  }
}

// The rolling register buffer (ROLL, a warp of more than one item; gemv_quant.plan_items): RI
// rows x GU vectors a lane, each slot refilled with the warp's next item once it is read, so
// the next item's loads fly while this one is dequantised, with no second item's registers.
template <class TS, class TZ, int QMODE, int NMAT, bool ZEROS, int RI>
__device__ __forceinline__ void qroll_load(uint4 (&wv)[RI][QVec<QMODE>::GU], float (&sc)[RI][QVec<QMODE>::GU],
                                           float (&zz)[RI][QVec<QMODE>::GU], int u, void* const* P, int it,
                                           int nseg, int n_off, int n_tile, int nv, int ng, int gshift,
                                           long long rbytes, int lane) {
  constexpr int VW = QVec<QMODE>::VW, GU = QVec<QMODE>::GU, RPM = RI / NMAT;
  const int g = it / nseg, seg = it - g * nseg;
  const int v = seg * 32 * GU + u * 32 + lane;
  const int gi = min((v * VW) >> gshift, ng - 1);
#pragma unroll
  for (int i = 0; i < RI; i++) {
    const int mat = i / RPM, r = g * RPM + i % RPM;
    const long long row = n_off + r;
    const bool on = r < n_tile && v < nv;
    const char* W = (const char*)P[1 + mat] + row * rbytes;
    const TS* sp = (const TS*)P[1 + NMAT + mat] + row * ng;
    const TZ* zp = (const TZ*)P[ZEROS ? 1 + 2 * NMAT + mat : 1] + row * ng;
    wv[i][u] = on ? ldg_stream(W + (long long)v * 16) : make_uint4(0u, 0u, 0u, 0u);
    sc[i][u] = on ? to_f(sp[gi]) : 0.f;
    zz[i][u] = ZEROS && on ? to_f(zp[gi]) : 0.f;
  }
}

// op_gemv_qdirect's item loop with the rolling buffer: the first item's loads, then for each
// item its dot products slot by slot, each slot refilled with the next item's vector. (qroll2's
// rewrite of the plain loop's loads, slot-major through a struct, spilled Qwen3-0.6B int8's
// scheduler: +6%, NOTES v44; the plain loop keeps its row-major loads.)
template <class TS, class TZ, int QMODE, int NMAT, bool ZEROS, int RI, bool XPAD>
__device__ __forceinline__ void qroll_items(void* const* P, const float* xs, float* part, int nseg, int n_off,
                                            int n_tile, int nv, int ng, int gshift, long long rbytes, int rot,
                                            float off0, int warp, int lane) {
  constexpr int VW = QVec<QMODE>::VW, GU = QVec<QMODE>::GU, RPM = RI / NMAT;
  uint4 wv[RI][GU];
  float sc[RI][GU], zz[RI][GU];
#pragma unroll
  for (int u = 0; u < GU; u++)
    qroll_load<TS, TZ, QMODE, NMAT, ZEROS, RI>(wv, sc, zz, u, P, warp, nseg, n_off, n_tile, nv, ng, gshift, rbytes,
                                               lane);
  for (int it = warp; (it / nseg) * RPM < n_tile; it += NWARPS) {
    const int g = it / nseg, seg = it - g * nseg;
    float acc[RI];
#pragma unroll
    for (int i = 0; i < RI; i++) acc[i] = 0.f;
#pragma unroll
    for (int u = 0; u < GU; u++) {
      qdot_slot<QMODE, ZEROS, RI, XPAD>(wv, sc, zz, acc, u, xs, seg * 32 * GU + u * 32 + lane, nv, rot, off0);
      qroll_load<TS, TZ, QMODE, NMAT, ZEROS, RI>(wv, sc, zz, u, P, it + NWARPS, nseg, n_off, n_tile, nv, ng, gshift,
                                                 rbytes, lane);
    }
    qitem_store<NMAT, RI>(acc, part, g, seg, nseg, n_tile, lane);
    if (it == warp) AMK_MARK(2);
  }
}

// op_gemv_qdirect: y_m[n_off + r] = x . dequant(W_m)[n_off + r] for NMAT matrices sharing x,
// dequant(W)[r, k] = (q - zero[r, k / group]) scale[r, k / group] (the last group repeats).
// The tile is a list of items: RI rows (RI / NMAT consecutive rows of each matrix) x one K
// segment of 32 lanes x GU vectors; warp w takes items w, w + NWARPS, ... (RI and ROLL:
// gemv_quant.plan_items, the fewest rows at the fewest rounds of items a warp; ROLL: the rolling
// buffer, qroll_items). Each item's sums land in part[] as op_gemv_direct's, and EPI, NORM and
// the x staging are op_gemv_direct's (direct_x, direct_epilogue). A vector lies in one group
// (k's group: k >> GSHIFT, clamped to the last).
// P: x, W_1..W_NMAT, scales_1..NMAT, [zeros_1..NMAT], [bias (BIAS_AT)], [residual | NORM's
// weight], then the outputs (op_gemv_mma's order). AMK_MARK: op_gemv_direct's points.
template <class TX, class TY, class TS, class TZ, int QMODE, int NMAT, int EPI, bool BIAS, bool ZEROS, int RI,
          bool ROLL, class TR = float, class TO = TY, bool NORM = false, class NX = float, class NW = float,
          int RN = RMS_RN, bool XPAD = false>
__device__ __noinline__ void op_gemv_qdirect(AMK_PARAMS) {
  constexpr int VW = QVec<QMODE>::VW, GU = QVec<QMODE>::GU, RPM = RI / NMAT;
  static_assert(RI % NMAT == 0 && RI * GU <= (ZEROS || ROLL ? 8 : 16),
                "RI rows of NMAT matrices, 16 loads a lane at most (8 with zeros or ROLL)");
  const int Kd = d.ip[P_GEMV_K], n_off = d.ip[P_GEMV_N_OFF], n_tile = d.ip[P_GEMV_N_TILE];
  const int gshift = d.ip[P_GEMV_GSHIFT], ng = d.ip[P_GEMV_NGROUPS];
  const long long rbytes = d.ip[P_GEMV_LDW];
  const int nv = Kd / VW, nseg = (nv + 32 * GU - 1) / (32 * GU);
  float* xs = (float*)smem;
  // NMAT * n_tile * nseg sums after x (XPAD: padded, gemv_quant.x_floats; encoders.py checks the fit)
  float* part = xs + (XPAD ? ((Kd + 31) >> 5) * 36 : (Kd + 3) & ~3);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rot = XPAD ? 0 : QMODE == 2 ? lane & 3 : (lane >> 1) & 3;
  const float off0 = QMODE == 1 ? 8388736.0f : (QMODE == 2 ? 8388616.0f : 0.f);
  const float rv = direct_residual<TR, EPI>(d, P, n_off, n_tile);
  AMK_MARK(0);
  direct_x<TX, NORM, NX, NW, RN, XPAD>(d, P, xs, Kd);
  __syncthreads();
  AMK_MARK(1);
  if constexpr (ROLL) {
    qroll_items<TS, TZ, QMODE, NMAT, ZEROS, RI, XPAD>(P, xs, part, nseg, n_off, n_tile, nv, ng, gshift, rbytes, rot, off0,
                                                warp, lane);
  } else {
    for (int it = warp;; it += NWARPS) {           // items (g, seg) while g has rows: no item count live
      const int g = it / nseg, seg = it - g * nseg;
      if (g * RPM >= n_tile) break;
      uint4 wv[RI][GU];
      float sc[RI][GU], zz[RI][GU];
#pragma unroll
      for (int i = 0; i < RI; i++) {              // every load issued before any use
        const int mat = i / RPM, r = g * RPM + i % RPM;
        const long long row = n_off + r;
        const char* W = (const char*)P[1 + mat] + row * rbytes;
        const TS* sp = (const TS*)P[1 + NMAT + mat] + row * ng;
        const TZ* zp = (const TZ*)P[ZEROS ? 1 + 2 * NMAT + mat : 1] + row * ng;
#pragma unroll
        for (int u = 0; u < GU; u++) {
          const int v = seg * 32 * GU + u * 32 + lane;
          const bool on = r < n_tile && v < nv;
          const int gi = min((v * VW) >> gshift, ng - 1);
          wv[i][u] = on ? ldg_stream(W + (long long)v * 16) : make_uint4(0u, 0u, 0u, 0u);
          sc[i][u] = on ? to_f(sp[gi]) : 0.f;
          zz[i][u] = ZEROS && on ? to_f(zp[gi]) : 0.f;
        }
      }
      float acc[RI];
#pragma unroll
      for (int i = 0; i < RI; i++) acc[i] = 0.f;
#pragma unroll
      for (int u = 0; u < GU; u++)
        qdot_slot<QMODE, ZEROS, RI, XPAD>(wv, sc, zz, acc, u, xs, seg * 32 * GU + u * 32 + lane, nv, rot, off0);
      qitem_store<NMAT, RI>(acc, part, g, seg, nseg, n_tile, lane);
      if (it == warp) AMK_MARK(2);
    }
  }
  __syncthreads();
  AMK_MARK(3);
  direct_epilogue<TY, TS, NMAT, EPI, BIAS, TR, TO>(d, P, part, (const TS*)P[d.ip[P_GEMV_BIAS_AT]], n_off, n_tile,
                                                   nseg, rv);
  AMK_MARK(4);
}
