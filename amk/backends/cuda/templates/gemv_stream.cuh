// The streamed tensor-core GEMV: op_gemv_mma's CS plans (gemv_batch.py), bf16 weights and a batch
// of bf16 x rows. What a GEMM's multistage mainloop does (CUTLASS): K in stages of SKB k-blocks
// (32 elements each), a stage holding the sweep's weight rows, the pass's rows of x and (NORM) the
// norm weight over its k-blocks, copied by every thread with cp.async RD - 1 stages ahead, one
// barrier a stage. x is never staged whole (the windowed plans stage it before their loop: at
// batch 64, 23-45 us of a q/k/v or gate/up tile, NOTES v50), and no warp reads x from global
// again for its own weight rows (XR's per-warp rings do).
// Stages complete on mbarriers (full and empty a slot, below), not on a CTA barrier.
// A stage in fragment order, so every lane's 16-byte reads are conflict-free:
//   W  [mat][grp][kb][h][lane]  rows grp 16 + g + 8 h, vector t of k-block kb  (h, g, t as mma's)
//   X  [nt][kb][lane]           x row nt 8 + g, vector t
//   NW [kb][t][NV]              the norm weight's 8 elements of vector t (NV 16-byte pieces)
// A sweep covers RC rows of the tile (the LM head takes several: the accumulators of at most one
// block a warp); its outputs are BLK = NMAT x groups blocks of (16 rows, NB n-tiles of 8 x rows);
// warp w takes block w % BLK and, where BLK < NWARPS, the k-blocks kbi = w / BLK (mod KSPLIT):
// the slices' sums are mma_epilogue's chunks (CH = KSPLIT), added in a fixed order: bit-stable.
// NORM: x times the norm weight as each lane reads it (bf16(x w), as mma_stage_xn stages it);
// each row's sum of squares over the first sweep's stages by NT / MP threads a row (each its
// chunks of a stage, in order; then the threads in order: bit-stable), 1 / rms on the sums in
// the epilogue. Every warp takes a share, so no warp's stage is longer (the barrier waits for
// the slowest), and no accumulator a lane is kept for it.

// Stage completion by mbarriers, not one CTA barrier a stage: full[r] completes a phase when every
// thread's copies of the stage in slot r have landed (cp.async's arrive, count NT); empty[r] when
// every warp has read it (count NWARPS). A warp starts a stage once its bytes are in, and a slot is
// refilled once its last reader is done, so the warps drift by up to a stage instead of waiting
// for the slowest at every stage (v52: no barrier at all was 0.45 ms faster at batch 64).
__device__ __forceinline__ void cp_async_arrive(unsigned long long* b) {   // when this thread's copies land
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(smem_u32(b)) : "memory");
}
__device__ __forceinline__ void mbar_inval(unsigned long long* b) {
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];" :: "r"(smem_u32(b)) : "memory");
}

