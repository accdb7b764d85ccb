// GEMV / GEMM tile: y[:, n_off:n_off+n_tile] = x[M, K] @ W[n_off:n_off+n_tile, :K].T (+ bias),
// float weights or weight-only int8 / packed int4 / fp8 E4M3 with group scales (+ zeros), seed
// layout; a quantized GEMV's bias is its last input (encoders.py: BIAS_AT).
// x is staged once in shared memory as fp32 (unless XS_READY: a fused norm wrote it there);
// each warp streams RPW weight rows with 16-byte loads, U vectors per row in flight per lane.

// QMODE: 0 float weights, 1 int8, 2 packed int4, 3 fp8 E4M3 (one byte a weight, like int8).
template <int QMODE, class TW> struct GemvVec { static constexpr int N = QMODE == 0 ? VecN<TW>::N : (QMODE == 2 ? 32 : 16); };

// One 16-byte weight vector -> VW raw values (before scale / zero).
template <int QMODE, class TW>
__device__ __forceinline__ void gemv_unpack(uint4 v, float* o) {
  if (QMODE == 0) { unpack(v, o, (TW*)0); return; }
  unsigned w[4] = {v.x, v.y, v.z, v.w};
  if (QMODE == 1) {
#pragma unroll
    for (int i = 0; i < 16; i++) o[i] = (float)(signed char)((w[i >> 2] >> (8 * (i & 3))) & 0xffu);
  } else if (QMODE == 3) {
#pragma unroll
    for (int i = 0; i < 16; i++) o[i] = fp8e4m3_to_f((w[i >> 2] >> (8 * (i & 3))) & 0xffu);
  } else {
#pragma unroll
    for (int i = 0; i < 32; i++) o[i] = (float)((w[i >> 3] >> (4 * (i & 7))) & 15u) - 8.0f;
  }
}

template <int QMODE, class TW>
__device__ __forceinline__ float gemv_scalar(const TW* W, long long row, long long ldw, int k) {
  if (QMODE == 0) return to_f(W[row * ldw + k]);
  if (QMODE == 1) return (float)((const signed char*)W)[row * ldw + k];
  if (QMODE == 3) return fp8e4m3_to_f(((const unsigned char*)W)[row * ldw + k]);
  unsigned byte = ((const unsigned char*)W)[row * ldw + (k >> 1)];
  return (float)(((k & 1) ? byte >> 4 : byte) & 15u) - 8.0f;
}

// ADD (M == 1, folds.fold_add): the FUSED step after the GEMV added a residual (the task's last
// input) to its tile; the sum, rounded to TY first as that step did, gets it added here and goes
// out as TO to the task's output: no scratch round trip, no barrier, no extra step.
// a + w . x for one 16-byte weight vector of float type TW and its VecN<TW>::N x values (fp32,
// 16-byte aligned in shared memory): the smem-staged GEMVs' inner step, one summation order.
template <class TW>
__device__ __forceinline__ float dot_vec(float a, uint4 w, const float* x) {
  constexpr int VW = VecN<TW>::N;
  float wf[VW];
  unpack(w, wf, (TW*)0);
  const float4* xv = (const float4*)x;
#pragma unroll
  for (int e = 0; e < VW / 4; e++) {
    const float4 xx = xv[e];
    a += wf[4 * e] * xx.x + wf[4 * e + 1] * xx.y + wf[4 * e + 2] * xx.z + wf[4 * e + 3] * xx.w;
  }
  return a;
}

template <class TX, class TW, class TY, class TS, class TZ, int QMODE, bool BIAS, bool ZEROS, bool VEC, int MB, bool WRO,
          bool ADD = false, class TR = float, class TO = TY>
