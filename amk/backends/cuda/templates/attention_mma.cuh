// Decode attention on tensor cores: op_attention_smem's semantics (window, live shards, NEW_KV,
// Q_ROPE / K_ROPE, QKN, CAP, partial or final output) for bf16 q, K and V of head dim 64 or
// 128 (encoders.py picks it). The staged attention's scores, softmax and P.V run on CUDA cores
// one phase after another, and at batch 16 its chunks' loads and its compute each took ~5 us of
// a 21.5 us task without overlapping (NOTES v25). Here:
// - the window streams through NBUF chunk buffers by cp.async (chunk c + NBUF - 1 in flight
//   while chunk c is computed), K and V rows padded by 16 bytes (conflict-free ldmatrix);
// - a group of DS = HD / 64 warps takes the chunk's 16-position blocks in turn with the other
//   groups; each of its warps computes the block's S and its own 64 dims of O. S = Q K^T by
//   mma.sync m16n8k16 (the pass's <= 16 q heads are the A rows, zero past nhs; K rows by
//   ldmatrix are the B columns), the online softmax on S in registers (a row's max and sum over
//   the quad that holds it, base 2), O += P V with P as the A operand straight from S's
//   accumulators (the FlashAttention-2 layout) and V by ldmatrix.trans;
// - P goes in as two bf16 parts, hi = bf16(p) and lo = bf16(p - hi) (two mmas; p to ~2^-16,
//   near the fp32 P of the other attentions; q, K and V are bf16 already, their products exact);
// - each group's (m, l, O) rows go to shared memory after the window and are merged as split-KV
//   partials are (op_combine's formula), then written as attn_write does.

// Four 8x8 bf16 tiles from shared memory (a: a shared-window address, lane l names row l % 8 of
// tile l / 8), plain or transposed.
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], unsigned a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}
__device__ __forceinline__ void ldsm_x4_t(unsigned (&r)[4], unsigned a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}

// The shared-memory layout (bytes from smem): qs [HG][HD] f32 (attn_stage_q), nrow [2][HD] f32,
// qb [16][QBS] bf16 (q as the mma's A rows), then NBUF chunk buffers of CR rows, each K
// [CR][KRS] then V [CR][VRS]; after the window the warp groups' partials (red [WG][HG][HD] f32,
// ml [WG][HG][2]) alias the chunk buffers. CR: rows a chunk, a multiple of 16, as many as
// fit below the area op_attention_smem uses (below the next task's preload).
template <int HG, int HD>
struct MmaAttnLayout {
  static constexpr int NBUF = 3;
  static constexpr int DW = HD < 64 ? HD : 64, DS = HD / DW, WG = NWARPS / DS;   // dims a warp, warps a group
  static constexpr int QBS = (HD + 8) * 2;
  static constexpr int KRS = HD * 2 + 16, VRS = HD * 2 + 16;
  static constexpr int AREA = AMK_PRE && AMK_PRE_OFF < AMK_STAGE_OFF + AMK_STAGE_BYTES ? AMK_PRE_OFF
                                                                                   : AMK_STAGE_OFF + AMK_STAGE_BYTES;
  static constexpr int QB = (HG + 2) * HD * 4;
  static constexpr int CB = (QB + 16 * QBS + 127) & ~127;
  static constexpr int CR = ((AREA - CB) / (NBUF * (KRS + VRS))) & ~15;
  static constexpr int BUF = CR * (KRS + VRS);
  static_assert(CR >= 16, "an attention chunk of at least 16 rows");
  static_assert(WG * HG * (HD + 2) * 4 <= NBUF * BUF, "the warp groups' partials fit the chunk buffers");
};

