// The persistent scheduler: one CTA per SM walks its static queue. For each task it tops up the
// CTA's weight stream (GEMV weight chunks of this and later tasks into shared memory, see
// common.cuh) and prefetches the NEXT task's weights into L2 (weights never depend on
// activations) before it waits on the task's
// counters (thread 0 spins with __nanosleep backoff; a wait with no progress for watchdog_ns
// aborts every CTA and names the task), runs the task's device function, then publishes
// completion (fence + atomic add). Counters are monotonic: wait i needs
// counter >= threshold + epoch * stride, epoch = steps completed, advanced by the last CTA out.

#define MAX_PTRS $max_ptrs

__device__ __noinline__ void run_variant(AMK_PARAMS) {
  switch (d.variant) {
$cases
    default: break;
  }
}

__device__ __forceinline__ void load_desc(const TaskDesc* src, const unsigned long long* ptrs,
                                          TaskDesc* dst, void** dptrs) {
  const int* s = (const int*)src; int* t = (int*)dst;
  for (int i = threadIdx.x; i < (int)(sizeof(TaskDesc) / 4); i += NT) t[i] = s[i];
  const int np = src->n_in + src->n_out, pb = src->ptr_begin;
  for (int i = threadIdx.x; i < np; i += NT) dptrs[i] = (void*)ptrs[pb + i];
}

__device__ __forceinline__ void prefetch_task(const TaskDesc* t, const KernelArgs& A, int lane) {
  const RangeDesc* r = (const RangeDesc*)A.ranges + t->pf_begin;
  for (int i = lane; i < t->n_pf; i += 32) prefetch_l2(r[i].addr, r[i].bytes);
  if (t->op == OP_ATTENTION_TILE) prefetch_attention(*t, (const unsigned long long*)A.ptrs, lane);
}

// Thread 0 only. Returns false when the kernel is aborting.
__device__ bool wait_task(const TaskDesc* t, const KernelArgs& A, unsigned epoch) {
  const WaitDesc* w = (const WaitDesc*)A.waits + t->wait_begin;
  unsigned* counters = (unsigned*)A.counters;
  KernelState* st = (KernelState*)A.state;
  for (int i = 0; i < t->n_waits; i++) {
    const unsigned* c = counters + w[i].counter;
    const unsigned target = w[i].threshold + epoch * w[i].stride;
    unsigned v = ld_volatile(c);
    if ((int)(v - target) >= 0) continue;
    unsigned last = v, ns = 16;
    unsigned long long t_last = global_timer();
    for (;;) {
      __nanosleep(ns);
      if (ns < 128) ns <<= 1;
      v = ld_volatile(c);
      if ((int)(v - target) >= 0) break;
      const unsigned long long now = global_timer();
      const bool aborting = ld_volatile(&st->abort) != 0;
      if (v != last) { last = v; t_last = now; }
      if (aborting || now - t_last > A.watchdog_ns) {
        ErrSlot* e = (ErrSlot*)A.errs + blockIdx.x;
        e->task = t->task_id; e->counter = w[i].counter; e->value = v; e->target = target;
        if (!aborting) { raise_fault(st, FAULT_DEADLOCK, t->task_id, w[i].counter); atomicExch(&st->abort, 1u); }
        __threadfence();
        return false;
      }
    }
  }
  __threadfence();                 // acquire: the producers' writes are visible from here on
  return true;
}