__device__ __noinline__ void op_gemv(AMK_PARAMS) {
  constexpr int RPW = 2;
  constexpr int VW = GemvVec<QMODE, TW>::N;
  constexpr int U = QMODE == 0 ? 8 : 2;     // float: 8 x 16 B per row per lane in flight
  const int M = d.ip[P_GEMV_M], Kd = d.ip[P_GEMV_K], N = d.ip[P_GEMV_N];
  const int n_off = d.ip[P_GEMV_N_OFF], n_tile = d.ip[P_GEMV_N_TILE];
  const long long ldw = d.ip[P_GEMV_LDW];
  const int group = d.ip[P_GEMV_GROUP], ng = d.ip[P_GEMV_NGROUPS];
  const TX* x = (const TX*)P[0];
  const TW* W = (const TW*)P[1];
  const TS* aux = (const TS*)P[d.n_in > 2 ? 2 : 1];       // bias (float) or scales (quantized)
  const TS* bias = (const TS*)P[d.ip[P_GEMV_BIAS_AT]];     // the bias input (BIAS)
  const TZ* zr = (const TZ*)P[d.n_in > 3 ? 3 : 1];
  TY* y = (TY*)P[d.n_in];
  const TR* res = (const TR*)P[d.n_in - 1];
  float* xs = (float*)smem;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const long long wrow_bytes = QMODE == 0 ? ldw * (long long)sizeof(TW) : ldw;
  const bool vec_scale = QMODE != 0 && (group % VW) == 0;

  for (int m0 = 0; m0 < M; m0 += MB) {
    const int mc = M - m0 < MB ? M - m0 : MB;
    __syncthreads();
    if (!d.ip[P_GEMV_XS_READY])     // else a fused norm already left x here (M == 1)
      stage_f32(xs, x + (long long)m0 * Kd, mc * Kd);
    __syncthreads();
    for (int rb = warp * RPW; rb < n_tile; rb += NWARPS * RPW) {
      float acc[RPW][MB];
#pragma unroll
      for (int r = 0; r < RPW; r++)
#pragma unroll
        for (int m = 0; m < MB; m++) acc[r][m] = 0.f;
      if (VEC) {
        const int nv = Kd / VW;
        for (int v0 = lane; v0 < nv; v0 += 32 * U) {
          uint4 wv[RPW][U];
#pragma unroll
          for (int r = 0; r < RPW; r++)
#pragma unroll
            for (int u = 0; u < U; u++) {
              const int v = v0 + u * 32;
              const long long row = n_off + rb + r;
              wv[r][u] = (v < nv && rb + r < n_tile)
                  ? (WRO ? ldg_stream((const char*)W + row * wrow_bytes + (long long)v * 16) : ld16((const char*)W + row * wrow_bytes + (long long)v * 16)) : make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
          for (int r = 0; r < RPW; r++)
#pragma unroll
            for (int u = 0; u < U; u++) {
              const int v = v0 + u * 32;
              if (v < nv && rb + r < n_tile) {
                const long long row = n_off + rb + r;
                float wf[VW];
                gemv_unpack<QMODE, TW>(wv[r][u], wf);
                const int k0 = v * VW;
                if (QMODE != 0) {
                  if (vec_scale) {
                    int g = k0 / group; if (g > ng - 1) g = ng - 1;
                    const float s = to_f(aux[row * ng + g]);
                    const float z = ZEROS ? to_f(zr[row * ng + g]) : 0.f;
#pragma unroll
                    for (int e = 0; e < VW; e++) wf[e] = (ZEROS ? wf[e] - z : wf[e]) * s;
                  } else {
#pragma unroll
                    for (int e = 0; e < VW; e++) {
                      int g = (k0 + e) / group; if (g > ng - 1) g = ng - 1;
                      const float z = ZEROS ? to_f(zr[row * ng + g]) : 0.f;
                      wf[e] = (ZEROS ? wf[e] - z : wf[e]) * to_f(aux[row * ng + g]);
                    }
                  }
                }
#pragma unroll
                for (int m = 0; m < MB; m++) {
                  if (m < mc) {
                    const float4* xv = (const float4*)(xs + m * Kd + k0);
                    float a = acc[r][m];
#pragma unroll
                    for (int e = 0; e < VW / 4; e++) {
                      const float4 xx = xv[e];
                      a += wf[4 * e] * xx.x + wf[4 * e + 1] * xx.y + wf[4 * e + 2] * xx.z + wf[4 * e + 3] * xx.w;
                    }
                    acc[r][m] = a;
                  }
                }
              }
            }
        }
      } else {
        for (int k = lane; k < Kd; k += 32) {
#pragma unroll
          for (int r = 0; r < RPW; r++) {
            if (rb + r < n_tile) {
              const long long row = n_off + rb + r;
              float wv = gemv_scalar<QMODE, TW>(W, row, ldw, k);
              if (QMODE != 0) {
                int g = k / group; if (g > ng - 1) g = ng - 1;
                if (ZEROS) wv -= to_f(zr[row * ng + g]);
                wv *= to_f(aux[row * ng + g]);
              }
#pragma unroll
              for (int m = 0; m < MB; m++) if (m < mc) acc[r][m] += wv * xs[m * Kd + k];
            }
          }
        }
      }
#pragma unroll
      for (int r = 0; r < RPW; r++)
#pragma unroll
        for (int m = 0; m < MB; m++) {
          float s = warp_sum(acc[r][m]);
          if (lane == 0 && rb + r < n_tile && m < mc) {
            const long long col = n_off + rb + r;
            if (BIAS) s += to_f(bias[col]);
            if (ADD) ((TO*)P[d.n_in])[col] = from_f<TO>(to_f(from_f<TY>(s)) + to_f(res[col]));
            else y[(long long)(m0 + m) * N + col] = from_f<TY>(s);
          }
        }
    }
  }
}

// op_gemv_direct's item `it`: SR row groups' (two rows each) K segment, GU vectors a lane, GU / SR
// a row (zeros past the tile's rows or K). SR > 1 only for rows of at most 32 GU / SR vectors,
// one segment: a warp keeps GU x 2 x 16 bytes a lane in flight whatever the row length.
template <int NMAT, int SR>
__device__ __forceinline__ void direct_rows(const char* (&row)[SR][2], bool (&live)[SR][2], const char* base0,
                                            const char* base1, int pr, int n_tile, long long rbytes, int nseg, int it) {
#pragma unroll
  for (int s = 0; s < SR; s++) {
    const int g = SR == 1 ? it / nseg : it * SR + s;
#pragma unroll
    for (int j = 0; j < 2; j++) {
      const int r = NMAT == 2 ? g : 2 * g + j;
      live[s][j] = r < n_tile;
      row[s][j] = (NMAT == 2 && j ? base1 : base0) + ((NMAT == 2 ? j * pr : 0) + (long long)r) * rbytes;
    }
  }
}

// The item's vectors from its rows (direct_rows): global memory (SMEM false) or the preloaded
// rows in shared memory (SMEM).
template <int GU, int SR, bool SMEM>
__device__ __forceinline__ void direct_fill(uint4 (&wv)[2][GU], const char* const (&row)[SR][2],
                                            const bool (&live)[SR][2], int nv, int seg) {
  constexpr int GS = GU / SR;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int s = 0; s < SR; s++)
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
      for (int u = 0; u < GS; u++) {
        const int v = seg * 32 * GU + u * 32 + lane;
        if (SMEM)
          wv[j][s * GS + u] = (live[s][j] && v < nv) ? *(const uint4*)(row[s][j] + v * 16) : make_uint4(0u, 0u, 0u, 0u);
        else
          wv[j][s * GS + u] = (live[s][j] && v < nv) ? ldg_stream(row[s][j] + (long long)v * 16) : make_uint4(0u, 0u, 0u, 0u);
      }
}