// Rows [0, cn) of a chunk's K and V (row r at base + r * stride elements) into its buffer by
// 16-byte cp.async, V's rows past cn up to the block's 16 zeroed (0 * stale bits could be NaN;
// K's stale rows are masked out of the scores), as one commit group.
template <int HD, int KRS, int VRS>
__device__ __forceinline__ void mma_attn_stage(char* kd, char* vd, const bf16* kb, const bf16* vb,
                                               long long stride, int cn) {
  constexpr int NV = HD * 2 / 16, RS = NT / NV;       // a thread's 16-byte column; rows a round
  static_assert(NT % NV == 0, "whole rows a round");
  const int v = threadIdx.x % NV, rows = (cn + 15) & ~15;
  int r = threadIdx.x / NV;
  const char* ks = (const char*)(kb + r * stride) + v * 16;
  const char* vs = (const char*)(vb + r * stride) + v * 16;
  const long long step = RS * stride * 2;
#pragma unroll 1
  for (; r < rows; r += RS, ks += step, vs += step) {
    if (r < cn) {
      cp_async16(kd + r * KRS + v * 16, ks);
      cp_async16(vd + r * VRS + v * 16, vs);
    } else {
      cp_async16_zero(vd + r * VRS + v * 16, vb);
    }
  }
  cp_async_commit();
}

// 2^x by the SFU (ex2.approx: ~2 ulp, -inf -> 0): the softmax works in base 2, scores times
// scale * log2(e), so m is in those units too until the merge turns it back (times ln 2).
__device__ __forceinline__ float ex2(float x) {
  float r; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x)); return r;
}

// One mma whose A rows 8..15 are zero when MR == 1 (a pass of <= 8 q heads): only c[0], c[1]
// (row g) are kept, so the accumulators of the rows that do not exist take no registers.
template <int MR>
__device__ __forceinline__ void mma_rows(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
  float t[4] = {c[0], c[1], MR == 2 ? c[2] : 0.f, MR == 2 ? c[3] : 0.f};
  mma_bf16(t, a0, MR == 2 ? a1 : 0u, a2, MR == 2 ? a3 : 0u, b0, b1);
  c[0] = t[0]; c[1] = t[1];
  if (MR == 2) { c[2] = t[2]; c[3] = t[3]; }
}

