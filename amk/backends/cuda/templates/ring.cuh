// Kernel v2's weight ring (ring.py has the page order both sides follow). AMK_RING_PAGES pages of
// AMK_RING_SLOT bytes at smem + AMK_RING_OFF, one item of a RING GEMV step a page. A CTA's item q
// (its queue's RING items, numbered from 0 in queue and step order) lives in page q % PAGES:
//   full[p]   count 1: the producer's arrive.expect_tx(item bytes) and its bulk copies' bytes
//             complete phase q / PAGES once item q has landed (the consumers wait on its parity);
//   empty[p]  count 32: the consumer warp's lanes arrive once they hold item q in registers,
//             completing phase q / PAGES; the producer waits on it before it copies item
//             q + PAGES into the page (the first PAGES items need no wait: the ring starts empty).
// Page p is only ever filled by producer lane p and read by consumer warp p (PAGES <= NWARPS;
// op_gemv_direct's RING loop gives warp w the items q = w mod PAGES), so each side waits on the
// page's phases one after the other:
// a parity wait can never see the phase two back (item q - PAGES is its own previous item, or an
// earlier step's, taken before that step's closing barrier).
// The producer never waits on a counter (weights do not depend on activations); its waits on
// empty pages end when the kernel aborts, or, with no page freed for 2 watchdogs (the
// consumers stopped taking items: a bug), as FAULT_DEADLOCK naming the task. Under v1 nothing
// here exists but the never-instantiated consumer load (op_gemv_direct's RING path).
#if AMK_KERNEL_V2
// threadIdx.x, read again where it is used (scheduler.cu: not kept across a call)
__device__ __forceinline__ unsigned tid_now() { unsigned t; asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t)); return t; }
__shared__ __align__(8) unsigned long long amk_ring_full[AMK_RING_PAGES], amk_ring_empty[AMK_RING_PAGES];
__shared__ unsigned amk_ring_q;      // items the consumers took before the running RING step

__device__ __forceinline__ void mbar_arrive(unsigned long long* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_u32(b)) : "memory");
}
// AMK_INIT_THREAD, before the prologue's fence.mbarrier_init and CTA barrier.
__device__ __forceinline__ void ring_init() {
  for (int p = 0; p < AMK_RING_PAGES; p++) { mbar_init(&amk_ring_full[p], 1); mbar_init(&amk_ring_empty[p], 32); }
  amk_ring_q = 0;
}
__device__ __forceinline__ unsigned ring_first_item() { return amk_ring_q; }
// Thread 0, after the step's last item was taken (every consumer read ring_first_item before).
__device__ __forceinline__ void ring_took(unsigned q_end) { if (threadIdx.x == 0) amk_ring_q = q_end; }
#else
__device__ __forceinline__ void ring_init() {}
__device__ __forceinline__ unsigned ring_first_item() { return 0; }
__device__ __forceinline__ void ring_took(unsigned) {}
#endif

// op_gemv_direct's item `it`, the CTA's item q, from its page (ring.py consumer_offset: row j's
// segment at j * segb, vector u * 32 + lane of it; zeros past the tile's rows or K), then the
// page released: every lane arrives once its loads are in registers (the arrive's release
// orders them before the producer's next copy into the page).
template <int NMAT, int GU>
__device__ __forceinline__ void direct_load_ring(uint4 (&wv)[2][GU], char* smem, unsigned q, int n_tile,
                                                 int segb, int nv, int nseg, int it) {
#if AMK_KERNEL_V2
  const int lane = threadIdx.x & 31, g = it / nseg, seg = it - g * nseg;
  const unsigned pg = q % AMK_RING_PAGES;
  mbar_wait(&amk_ring_full[pg], (q / AMK_RING_PAGES) & 1u);
  const char* page = smem + AMK_RING_OFF + pg * AMK_RING_SLOT;
#pragma unroll
  for (int j = 0; j < 2; j++) {
    const int r = NMAT == 2 ? g : 2 * g + j;
#pragma unroll
    for (int u = 0; u < GU; u++) {
      const int v = seg * 32 * GU + u * 32 + lane;
      wv[j][u] = (r < n_tile && v < nv) ? *(const uint4*)(page + j * segb + (u * 32 + lane) * 16) : make_uint4(0u, 0u, 0u, 0u);
    }
  }
  mbar_arrive(&amk_ring_empty[pg]);
#endif
}

#if AMK_KERNEL_V2
#define RING_LANES ((1u << AMK_RING_PAGES) - 1u)   // the producer lanes, one a page
__device__ __forceinline__ bool mbar_test_wait(unsigned long long* b, unsigned parity) {
  unsigned ok;
  asm volatile("{ .reg .pred p; mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
               : "=r"(ok) : "r"(smem_u32(b)) , "r"(parity) : "memory");
  return ok != 0;
}

// Lane 0, for every producer lane, when no lane has moved for a while: 1 the kernel is
// aborting (the consumers stop), 2 no page was freed for 2 watchdogs since t_idle (the
// consumers stopped taking items: a bug; FAULT_DEADLOCK raised; the consumers' own counter
// waits report a stuck schedule first, within one watchdog), else 0.
__device__ __noinline__ int ring_stop(const KernelArgs& A, unsigned long long t_idle, int task_id) {
  KernelState* st = (KernelState*)A.state;
  if (ld_volatile(&st->abort) != 0) return 1;
  if (global_timer() - t_idle <= 2 * A.watchdog_ns) return 0;
  raise_fault(st, FAULT_DEADLOCK, task_id, -1);
  atomicExch(&st->abort, 1u);
  return 2;
}