template <int NMAT, int GU, int SR = 1>
__device__ __forceinline__ void direct_load(uint4 (&wv)[2][GU], void* const* P, int n_off, int n_tile,
                                            long long rbytes, int nv, int nseg, int it) {
  const char* row[SR][2]; bool live[SR][2];
  direct_rows<NMAT, SR>(row, live, (const char*)P[1] + (long long)n_off * rbytes,
                            (const char*)P[NMAT == 2 ? 2 : 1] + (long long)n_off * rbytes, 0, n_tile, rbytes, nseg, it);
  direct_fill<GU, SR, false>(wv, row, live, nv, SR == 1 ? it % nseg : 0);
}

// The same item from the preloaded rows (PRE a matrix, AMK_PRE_OFF: preload.py), laid out
// as in global memory, matrix after matrix.
template <int NMAT, int GU, int SR = 1>
__device__ __forceinline__ void direct_load_pre(uint4 (&wv)[2][GU], const char* pre, int pr, int n_tile,
                                                long long rbytes, int nv, int nseg, int it) {
  const char* row[SR][2]; bool live[SR][2];
  direct_rows<NMAT, SR>(row, live, pre, pre, pr, n_tile, rbytes, nseg, it);
  direct_fill<GU, SR, true>(wv, row, live, nv, SR == 1 ? it % nseg : 0);
}

// op_gemv_direct's item `it` against x: each of its rows' sum into part[row slot, segment]
// (every row's lanes add its vectors in the same order whatever SR: the same bits).
template <class TW, int NMAT, int GU, int SR = 1>
__device__ __forceinline__ void direct_dot(const uint4 (&wv)[2][GU], const float* xs, float* part,
                                           int n_tile, int nv, int nseg, int it) {
  constexpr int VW = VecN<TW>::N, GS = GU / SR;
  const int lane = threadIdx.x & 31, seg = SR == 1 ? it % nseg : 0;
  const int groups = NMAT == 2 ? n_tile : (n_tile + 1) / 2;
#pragma unroll
  for (int s = 0; s < SR; s++) {
    const int g = SR == 1 ? it / nseg : it * SR + s;
    float a0 = 0.f, a1 = 0.f;                   // both rows in one pass: x read once
#pragma unroll
    for (int u = 0; u < GS; u++) {
      const int v = seg * 32 * GU + u * 32 + lane;
      if (v < nv) {
        a0 = dot_vec<TW>(a0, wv[0][s * GS + u], xs + v * VW);
        a1 = dot_vec<TW>(a1, wv[1][s * GS + u], xs + v * VW);
      }
    }
    a0 = warp_sum(a0);
    a1 = warp_sum(a1);
    if (lane == 0 && (SR == 1 || g < groups)) {
      part[(NMAT == 2 ? g : 2 * g) * nseg + seg] = a0;
      if (NMAT == 2 || 2 * g + 1 < n_tile) part[(NMAT == 2 ? n_tile + g : 2 * g + 1) * nseg + seg] = a1;
    }
  }
}