// The copies of stage s (k-blocks [s SKB, s SKB + SKB) of K's slice [klo, khi): all of K but in
// a split GEMV) into st, each thread its 16-byte chunks (W, X, NW as above); weight rows past the
// sweep are not copied (their sums are never read), x rows past the pass and vectors past the
// slice are zeros (the mma adds them). k is absolute: x's rows are Kd long. Chunk i reads vector
// c = i mod SKB 4 of row i / (SKB 4): a warp's 32 copies read whole 128-byte lines of a few rows
// (SKB >= 2), not 64 bytes of 8 rows each, and write the fragment order's 16-byte slots.
template <int NMAT, bool NORM, class NW>
__device__ __forceinline__ void cs_issue(char* st, void* const* P, const NW* nw, long long rbytes, int Kd, int klo,
                                         int khi, int row0, int rows, int G, int m0, int mc, int nt8, int skb_log,
                                         int s) {
  constexpr int NV = sizeof(NW) / 2;                       // 16-byte pieces of 8 norm-weight elements
  const int skb = 1 << skb_log, k0 = klo + (s << skb_log) * 32, rlog = skb_log + 2;
  const int wch = NMAT * G * skb * 64, xch = nt8 * skb * 32, total = wch + xch + (NORM ? skb * 4 * NV : 0);
  const bf16* x = (const bf16*)P[0];
#pragma unroll 1
  for (int i = threadIdx.x; i < total; i += NT) {
    if (i < wch) {
      const int c = i & ((1 << rlog) - 1), ra = i >> rlog, mg = ra >> 4, k = k0 + c * 8;
      const int slot = (((mg << skb_log) + (c >> 2)) * 2 + ((ra >> 3) & 1)) * 32 + (ra & 7) * 4 + (c & 3);
      const int mat = NMAT == 2 && mg >= G ? 1 : 0, r = ra - mat * G * 16;
      const char* W = (const char*)P[1 + mat];
      if (k >= khi) cp_async16_zero(st + slot * 16, W);
      else if (r < rows) cp_async16(st + slot * 16, W + (long long)(row0 + r) * rbytes + (long long)k * 2);
    } else if (i < wch + xch) {
      const int j = i - wch, c = j & ((1 << rlog) - 1), m = j >> rlog, k = k0 + c * 8;
      const int slot = (((m >> 3) << skb_log) + (c >> 2)) * 32 + (m & 7) * 4 + (c & 3);
      char* dst = st + wch * 16 + slot * 16;
      if (k >= khi || m >= mc) cp_async16_zero(dst, x);
      else cp_async16(dst, x + (long long)(m0 + m) * Kd + k);
    } else if (NORM) {
      const int j = i - wch - xch, k = k0 + j * (8 / NV);  // [kb][t][NV]: 8 / NV elements a piece, in K's order
      if (k >= khi) cp_async16_zero(st + i * 16, nw);
      else cp_async16(st + i * 16, nw + k);
    }
  }
}

// bf16(x w) of a lane's 8 elements of x (as mma_stage_xn: the product rounded once); w's 8
// elements in NV 16-byte pieces.
template <class NW>
__device__ __forceinline__ uint4 cs_times_w(uint4 xv, const uint4* wp) {
  if (sizeof(NW) == 2) {                                   // bf16 x bf16 is exact in fp32: one rounding
    const uint4 w = wp[0], nz = make_uint4(0x80008000u, 0x80008000u, 0x80008000u, 0x80008000u);
    return make_uint4(fma_bf16x2(xv.x, w.x, nz.x), fma_bf16x2(xv.y, w.y, nz.y),
                      fma_bf16x2(xv.z, w.z, nz.z), fma_bf16x2(xv.w, w.w, nz.w));
  }
  float f[8], w[8];
  unpack(xv, f, (bf16*)0);
  unpack(wp[0], w, (float*)0);
  unpack(wp[1], w + 4, (float*)0);
  return make_uint4(pack_bf16x2(f[0] * w[0], f[1] * w[1]), pack_bf16x2(f[2] * w[2], f[3] * w[3]),
                    pack_bf16x2(f[4] * w[4], f[5] * w[5]), pack_bf16x2(f[6] * w[6], f[7] * w[7]));
}

__device__ __forceinline__ float cs_sumsq(uint4 xv) {      // x's 8 elements' squares, in order
  float f[8];
  unpack(xv, f, (bf16*)0);
  float s = 0.f;
#pragma unroll
  for (int e = 0; e < 8; e++) s += f[e] * f[e];
  return s;
}

// A stage's bytes (gemv_batch.cs_stage_bytes): W, X, NW (nv: 16-byte pieces of 8 norm-weight
// elements, 0 without the norm).
__device__ __forceinline__ int cs_stage_bytes(int nmat, int G, int nt8, int skb, int nv) {
  return (nmat * G * 64 + nt8 * 32 + 4 * nv) * skb * 16;
}