// One warp's 16 positions [r0, r0 + 16) of a chunk of cn rows: scores, the online softmax
// update of its rows (m, l: the thread's rows g and, when MR == 2, g + 8; l the thread's own
// share, summed over the quad at the end), O += P V into acc for DW dims of V from vb's.
template <int HD, int DW, int KRS, int VRS, int QBS, int MR, bool CAP>
__device__ __forceinline__ void mma_attn_block(unsigned qb, unsigned kb, unsigned vb, int r0, int cn,
                                               float scale, float cap, float (&m)[MR], float (&l)[MR],
                                               float (&acc)[DW / 8][2 * MR]) {
  const int lane = threadIdx.x & 31, t = lane & 3;
  float s[2][2 * MR];
#pragma unroll
  for (int nt = 0; nt < 2; nt++)
#pragma unroll
    for (int e = 0; e < 2 * MR; e++) s[nt][e] = 0.f;
  const unsigned qrow = qb + (lane & 15) * QBS + (lane >> 4) * 16;
  const unsigned krow = kb + (r0 + (lane & 7) + ((lane >> 4) << 3)) * KRS + ((lane >> 3) & 1) * 16;
#pragma unroll 4
  for (int k0 = 0; k0 < HD; k0 += 16) {
    unsigned a[4], b[4];
    ldsm_x4(a, qrow + k0 * 2);
    ldsm_x4(b, krow + k0 * 2);
    mma_rows<MR>(s[0], a[0], a[1], a[2], a[3], b[0], b[1]);
    mma_rows<MR>(s[1], a[0], a[1], a[2], a[3], b[2], b[3]);
  }
  // s[nt][e]: row g (e < 2) or g + 8, position r0 + 8 nt + 2 t + (e & 1)
  float mx[MR];
#pragma unroll
  for (int h = 0; h < MR; h++) mx[h] = -__int_as_float(0x7f800000);
#pragma unroll
  for (int nt = 0; nt < 2; nt++)
#pragma unroll
    for (int e = 0; e < 2 * MR; e++) {
      float v = s[nt][e] * scale;                // scale: the descriptor's times log2(e) unless CAP
      if (CAP) v = tanhf(v / cap) * cap * 1.44269504f;
      v = r0 + 8 * nt + 2 * t + (e & 1) < cn ? v : -__int_as_float(0x7f800000);
      s[nt][e] = v;
      mx[e >> 1] = fmaxf(mx[e >> 1], v);
    }
  float alpha[MR];
#pragma unroll
  for (int h = 0; h < MR; h++) {
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
    const float mn = fmaxf(m[h], mx[h]);       // finite: position r0 < cn is in every row
    alpha[h] = ex2(m[h] - mn);
    m[h] = mn;
    l[h] *= alpha[h];
  }
  unsigned hi[4] = {0u, 0u, 0u, 0u}, lo[4] = {0u, 0u, 0u, 0u};   // P as the A operand: k = the 16 positions
#pragma unroll
  for (int nt = 0; nt < 2; nt++)
#pragma unroll
    for (int h = 0; h < MR; h++) {
      const float p0 = ex2(s[nt][2 * h] - m[h]), p1 = ex2(s[nt][2 * h + 1] - m[h]);
      l[h] += p0 + p1;
      const unsigned ph = pack_bf16x2(p0, p1);
      hi[2 * nt + h] = ph;
      lo[2 * nt + h] = pack_bf16x2(p0 - __uint_as_float(ph << 16), p1 - __uint_as_float(ph & 0xffff0000u));
    }
#pragma unroll
  for (int j = 0; j < DW / 8; j++)
#pragma unroll
    for (int e = 0; e < 2 * MR; e++) acc[j][e] *= alpha[e >> 1];
  const unsigned vrow = vb + (r0 + (lane & 15)) * VRS + (lane >> 4) * 16;
#pragma unroll
  for (int d0 = 0; d0 < DW; d0 += 16) {
    unsigned b[4];
    ldsm_x4_t(b, vrow + d0 * 2);
    mma_rows<MR>(acc[d0 / 8], hi[0], hi[1], hi[2], hi[3], b[0], b[1]);
    mma_rows<MR>(acc[d0 / 8], lo[0], lo[1], lo[2], lo[3], b[0], b[1]);
    mma_rows<MR>(acc[d0 / 8 + 1], hi[0], hi[1], hi[2], hi[3], b[2], b[3]);
    mma_rows<MR>(acc[d0 / 8 + 1], lo[0], lo[1], lo[2], lo[3], b[2], b[3]);
  }
}