// The batch-1 GEMVs' x (op_gemv_direct, op_gemv_qdirect): the RMSNorm of P[0] with weight
// P[n_in - 1] (NORM), else P[0] as fp32, unless a norm before left it in smem (XS_READY, never
// with PAD: op_gemv_qdirect's XPAD).
template <class TX, bool NORM, class NX, class NW, int RN, bool PAD = false>
__device__ __forceinline__ void direct_x(const TaskDesc& d, void* const* P, float* xs, int Kd) {
  if (NORM) rms_row<NX, NW, TX, RN, PAD>((const NX*)P[0], (const NW*)P[d.n_in - 1], Kd, d.fp[F_GEMV_EPS], xs, (TX*)0);
  else if (!d.ip[P_GEMV_XS_READY]) stage_f32<TX, PAD>(xs, (const TX*)P[0], Kd);
}

// EPI 1: this thread's residual (the last input), loaded with x, not after the sums (0: loaded
// in the epilogue, the tile has more rows than threads).
template <class TR, int EPI>
__device__ __forceinline__ float direct_residual(const TaskDesc& d, void* const* P, int n_off, int n_tile) {
  return EPI == 1 && n_tile <= NT && threadIdx.x < n_tile ? to_f(((const TR*)P[d.n_in - 1])[n_off + threadIdx.x]) : 0.f;
}

// The batch-1 GEMVs' epilogue EPI (op_gemv_direct's comment) over the sums in part[(mat n_tile
// + row) nseg + segment], each row's segments added in order.
template <class TY, class TS, int NMAT, int EPI, bool BIAS, class TR, class TO>
__device__ __forceinline__ void direct_epilogue(const TaskDesc& d, void* const* P, const float* part, const TS* bias,
                                                int n_off, int n_tile, int nseg, float rv) {
  const TR* res = (const TR*)P[d.n_in - 1];
  const bool res_early = EPI == 1 && n_tile <= NT;
  float best = -__int_as_float(0x7f800000); int bi = 0x7fffffff;   // EPI 3
  for (int r = threadIdx.x; r < (EPI == 2 ? n_tile : NMAT * n_tile); r += NT) {
    float s = 0.f;
    // not unrolled: nseg is 1-4, and the unrolled copies were never-run code in a hot function
#pragma unroll 1
    for (int k = 0; k < nseg; k++) s += part[r * nseg + k];
    const int mat = r / n_tile, row = r - mat * n_tile, col = n_off + row;
    if (EPI == 2) {
      float u = 0.f;
#pragma unroll 1
      for (int k = 0; k < nseg; k++) u += part[(n_tile + r) * nseg + k];
      ((TO*)P[d.n_in])[col] = from_f<TO>(ew_apply<EW_SILU_MUL>(to_f(from_f<TY>(s)), to_f(from_f<TY>(u)), 0.f));
    } else {
      if (BIAS) s += to_f(bias[col]);
      if (EPI == 1) ((TO*)P[d.n_in])[col] = from_f<TO>(to_f(from_f<TY>(s)) + (res_early ? rv : to_f(res[col])));
      else ((TY*)P[d.n_in + mat])[col] = from_f<TY>(s);
      if (EPI == 3 && am_better(to_f(from_f<TY>(s)), col, best, bi)) { best = to_f(from_f<TY>(s)); bi = col; }
    }
  }
  if (EPI == 3) {
    block_argmax(best, bi);
    if (threadIdx.x == 0) {
      float* part = (float*)P[d.n_in + 1] + 2 * d.ip[P_GEMV_ARG_SLOT];
      part[0] = best; part[1] = __int_as_float(bi);
    }
  }
}