// The k-stage a tile's s-th stage holds: K from stage `phase` on, around to the start.
__device__ __forceinline__ int cs_kstage(int s, int phase, int nst) {
  const int k = s + phase;
  return k >= nst ? k - nst : k;
}

// ip: RD stages, SKB = 1 << SKB_LOG k-blocks a stage, RC rows a sweep (a multiple of 16); KS:
// only K's slice [KLO, KHI) (a split GEMV's partial sums). P and the epilogues as op_gemv_mma's
// (EPI 3 over several sweeps: each sweep's best merged into the row's slot by the lane that
// wrote it).
template <class TY, class TS, int NMAT, int EPI, bool BIAS, int NB, class TR, class TO, bool NORM, class NW, bool KS>
__device__ __forceinline__ void gemv_stream(AMK_PARAMS) {
  // CS_NX n-tiles of x in registers at once: 4 (2 with EPI 3, whose argmax merge spilled 24 B)
  constexpr int NV = sizeof(NW) / 2, CS_NX = NB < 4 ? NB : EPI == 3 ? 2 : 4;
  static_assert(!KS || !NORM, "a K slice has no whole rows to normalise");
  const int M = d.ip[P_GEMV_M], Kd = d.ip[P_GEMV_K], N = d.ip[P_GEMV_N];
  const int KLO = KS ? d.ip[P_GEMV_KLO] : 0, KHI = KS ? d.ip[P_GEMV_KHI] : Kd;
  const int n_off = d.ip[P_GEMV_N_OFF], n_tile = d.ip[P_GEMV_N_TILE];
  const int RD = d.ip[P_GEMV_RD], skb_log = d.ip[P_GEMV_SKB], RC = d.ip[P_GEMV_RC];
  const long long rbytes = (long long)d.ip[P_GEMV_LDW] * 2;
  const int skb = 1 << skb_log, nkb = (KHI - KLO + 31) / 32, nst = (nkb + skb - 1) >> skb_log;
  const int MP = M < 64 ? (M + 7) & ~7 : 64, nt8 = MP / 8;
  const int G0 = RC / 16;                                  // groups of a full sweep
  const NW* nw = (const NW*)P[d.n_in - 1];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  // the ring, whose area the sums take after a sweep's last stage (at most NWARPS blocks x 16
  // rows x MP x 4 bytes: KSPLIT x BLK <= NWARPS), then NORM's sums of squares and 1 / rms, then
  // EPI 3's best of each row over the sweeps before
  const int ring_bytes = RD * cs_stage_bytes(NMAT, G0, nt8, skb, NORM ? NV : 0), sums = NWARPS * 16 * MP * 4;
  const int region = ((ring_bytes > sums ? ring_bytes : sums) + 15) & ~15;
  char* ring = smem;
  float* part = (float*)smem;
  float* sq = (float*)(smem + region);                     // [SQT][MP]
  float* rinv = sq + NWARPS * 64;
  float* best = rinv + 64;                                 // EPI 3: [MP][value, index]
  // the slots' mbarriers, above sq's NT floats (sq is read only after the loop)
  unsigned long long* full = (unsigned long long*)(sq + NT);
  unsigned long long* empty = full + 8;                    // CS_RD_MAX slots
  // Each tile walks K from its own stage on (a hash of its index): tiles that start together
  // read different k-blocks of their weights and of x, not the same L2 lines of x from every SM
  // and the same column of every weight row at once (v51: a lockstep walk moved 8-14 GB/s an SM)
  const int phase = (int)((((unsigned)(n_off / n_tile) * 2654435761u) >> 16) % (unsigned)nst);
  const int SQT = NT / MP, sm = threadIdx.x % MP, sj = threadIdx.x / MP;   // NORM: thread sj of row sm
  AMK_MARK(0);
  for (int m0 = 0; m0 < M; m0 += MP) {
    const int mc = M - m0 < MP ? M - m0 : MP;
    for (int row0 = 0; row0 < n_tile; row0 += RC) {
      const int rows = n_tile - row0 < RC ? n_tile - row0 : RC, G = (rows + 15) / 16;
      const int BLK = NMAT * G, KSPLIT = BLK >= NWARPS ? 1 : NWARPS / BLK;
      const int blk = warp % BLK, slice = warp / BLK, mat = blk / G, grp = blk - mat * G;
      const bool computes = slice < KSPLIT, ssq = NORM && row0 == 0 && sj < SQT;
      const int sbw = cs_stage_bytes(NMAT, G, nt8, skb, NORM ? NV : 0);   // this sweep's stage
      const int xoff = NMAT * G * skb * 64 * 16, noff = xoff + nt8 * skb * 32 * 16;
      float acc[NB][4], ssr = 0.f;
#pragma unroll
      for (int b = 0; b < NB; b++) acc[b][0] = acc[b][1] = acc[b][2] = acc[b][3] = 0.f;
      if (threadIdx.x == 0)
        for (int r = 0; r < RD; r++) { mbar_init(&full[r], NT); mbar_init(&empty[r], NWARPS); }
      __syncthreads();                                     // the last sweep's epilogue read part; the barriers set
      // the first RD - 1 stages (an arrival only with a stage: one without could land after the
      // next sweep's init)
      for (int p = 0; p < RD - 1 && p < nst; p++) {
        cs_issue<NMAT, NORM, NW>(ring + p * sbw, P, nw, rbytes, Kd, KLO, KHI, n_off + row0, rows, G, m0, mc, nt8,
                                 skb_log, cs_kstage(p, phase, nst));
        cp_async_arrive(&full[p]);
      }
      AMK_MARK(1);
#pragma unroll 1
      for (int s = 0; s < nst; s++) {
        if (!mbar_wait(&full[s % RD], (unsigned)(s / RD) & 1u)) break;   // every thread's copies of stage s
        const char* stg = ring + (s % RD) * sbw;
        if (ssq)                                           // row sm's chunks sj, sj + SQT, ... of the stage
#pragma unroll 1
          for (int c = sj; c < skb * 4; c += SQT) {
            const int slot = (((sm >> 3) << skb_log) + (c >> 2)) * 32 + (sm & 7) * 4 + (c & 3);   // cs_issue's
            ssr += cs_sumsq(*(const uint4*)(stg + xoff + slot * 16));
          }
        if (computes) {
          // this warp's k-blocks of the stage: kbi = ks0 + kb with kbi = slice (mod KSPLIT); each
          // k-block's shared-memory reads issued together, then its mma (one load latency a
          // k-block, not one an n-tile: v52 measured the loop without its mma 2.4 ms faster)
          const int ks0 = cs_kstage(s, phase, nst) << skb_log;
          int kb = slice - ks0 % KSPLIT;
          if (kb < 0) kb += KSPLIT;
#pragma unroll 1
          for (; kb < skb && ks0 + kb < nkb; kb += KSPLIT) {
            const char* wa = stg + ((mat * G + grp) * skb + kb) * 1024 + lane * 16;
            const uint4 a0 = *(const uint4*)wa, a1 = *(const uint4*)(wa + 512);
            uint4 wv[NV];
            if (NORM)
#pragma unroll
              for (int v = 0; v < NV; v++) wv[v] = *(const uint4*)(stg + noff + ((kb * 4 + t) * NV + v) * 16);
#pragma unroll
            for (int b0 = 0; b0 < NB; b0 += CS_NX) {
              uint4 xv[CS_NX];
#pragma unroll
              for (int j = 0; j < CS_NX; j++)
                xv[j] = b0 + j < nt8 ? *(const uint4*)(stg + xoff + (((b0 + j) * skb + kb) * 32 + lane) * 16)
                                     : make_uint4(0u, 0u, 0u, 0u);
              if (NORM)
#pragma unroll
                for (int j = 0; j < CS_NX; j++) xv[j] = cs_times_w<NW>(xv[j], wv);
#pragma unroll
              for (int j = 0; j < CS_NX; j++) {
                if (b0 + j < nt8) {
                  mma_bf16(acc[b0 + j], a0.x, a1.x, a0.y, a1.y, xv[j].x, xv[j].y);
                  mma_bf16(acc[b0 + j], a0.z, a1.z, a0.w, a1.w, xv[j].z, xv[j].w);
                }
              }
            }
          }
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[s % RD]);         // this warp is done with stage s
        const int sn = s + RD - 1;                         // into the slot of stage s - 1, once it is read
        if (sn < nst) {
          if (sn >= RD && !mbar_wait(&empty[sn % RD], (unsigned)(sn / RD - 1) & 1u)) break;
          cs_issue<NMAT, NORM, NW>(ring + (sn % RD) * sbw, P, nw, rbytes, Kd, KLO, KHI, n_off + row0, rows, G, m0, mc,
                                   nt8, skb_log, cs_kstage(sn, phase, nst));
          cp_async_arrive(&full[sn % RD]);
        }
      }
      __syncthreads();                                     // every stage read: part may take the ring
      if (threadIdx.x == 0)
        for (int r = 0; r < RD; r++) { mbar_inval(&full[r]); mbar_inval(&empty[r]); }
      AMK_MARK(2);
      const int rows16 = G * 16;
      if (computes) {
        // c0, c1: row g, x rows 2t, 2t + 1 of the n-tile; c2, c3: row g + 8
#pragma unroll
        for (int b = 0; b < NB; b++) {
          if (b >= nt8) break;
#pragma unroll
          for (int e = 0; e < 4; e++) {
            const int m = b * 8 + 2 * t + (e & 1), r = grp * 16 + g + 8 * (e >> 1);
            part[mma_slot(slice, m, mat, r, MP, NMAT, rows16)] = acc[b][e];
          }
        }
      }
      if (ssq) sq[sj * MP + sm] = ssr;
      __syncthreads();
      if (NORM && row0 == 0) {                             // 1 / rms of each row: its threads' sums in order
        if (threadIdx.x < mc) {
          float s2 = 0.f;
          for (int k = 0; k < SQT; k++) s2 += sq[k * MP + threadIdx.x];
          rinv[threadIdx.x] = rsqrtf(s2 / (float)Kd + d.fp[F_GEMV_EPS]);
        }
        __syncthreads();
      }
      AMK_MARK(3);
      // EPI 3 past the first sweep: the row's best so far kept (in smem: nothing live across the
      // epilogue's call), the sweep's written over it, the better of the two put back, each by
      // the lane that writes the row's slot (mma_epilogue: warp m % NWARPS, lane 0)
      const bool merge = EPI == 3 && row0 > 0 && lane == 0;
      float* pa0 = (float*)P[d.n_in + 1] + 2 * d.ip[P_GEMV_ARG_SLOT];
      const long long pstride = 2LL * d.ip[P_GEMV_ARG_SLOTS];
      if (merge)
        for (int m = warp; m < mc; m += NWARPS) {
          best[2 * m] = pa0[(m0 + m) * pstride]; best[2 * m + 1] = pa0[(m0 + m) * pstride + 1];
        }
      mma_epilogue<TY, TS, EPI, BIAS, NMAT, TR, TO, NORM>(d, P, part, rows16, MP, KSPLIT, m0, mc, N, n_off + row0,
                                                          rows, rinv);
      if (merge)
        for (int m = warp; m < mc; m += NWARPS) {
          float* pa = pa0 + (m0 + m) * pstride;
          if (am_better(best[2 * m], __float_as_int(best[2 * m + 1]), pa[0], __float_as_int(pa[1]))) {
            pa[0] = best[2 * m]; pa[1] = best[2 * m + 1];
          }
        }
    }
  }
  AMK_MARK(4);
}