// One RING step's items, in ring.py item_copies' order and layout: producer lane pg copies its
// page's (q = q0 + it = pg mod PAGES), each once the page's previous item is taken (`filled`:
// the page's phases it has started). The lanes
// poll together (test_wait, no lane suspended while another's page is free) and stop together.
// The proxy fence orders the consumers' generic reads of the page (visible through the empty
// barrier's phase) before the copy's async-proxy writes into it.
__device__ __forceinline__ bool ring_produce_step(const TaskDesc* s, const unsigned long long* ptrs,
                                                  char* smem, unsigned q0, unsigned pg, const KernelArgs& A,
                                                  int& items, unsigned& filled) {
  const int nmat = s->ip[P_GEMV_RING], n_off = s->ip[P_GEMV_N_OFF], n_tile = s->ip[P_GEMV_N_TILE];
  const int rowb = s->ip[P_GEMV_ROWB], nseg = (rowb + 4095) >> 12, segb = rowb < 4096 ? rowb : 4096;
  const long long pitch = s->ip[P_GEMV_PITCH];
  items = (nmat == 2 ? n_tile : (n_tile + 1) >> 1) * nseg;
  const unsigned long long w0 = ptrs[s->ptr_begin + 1], w1 = nmat == 2 ? ptrs[s->ptr_begin + 2] : w0;
  unsigned long long* full = &amk_ring_full[pg];
  char* page = smem + AMK_RING_OFF + pg * AMK_RING_SLOT;
  int it = (int)((pg + AMK_RING_PAGES - q0 % AMK_RING_PAGES) % AMK_RING_PAGES);
  unsigned idle = 0;
  unsigned long long t_idle = 0;
#pragma unroll 1
  for (;;) {
    const bool mine = it < items;
    if (!__any_sync(RING_LANES, mine)) return true;
    bool moved = false;
    const unsigned q = q0 + it;
    if (mine && (q < AMK_RING_PAGES || mbar_test_wait(&amk_ring_empty[pg], (q / AMK_RING_PAGES - 1u) & 1u))) {
      fence_proxy_async();
      const int g = it / nseg, seg = it - g * nseg, off = seg << 12, nb = rowb - off < 4096 ? rowb - off : 4096;
      const int r0 = nmat == 2 ? g : 2 * g, r1 = nmat == 2 ? g : 2 * g + 1;
      const bool two = r1 < n_tile;
      mbar_expect_tx(full, (unsigned)(two ? 2 * nb : nb));
      bulk_g2s(page, w0 + (unsigned long long)((n_off + r0) * pitch + off), (unsigned)nb, full);
      if (two) bulk_g2s(page + segb, w1 + (unsigned long long)((n_off + r1) * pitch + off), (unsigned)nb, full);
      it += AMK_RING_PAGES;
      filled++;
      moved = true;
    }
    if (__any_sync(RING_LANES, moved)) { idle = 0; continue; }
    if (idle++ == 0 && pg == 0) t_idle = global_timer();
    __nanosleep(32);                // every page full: the consumers' issue slots, not a spin
    if (idle % 64 == 0) {
      const int stop = __shfl_sync(RING_LANES, pg == 0 ? ring_stop(A, t_idle, s->task_id) : 0, 0);
      if (stop) return false;
    }
  }
}

// The producer: lane pg < PAGES of the producer warpgroup's first warp fills page pg (the rest of
// the warpgroup has returned): each lane walks the CTA's queue (the ids in s_queue, the rest from
// global) and every task's steps (a FUSED task's from its sub-descriptors), streaming its page's
// items of each RING step, the lanes in step (ring_produce_step). Before a lane returns, its page's last copy has landed (nothing may land in shared
// memory after the CTA exits): waited without the fault path's early exit (a copy depends on
// nothing, so it lands).
__device__ __noinline__ void ring_produce(const KernelArgs& A, const int* s_queue, int qb, int qe,
                                          int queue_cap, char* smem) {
  const TaskDesc* tasks = (const TaskDesc*)A.tasks;
  const unsigned long long* ptrs = (const unsigned long long*)A.ptrs;
  const int* qt = (const int*)A.queue_tasks;
  const unsigned pg = threadIdx.x & 31;
  unsigned q = 0, filled = 0;
  bool ok = true;
#pragma unroll 1
  for (int i = qb; i < qe && ok; i++) {
    const TaskDesc* t = tasks + (i - qb < queue_cap ? s_queue[i - qb] : qt[i]);
    const bool fused = t->op == OP_FUSED;
    const int ns = fused ? t->n_sub : 1;
    const TaskDesc* s0 = fused ? tasks + t->sub_begin : t;
#pragma unroll 1
    for (int s = 0; s < ns && ok; s++) {
      const TaskDesc* st = s0 + s;
      int items = 0;
      if ((st->op == OP_GEMV_TILE || st->op == OP_GEMM_TILE) && st->ip[P_GEMV_RING] > 0) {
        ok = ring_produce_step(st, ptrs, smem, q, pg, A, items, filled);
        q += items;
      }
    }
  }
  // Stopped (the kernel aborts): a consumer waiting for an item never issued gives up at once
  // (mbar_wait_slow; the fault that made the kernel abort is already recorded, so it stays).
  if (!ok && pg == 0) amk_bw.dead = 1;
  if (filled > 0) {                // the page's last phase: its earlier ones were emptied
    const unsigned long long t0 = global_timer();
    while (!mbar_try_wait(&amk_ring_full[pg], (filled - 1u) & 1u) && global_timer() - t0 < 2 * A.watchdog_ns) {}
  }
}
#endif