// The batch-1 GEMV of float weights (the default for M == 1): y_m[n_off + r] = x . W_m[n_off + r]
// for NMAT matrices sharing x (gate and up are one task). The tile is a list of items: two rows
// (NMAT == 2: row r of each matrix; NMAT == 1: rows 2i, 2i+1) x one K segment of 32 lanes x GU
// 16-byte vectors. Warp w takes items w, w + NWARPS, ...: all warps busy even when the tile has
// few long rows (down: 16 rows of 8192). Each item's sums land
// in part[] (after x) and every row adds its segments in a fixed order: steps are bit-identical.
// EPI 0: y_m = s (+ bias). 1 (ADD, folds.fold_add): out = round_TY(s) + residual (last input).
// 2 (SILU, NMAT == 2, folds.pair_gemvs): out = silu(round_TY(s_0)) * round_TY(s_1), the FUSED
// SILU_MUL step that followed the two GEMVs, done on their sums without a scratch round trip.
// 3 (ARGMAX, NMAT == 1, argmax_fold.py): as 0, and the tile's argmax over the values it
// stored goes to slot ARG_SLOT of the second output as (value, index bits).
// ip PRE > 0: the first PRE rows of each matrix were bulk-copied to smem + AMK_PRE_OFF while the
// task before ran (preload.py): items within them read from there once the copy has landed.
// The template's PRE: that path is compiled (only variants some task of which preloads).
// NORM (folds.norm_into_gemv): x is the RMSNorm of row P[0] (type NX) with weight P[n_in - 1]
// (NW), computed here (rms_row, rounded through TX as the norm step it replaces).
// P: x, W_1..W_NMAT, [bias], [residual | NORM's weight], then the outputs.
// AMK_MARK (profile builds): 0 entered, 1 x staged, 5 warp 0's first weights in registers (its
// preload landed) or requested, 2 its first item, 3 all items, 4 stored.
template <class TX, class TW, class TY, class TS, int NMAT, int EPI, bool BIAS, class TR = float, class TO = TY,
          bool NORM = false, class NX = float, class NW = float, bool PRE = false, int RN = RMS_RN,
          int SR = 1>
__device__ __noinline__ void op_gemv_direct(AMK_PARAMS) {
  constexpr int GU = 8;
  const int Kd = d.ip[P_GEMV_K], n_off = d.ip[P_GEMV_N_OFF], n_tile = d.ip[P_GEMV_N_TILE];
  const long long rbytes = (long long)d.ip[P_GEMV_LDW] * (long long)sizeof(TW);
  const int nv = Kd / VecN<TW>::N, nseg = (nv + 32 * GU - 1) / (32 * GU);
  const int groups = NMAT == 2 ? n_tile : (n_tile + 1) / 2, items = SR == 1 ? groups * nseg : (groups + SR - 1) / SR;
  float* xs = (float*)smem;
  float* part = xs + ((Kd + 3) & ~3);           // NMAT * n_tile * nseg sums (encoders.py checks the fit)
  const int warp = threadIdx.x >> 5;
  // ADD: the residual of this thread's output loaded now, with x, not after the sums
  const float rv = direct_residual<TR, EPI>(d, P, n_off, n_tile);
  AMK_MARK(0);
  const int pr = AMK_PRE && PRE ? d.ip[P_GEMV_PRE] : 0;
  direct_x<TX, NORM, NX, NW, RN>(d, P, xs, Kd);
  __syncthreads();
  AMK_MARK(1);
  const int it0 = warp;
  for (int it = it0; it < items; it += NWARPS) {
    uint4 wv[2][GU];
    const int gl = SR == 1 ? it / nseg : min(it * SR + SR - 1, groups - 1);
    const int last = NMAT == 2 ? gl : 2 * gl + 1;                     // the item's last row
    if (AMK_PRE && PRE && (last < pr || pr == n_tile)) {
      mbar_wait(&amk_pre_bar, (amk_pre_n - 1) & 1u);
      direct_load_pre<NMAT, GU, SR>(wv, smem + AMK_PRE_OFF, pr, n_tile, rbytes, nv, nseg, it);
    } else {
      direct_load<NMAT, GU, SR>(wv, P, n_off, n_tile, rbytes, nv, nseg, it);
    }
    if (it == it0) AMK_MARK(5);
    direct_dot<TW, NMAT, GU, SR>(wv, xs, part, n_tile, nv, nseg, it);
    if (it == it0) AMK_MARK(2);
  }
  __syncthreads();
  AMK_MARK(3);
  direct_epilogue<TY, TS, NMAT, EPI, BIAS, TR, TO>(d, P, part, (const TS*)P[1 + NMAT], n_off, n_tile, nseg, rv);
  AMK_MARK(4);
}