// AMK_MARK (profile builds; a pass's last): 0 entered, 1 first chunks issued, 2 q staged,
// 3 first chunk landed, 6 window done, 7 written.
template <class TQ, class TK, class TV, class TO, class TN, class TF, int HG, int HDC, bool CAP, bool QKN = false>
__device__ __noinline__ void op_attention_mma(AMK_PARAMS) {
  using L = MmaAttnLayout<HG, HDC>;
  constexpr int HD = HDC, NBUF = L::NBUF, CR = L::CR, KRS = L::KRS, VRS = L::VRS, QBS = L::QBS;
  constexpr int DW = L::DW, DS = L::DS, WG = L::WG;
  static_assert(HG <= 16 && HD % 16 == 0, "up to 16 q heads a pass (the A tile's rows), head dim a multiple of 16");
  const int nh = d.ip[P_ATTN_NH], nkv = d.ip[P_ATTN_NKV];
  const int h0 = d.ip[P_ATTN_H_OFF], hc = d.ip[P_ATTN_H_COUNT];
  const int b0 = d.ip[P_ATTN_B_OFF], b1 = b0 + d.ip[P_ATTN_B_COUNT];
  const long long max_seq = d.ip[P_ATTN_MAX_SEQ];
  const bool partial = (d.ip[P_ATTN_FLAGS] & 2) != 0;
  const float cap = d.fp[F_ATTN_SOFTCAP], scale = d.fp[F_ATTN_SCALE] * (CAP ? 1.f : 1.44269504f);
  const int rep = nh / nkv;
  long long lo, hi, pos;                // sequence b0's window first: its pos load overlaps the setup
  bool live = attn_window(d, P, b0, lo, hi, pos);
  if (!live && b1 - b0 == 1) return;                         // not a live shard this step
  const TQ* q = (const TQ*)P[0];
  const bf16* kc = (const bf16*)P[1]; const bf16* vc = (const bf16*)P[2];
  TO* out = (TO*)P[d.n_in];
  float* qs = (float*)smem;                                  // [HG][HD]
  float* nrow = qs + HG * HD;                                // NEW_KV: the new k, v rows [2][HD]
  char* qb = smem + (HG + 2) * HD * 4;                       // [16][QBS] bf16
  char* cb = smem + L::CB;                                   // NBUF x (K [CR][KRS], V [CR][VRS])
  float* red = (float*)cb;                                   // after the window: [WG][HG][HD]
  float* ml = red + WG * HG * HD;                            // [WG][HG][2]
  const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int wg = (tid >> 5) / DS, dh = (tid >> 5) % DS;    // the warp's group and its dims' part
  const long long rstride = (long long)nkv * HD;
  constexpr int MR = HG > 8 ? 2 : 1;                        // the A tile's row halves in use

  for (int b = b0; b < b1; b++) {
    if (b > b0) live = attn_window(d, P, b, lo, hi, pos);
    if (!live) continue;                                     // not a live shard of b this step
    const int n = (int)(hi - lo), nck = (n + CR - 1) / CR;
    for (int gi = h0 / rep; gi < (h0 + hc) / rep; gi++)
      for (int hs0 = 0; hs0 < rep; hs0 += HG) {
        const int nhs = rep - hs0 < HG ? rep - hs0 : HG;      // == HG unless HG does not divide rep
        const int hbase = gi * rep + hs0;
        const bf16* kbase = kc + (b * max_seq * nkv + gi) * HD + lo * rstride;
        const bf16* vbase = vc + (b * max_seq * nkv + gi) * HD + lo * rstride;
        __syncthreads();                                     // the previous users of smem
        AMK_MARK(0);
#pragma unroll
        for (int c = 0; c < NBUF - 1; c++) {                 // before q: the first chunks in flight
          if (c < nck) {
            const int cn = n - c * CR < CR ? n - c * CR : CR;
            mma_attn_stage<HD, KRS, VRS>(cb + c * L::BUF, cb + c * L::BUF + CR * KRS, kbase + c * CR * rstride,
                                         vbase + c * CR * rstride, rstride, cn);
          } else {
            cp_async_commit();                               // one group a chunk, empty or not
          }
        }
        AMK_MARK(1);
        const int new_r = d.ip[P_ATTN_NEW_KV] && n > 0 && hi == pos + 1 ? n - 1 : -1;   // its row - lo
        const long long nro = ((long long)b * nkv + gi) * HD;
        attn_stage_q<TQ, TK, TV, TN, TF, QKN>(d, P, qs, q + ((long long)b * nh + hbase) * HD, nhs * HD, HD, (float)pos,
                                              new_r >= 0 ? (const TN*)P[4] + nro : nullptr,
                                              new_r >= 0 ? (const TN*)P[5] + nro : nullptr, nrow);
        if (threadIdx.x == 0) preload_next(smem);            // the next task's rows, behind ours
        __syncthreads();
        for (int i = tid; i < 16 * HD / 2; i += NT) {        // q as bf16 pairs (exact: q is bf16), zero rows past nhs
          const int r = i / (HD / 2), e = 2 * (i - r * (HD / 2));
          *(unsigned*)(qb + r * QBS + e * 2) = r < nhs ? pack_bf16x2(qs[r * HD + e], qs[r * HD + e + 1]) : 0u;
        }
        AMK_MARK(2);
        float m[MR], l[MR], acc[DW / 8][2 * MR];
#pragma unroll
        for (int h = 0; h < MR; h++) { m[h] = -__int_as_float(0x7f800000); l[h] = 0.f; }
#pragma unroll
        for (int j = 0; j < DW / 8; j++)
#pragma unroll
          for (int e = 0; e < 2 * MR; e++) acc[j][e] = 0.f;
        for (int c = 0; c < nck; c++) {
          const int cn = n - c * CR < CR ? n - c * CR : CR;
          const int cf = c + NBUF - 1;                       // into the buffer chunk c - 1 left
          if (cf < nck) {
            const int fn = n - cf * CR < CR ? n - cf * CR : CR;
            char* fb = cb + (cf % NBUF) * L::BUF;
            mma_attn_stage<HD, KRS, VRS>(fb, fb + CR * KRS, kbase + cf * CR * rstride, vbase + cf * CR * rstride,
                                         rstride, fn);
          } else {
            cp_async_commit();
          }
          cp_async_wait<NBUF - 1>();                         // chunk c has landed (this thread's copies)
          __syncthreads();                                   // everyone's
          if (c == 0) AMK_MARK(3);
          char* kb = cb + (c % NBUF) * L::BUF;
          char* vb = kb + CR * KRS;
          const int nr = new_r - c * CR;                     // NEW_KV's row in this chunk, if any
          if (nr >= 0 && nr < cn) {
            if (tid < HD) {
              ((bf16*)(kb + nr * KRS))[tid] = from_f<bf16>(nrow[tid]);
              ((bf16*)(vb + nr * VRS))[tid] = from_f<bf16>(nrow[HD + tid]);
            }
            __syncthreads();
          }
          for (int r0 = 16 * wg; r0 < cn; r0 += 16 * WG)
            mma_attn_block<HD, DW, KRS, VRS, QBS, MR, CAP>(smem_u32(qb), smem_u32(kb), smem_u32(vb) + dh * DW * 2, r0, cn,
                                                           scale, cap, m, l, acc);
          __syncthreads();                                   // the buffer is free for chunk c + NBUF
        }
        cp_async_wait<0>();                                  // red aliases the buffers
        AMK_MARK(6);
#pragma unroll
        for (int h = 0; h < MR; h++) {
          l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
          l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
        }
#pragma unroll
        for (int h = 0; h < MR; h++) {
          const int r = g + 8 * h;
          if (r < nhs) {
            float* dst = red + (wg * HG + r) * HD + dh * DW + 2 * t;
#pragma unroll
            for (int j = 0; j < DW / 8; j++) *(float2*)(dst + 8 * j) = make_float2(acc[j][2 * h], acc[j][2 * h + 1]);
            if (t == 0 && dh == 0) { ml[(wg * HG + r) * 2] = m[h] * 0.693147181f; ml[(wg * HG + r) * 2 + 1] = l[h]; }
          }
        }
        __syncthreads();
        for (int i = tid; i < nhs * HD; i += NT) {            // the warps' rows merged (op_combine's formula)
          const int j = i / HD, e = i - j * HD;
          float M = -__int_as_float(0x7f800000);
#pragma unroll 4
          for (int k = 0; k < WG; k++) M = fmaxf(M, ml[(k * HG + j) * 2]);
          float A = 0.f, Ls = 0.f;
          if (M != -__int_as_float(0x7f800000)) {
#pragma unroll 4
            for (int k = 0; k < WG; k++) {
              const float mk = ml[(k * HG + j) * 2];
              if (mk == -__int_as_float(0x7f800000)) continue;   // a group with no block
              const float f = expf(mk - M);
              A += red[(k * HG + j) * HD + e] * f;
              Ls += ml[(k * HG + j) * 2 + 1] * f;
            }
          }
          const long long row = (long long)b * nh + hbase + j;
          if (partial) {
            const long long base = row * (HD + 2);
            out[base + e] = from_f<TO>(n > 0 ? A : 0.f);
            if (e == 0) {
              out[base + HD] = from_f<TO>(n > 0 ? M : -__int_as_float(0x7f800000));
              out[base + HD + 1] = from_f<TO>(n > 0 ? Ls : 0.f);
            }
          } else {
            out[row * HD + e] = from_f<TO>(n > 0 ? A / Ls : 0.f);
          }
        }
        AMK_MARK(7);
      }
  }
}