extern "C" __global__ void __launch_bounds__(NT, 1) amk_megakernel(const __grid_constant__ KernelArgs A) {
  extern __shared__ __align__(16) char smem[];
  __shared__ TaskDesc s_task, s_sub;
  __shared__ void* s_ptrs[MAX_PTRS];
  __shared__ void* s_sub_ptrs[MAX_PTRS];
  __shared__ int s_ok;
  const TaskDesc* tasks = (const TaskDesc*)A.tasks;
  const unsigned long long* ptrs = (const unsigned long long*)A.ptrs;
  const int* qt = (const int*)A.queue_tasks;
  const int* qo = (const int*)A.queue_off;
  KernelState* st = (KernelState*)A.state;
  const unsigned epoch = ld_volatile(&st->epoch);
  const int qb = qo[blockIdx.x], qe = qo[blockIdx.x + 1];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == AMK_ISSUER) {
    const unsigned* so = (const unsigned*)A.stream_off;
    const unsigned sb = so[blockIdx.x];
    amk_ss.n = so[blockIdx.x + 1] - sb; amk_ss.issued = 0; amk_ss.consumed = 0; amk_ss.dead = 0;
    amk_ss.win_req = 0; amk_ss.win_done = 0;
    amk_ss.src = A.stream + sb * 16ull; amk_ss.watchdog_ns = A.watchdog_ns; amk_ss.st = st;
    for (int s = 0; s < AMK_RING_STAGES; s++) mbar_init(&amk_full[s], 1);
    mbar_init(&amk_winbar[0], 1); mbar_init(&amk_winbar[1], 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n\tfence.proxy.async.shared::cta;" ::: "memory");
    if (amk_ss.n > 0) stream_win_request(smem, 0);
  }
  __syncthreads();
  // L2 prefetch from the last warp: thread 0 (warp 0) fences after its counter waits, and a
  // fence would wait for these bulk prefetches too.
  if (warp == NWARPS - 1 && qb < qe) prefetch_task(tasks + qt[qb], A, lane);
  bool aborted = false;
#ifdef AMK_PROFILE
  unsigned long long* prof = (unsigned long long*)A.prof;   // per queue entry: wait0, wait1, end, sm
#endif
  for (int i = qb; i < qe; i++) {
    const TaskDesc* t = tasks + qt[i];
#ifdef AMK_PROFILE
    if (threadIdx.x == 0) prof[4 * i] = global_timer();
#endif
    if (threadIdx.x == AMK_ISSUER) stream_top_up(smem);   // free stages <- next chunks, pre-wait
    if (warp == NWARPS - 1 && i + 1 < qe) prefetch_task(tasks + qt[i + 1], A, lane);
    if (threadIdx.x == 0) {
      s_ok = wait_task(t, A, epoch) ? 1 : 0;
#ifdef AMK_PROFILE
      prof[4 * i + 1] = global_timer();
#endif
    }
    load_desc(t, ptrs, &s_task, s_ptrs);
    __syncthreads();
    if (!s_ok) { aborted = true; break; }
    if (s_task.op == OP_FUSED) {
      const RangeDesc* z = (const RangeDesc*)A.ranges + s_task.zero_begin;
      for (int r = 0; r < s_task.n_zero; r++)
        for (unsigned long long k = threadIdx.x; k < z[r].bytes; k += NT) ((char*)z[r].addr)[k] = 0;
      for (int s = 0; s < s_task.n_sub; s++) {
        __syncthreads();
        load_desc(tasks + s_task.sub_begin + s, ptrs, &s_sub, s_sub_ptrs);
        __syncthreads();
        run_variant(s_sub, s_sub_ptrs, smem, st);
      }
    } else {
      run_variant(s_task, s_ptrs, smem, st);
    }
    __syncthreads();
    if (threadIdx.x == 0 && s_task.out_counter >= 0) {
      __threadfence();             // release: this task's writes before the count
      atomicAdd((unsigned*)A.counters + s_task.out_counter, 1u);
    }
#ifdef AMK_PROFILE
    if (threadIdx.x == 0) {
      unsigned smid; asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
      prof[4 * i + 2] = global_timer(); prof[4 * i + 3] = smid;
    }
#endif
  }
  if (threadIdx.x == AMK_ISSUER) {   // an aborted queue leaves copies in flight: let them land
    for (unsigned j = amk_ss.consumed; j < amk_ss.issued; j++)
      mbar_wait(&amk_full[j % AMK_RING_STAGES], (j / AMK_RING_STAGES) & 1u);
    for (unsigned b = amk_ss.win_done; b < amk_ss.win_req; b++) mbar_wait(&amk_winbar[b & 1], (b >> 1) & 1u);
  }
  if (threadIdx.x == 0 && !aborted) {
    __threadfence();
    const unsigned old = atomicAdd(&st->done, 1u);
    if (old == (epoch + 1u) * gridDim.x - 1u) { __threadfence(); atomicExch(&st->epoch, epoch + 1u); }
  }
}
