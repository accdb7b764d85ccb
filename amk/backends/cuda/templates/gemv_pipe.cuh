// Batch-1 GEMV of read-only float weights through a per-warp cp.async ring (AMK_GEMV_PIPE).
// y_m[n_off + r] = x . W_m[n_off + r, :K] for NMAT matrices W_m sharing x (gate and up are one
// task of two). The tile is a flat list of items, matrix-major then row then segment (a
// segment: 32 lanes x PIPE_V 16-byte vectors of one row); warp w owns items [w*per, (w+1)*per),
// a contiguous run of the tile's bytes. Each warp keeps PIPE_S items in flight in its own
// stages (no barrier between warps, each lane reads back only its own copies), so the weight
// stream never drains between rows. The scheduler issues every warp's first PIPE_S-1 items
// before the task's counter wait (weights never depend on activations: pipe_preload_task).
// Each item's sum lands in part[] and rows are summed in a fixed order: steps are bit-identical.

#define PIPE_V AMK_PIPE_V                       // 16-byte vectors a lane per item
#define PIPE_S AMK_PIPE_S                       // items in flight a warp
#define PIPE_ITEM (PIPE_V * 512)                // bytes of one item
#define PIPE_WARP (PIPE_S * PIPE_ITEM)          // bytes of one warp's stages (after AMK_RING_OFF)
__shared__ int amk_pipe_pre;                    // 1: the scheduler issued this task's first items

struct PipeGeo { int nv, nseg, items, per; };

__device__ __forceinline__ PipeGeo pipe_geo(const TaskDesc& d) {
  PipeGeo g;
  g.nv = d.ip[P_GEMV_NV];
  g.nseg = (g.nv + 32 * PIPE_V - 1) / (32 * PIPE_V);
  g.items = d.ip[P_GEMV_NMAT] * d.ip[P_GEMV_N_TILE] * g.nseg;
  g.per = (g.items + NWARPS - 1) / NWARPS;
  return g;
}

// Copy this warp's item j (when it has one) into its stage, then commit a group either way:
// the consumer counts groups.
__device__ __forceinline__ void pipe_issue(const TaskDesc& d, void* const* P, char* smem,
                                           const PipeGeo& g, int j) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int it = warp * g.per + j;
  if (j < g.per && it < g.items) {
    const int per_mat = d.ip[P_GEMV_N_TILE] * g.nseg;
    const int mat = it / per_mat, rem = it - mat * per_mat;
    const int row = rem / g.nseg, seg = rem - row * g.nseg;
    const char* src = (const char*)P[1 + mat] + (long long)(d.ip[P_GEMV_N_OFF] + row) * d.ip[P_GEMV_RB];
    char* dst = smem + AMK_RING_OFF + warp * PIPE_WARP + (j % PIPE_S) * PIPE_ITEM + lane * 16;
#pragma unroll
    for (int u = 0; u < PIPE_V; u++) {
      const int v = seg * 32 * PIPE_V + u * 32 + lane;
      if (v < g.nv) cp_async16(dst + u * 512, src + (long long)v * 16);
    }
  }
  cp_async_commit();
}

// Every thread, before the task's counter wait: the first PIPE_S-1 items of each warp.
__device__ __forceinline__ void pipe_preload(const TaskDesc& d, void* const* P, char* smem) {
  const PipeGeo g = pipe_geo(d);
  for (int j = 0; j < PIPE_S - 1; j++) pipe_issue(d, P, smem, g, j);
  if (threadIdx.x == 0) amk_pipe_pre = 1;
}

// P: x, W_1..W_NMAT, [bias (NMAT == 1)], [residual (ADD)], then y_1..y_NMAT.
// ADD (NMAT == 1): as op_gemv's (gemv.cuh).
template <class TX, class TW, class TY, class TS, int NMAT, bool BIAS, bool ADD = false,
          class TR = float, class TO = TY>
__device__ __noinline__ void op_gemv_pipe(AMK_PARAMS) {
  constexpr int VW = VecN<TW>::N;
  const int Kd = d.ip[P_GEMV_K], n_off = d.ip[P_GEMV_N_OFF], n_tile = d.ip[P_GEMV_N_TILE];
  const PipeGeo g = pipe_geo(d);
  const TX* x = (const TX*)P[0];
  const TS* bias = (const TS*)P[BIAS ? 1 + NMAT : 0];
  const TR* res = (const TR*)P[d.n_in - 1];    // ADD: the last input
  float* xs = (float*)smem;
  float* part = xs + ((Kd + 3) & ~3);           // one sum per item (lower checks it fits)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (!amk_pipe_pre)
    for (int j = 0; j < PIPE_S - 1; j++) pipe_issue(d, P, smem, g, j);
  if (!d.ip[P_GEMV_XS_READY]) stage_f32(xs, x, Kd);
  __syncthreads();                              // x staged; every thread has read amk_pipe_pre
  if (threadIdx.x == 0) amk_pipe_pre = 0;
  const char* ring = smem + AMK_RING_OFF + warp * PIPE_WARP + lane * 16;
  for (int j = 0; j < g.per; j++) {
    pipe_issue(d, P, smem, g, j + PIPE_S - 1);
    cp_async_wait<PIPE_S - 1>();                // item j has landed (this lane's part of it)
    const int it = warp * g.per + j;
    if (it >= g.items) continue;
    const int seg = it % g.nseg;
    const char* st = ring + (j % PIPE_S) * PIPE_ITEM;
    float a = 0.f;
#pragma unroll
    for (int u = 0; u < PIPE_V; u++) {
      const int v = seg * 32 * PIPE_V + u * 32 + lane;
      if (v < g.nv) a = dot_vec<TW>(a, *(const uint4*)(st + u * 512), xs + v * VW);
    }
    a = warp_sum(a);
    if (lane == 0) part[it] = a;
  }
  __syncthreads();
  for (int r = threadIdx.x; r < NMAT * n_tile; r += NT) {
    float s = 0.f;
    for (int k = 0; k < g.nseg; k++) s += part[r * g.nseg + k];
    const int mat = r / n_tile, row = r - mat * n_tile;
    if (BIAS) s += to_f(bias[n_off + row]);
    if (ADD) ((TO*)P[d.n_in])[n_off + row] = from_f<TO>(to_f(from_f<TY>(s)) + to_f(res[n_off + row]));
    else ((TY*)P[d.n_in + mat])[n_off + row] = from_f<TY>(s);
  }
}

// The task's pipe GEMV, when it is the task or a FUSED step that only norms or a combine
// precede (nothing else commits cp.async groups between the preload and the GEMV): preload it.
__device__ __forceinline__ void pipe_preload_task(const TaskDesc& T, const TaskDesc* subs, bool fits,
                                                  void* const* sp, char* smem) {
  if (!AMK_PIPE_ON) return;                     // no pipe GEMV in the program: no code
  if (T.op == OP_GEMV_TILE || T.op == OP_GEMM_TILE) {
    if (T.ip[P_GEMV_PIPE]) pipe_preload(T, sp, smem);
    return;
  }
  if (T.op != OP_FUSED || !fits) return;
  for (int s = 0; s < T.n_sub; s++) {
    const TaskDesc& S = subs[s];
    if ((S.op == OP_GEMV_TILE || S.op == OP_GEMM_TILE) && S.ip[P_GEMV_PIPE]) {
      pipe_preload(S, sp + (S.ptr_begin - T.ptr_begin), smem);
      return;
    }
    if (S.op != OP_RMSNORM && S.op != OP_LAYERNORM && S.op != OP_ATTENTION_COMBINE) return;
  }
}
