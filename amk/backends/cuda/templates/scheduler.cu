// The persistent scheduler: each persistent CTA (one per SM, NT threads) walks its static
// queue. For each task thread 0 polls the task's counters with acquire loads and __nanosleep backoff (a wait with no progress for watchdog_ns aborts every
// CTA and names the task). Then it runs the task's device function and publishes completion
// with a release add after the CTA barrier. Descriptors are double-buffered in shared memory:
// the NEXT task's TaskDesc is copied (cp.async) before this task's wait, its pointers and
// FUSED step descriptors right after this task ends (three slots measured slower, NOTES v10);
// the queue's task ids are in shared memory. A task whose descriptor has n_pre copies the NEXT
// task's first weight rows into shared memory (AMK_PRE, preload.py): thread 0 issues them
// from the staged attention once its own loads are out, else when the task ends. Counters are
// monotonic: wait i needs counter >= threshold + epoch * stride, epoch = steps completed,
// advanced by the last CTA out. Counter i lives at word i * AMK_CSTRIDE.

#define MAX_PTRS $max_ptrs
#define SLOT_SUBS 8          // FUSED steps whose descriptors a slot holds
#define SLOT_PTRS 128        // pointers (task + its steps) a slot holds; larger tasks load per step
#define DESC_WORDS ((int)(sizeof(TaskDesc) / 4))
#define QUEUE_CAP 512        // queue entries a CTA keeps in shared memory (the rest: global)

// Stage 1 of a slot: the task's own descriptor (warps 2-3: not thread 0 or the init thread). Every thread commits a group, empty or not.
__device__ __forceinline__ void slot_stage1(const TaskDesc* src, TaskDesc* dst) {
  const int i = threadIdx.x - 64;
  if (i >= 0 && i < DESC_WORDS) cp_async4((int*)dst + i, (const int*)src + i);
  cp_async_commit();
}
// Stage 2 (the slot's TaskDesc visible): its pointers, the next task's preload ranges it copies
// (amk_pre_ranges[slot]) and, when they fit, its steps' descriptors.
__device__ __forceinline__ void slot_stage2(const TaskDesc& t, const TaskDesc* tasks,
                                            const unsigned long long* ptrs, TaskDesc* subs, void** sp,
                                            const RangeDesc* ranges, RangeDesc* pre) {
  // One copy a thread, no loops: every count here is at most NT (a loop's trip count kept a
  // spilled register that each task end reloaded, NOTES v15), the steps' words at most 2 NT.
  static_assert(SLOT_PTRS <= NT - 32 && MAX_PTRS <= NT - 32 && SLOT_SUBS * DESC_WORDS <= 2 * NT, "slot_stage2");
  const bool fits = t.n_ptr_all <= SLOT_PTRS && t.n_sub <= SLOT_SUBS;
  const int np = fits ? t.n_ptr_all : t.n_in + t.n_out, i = threadIdx.x, ip = i - (AMK_EARLY ? 32 : 0);
  // AMK_EARLY: the pointers by warps 1-15, as an early phase (run_early) reads them while thread 0 polls
  // (ip >= 0 tested only under AMK_EARLY: elsewhere the compare changed the kernel, NOTES v61)
  if ((!AMK_EARLY || ip >= 0) && ip < np) cp_async8(sp + ip, ptrs + t.ptr_begin + ip);
  if (AMK_PRE && i < t.n_pre * (int)(sizeof(RangeDesc) / 8))
    cp_async8((unsigned long long*)pre + i, (const unsigned long long*)(ranges + t.pre_begin) + i);
  if (fits && t.op == OP_FUSED) {
    const int* src = (const int*)(tasks + t.sub_begin), nw = t.n_sub * DESC_WORDS;
    if (i < nw) cp_async4((int*)subs + i, src + i);
    if (i + NT < nw) cp_async4((int*)subs + i + NT, src + i + NT);
  }
  cp_async_commit();
}

__device__ __noinline__ void run_variant(AMK_PARAMS) {
  switch (d.variant) {
$cases
    default: break;
  }
}

// A task's early phase, run by warps 1-15 while thread 0 polls its counters: the work that no
// task of this step feeds (the staged attention's pos read and first K/V copies, attn_early;
// ATTN EARLY). It commits two cp.async groups a thread, which the task waits for itself.
__device__ __noinline__ void run_early(AMK_PARAMS) {
  switch (d.variant) {
$early_cases
    default: cp_async_commit(); cp_async_commit(); break;
  }
}

__device__ __forceinline__ void load_desc(const TaskDesc* src, const unsigned long long* ptrs,
                                          TaskDesc* dst, void** dptrs) {
  const int* s = (const int*)src; int* t = (int*)dst;
  for (int i = threadIdx.x; i < (int)(sizeof(TaskDesc) / 4); i += NT) t[i] = s[i];
  const int np = src->n_in + src->n_out, pb = src->ptr_begin;
  for (int i = threadIdx.x; i < np; i += NT) dptrs[i] = (void*)ptrs[pb + i];
}

// A FUSED step of a task too large for its slot: its descriptor and pointers from global
// memory. Out of line: inlined, its never-run copy loops sat inside the scheduler's task loop.
__device__ __noinline__ void run_unstaged(const TaskDesc* sub, const unsigned long long* ptrs, TaskDesc* s_sub,
                                          void** s_sub_ptrs, char* smem, KernelState* st) {
  __syncthreads();
  load_desc(sub, ptrs, s_sub, s_sub_ptrs);
  __syncthreads();
  run_variant(*s_sub, s_sub_ptrs, smem, st);
}

// Thread 0 only. Returns false when the kernel is aborting. The first AMK_INLINE_WAITS waits
// come from the descriptor in shared memory (a global load before the first poll would add a
// round trip to every task start whose counters are already there), the rest from the table.
__device__ bool wait_task(const TaskDesc* t, const KernelArgs& A, unsigned epoch) {
  const WaitDesc* w = (const WaitDesc*)A.waits + t->wait_begin;
  unsigned* counters = (unsigned*)A.counters;
  KernelState* st = (KernelState*)A.state;
  for (int i = 0; i < t->n_waits; i++) {
    const bool in = i < AMK_INLINE_WAITS;
    const int wc = in ? t->wait_c[i] : w[i].counter;
    const unsigned* c = counters + (long long)wc * AMK_CSTRIDE;
    const unsigned target = in ? t->wait_t[i] + epoch * t->wait_s[i] : w[i].threshold + epoch * w[i].stride;
    unsigned v = ld_acquire(c);     // acquire: no fence after (a fence.sc costs microseconds)
    if ((int)(v - target) >= 0) continue;
    unsigned last = v, ns = 16;
    unsigned long long t_last = global_timer();
    for (;;) {
      __nanosleep(ns);
      if (ns < AMK_SPIN_NS) ns <<= 1;
      v = ld_acquire(c);
      if ((int)(v - target) >= 0) break;
      const unsigned long long now = global_timer();
      const bool aborting = ld_volatile(&st->abort) != 0;
      if (v != last) { last = v; t_last = now; }
      if (aborting || now - t_last > A.watchdog_ns) {
        ErrSlot* e = (ErrSlot*)A.errs + blockIdx.x;
        e->task = t->task_id; e->counter = wc; e->value = v; e->target = target;
        if (!aborting) { raise_fault(st, FAULT_DEADLOCK, t->task_id, wc); atomicExch(&st->abort, 1u); }
        __threadfence();
        return false;
      }
    }
  }
  return true;                     // the acquire loads made the producers' writes visible
}

extern "C" __global__ void __launch_bounds__(AMK_NTHREADS, 1) amk_megakernel(const __grid_constant__ KernelArgs A) {
  // 1024-byte aligned: it follows the static variables, and with 272 more bytes of them (128-byte
  // aligned before by chance, then 16) the split-KV combine took 2 us longer a layer (NOTES v13a)
  extern __shared__ __align__(1024) char smem[];
  __shared__ TaskDesc s_task[2], s_sub;
  __shared__ TaskDesc s_subs[2][SLOT_SUBS];
  __shared__ __align__(8) void* s_ptrs[2][SLOT_PTRS];
  __shared__ void* s_sub_ptrs[MAX_PTRS];
  __shared__ int s_ok;
  __shared__ int s_queue[QUEUE_CAP];   // the task ids: no global load at each task's start
  const TaskDesc* tasks = (const TaskDesc*)A.tasks;
  const unsigned long long* ptrs = (const unsigned long long*)A.ptrs;
  const int* qt = (const int*)A.queue_tasks;
  const int* qo = (const int*)A.queue_off;
  KernelState* st = (KernelState*)A.state;
  const unsigned epoch = ld_volatile(&st->epoch);
  const int qb = qo[blockIdx.x], qe = qo[blockIdx.x + 1];
  if (threadIdx.x == AMK_INIT_THREAD) {
    amk_bw.dead = 0; amk_bw.watchdog_ns = A.watchdog_ns; amk_bw.st = st;
    mbar_init(&amk_pre_bar, 1); amk_pre_n = 0; amk_pre_pending = 0;
    mbar_init(&amk_comb_bar, 1); amk_comb_uses = 0;
    asm volatile("fence.mbarrier_init.release.cluster;\n\tfence.proxy.async.shared::cta;" ::: "memory");
  }
  if (qb < qe) slot_stage1(tasks + qt[qb], &s_task[0]);
  for (int j = threadIdx.x; j < qe - qb && j < QUEUE_CAP; j += NT) s_queue[j] = qt[qb + j];
  cp_async_wait<0>();
  __syncthreads();                 // the mbarriers set up, s_queue filled
  const RangeDesc* ranges = (const RangeDesc*)A.ranges;
  if (qb < qe) slot_stage2(s_task[0], tasks, ptrs, s_subs[0], s_ptrs[0], ranges, amk_pre_ranges[0]);
  bool aborted = false;
#ifdef AMK_PROFILE
  unsigned long long* prof = (unsigned long long*)A.prof;   // per queue entry: wait0, wait1, end, sm,
  // ready, then the start of each of the first AMK_PROF_STEPS FUSED steps (after the barrier
  // before it), then each step's AMK_MARK words (abi.PROF_WORDS)
#endif
  for (int i = qb; i < qe; i++) {
    const int slot = (i - qb) & 1;
    const TaskDesc& T = s_task[slot];
    const int next = i + 1 >= qe ? -1 : i + 1 - qb < QUEUE_CAP ? s_queue[i + 1 - qb] : qt[i + 1];
#ifdef AMK_PROFILE
    if (threadIdx.x == 0) prof[AMK_PROF_W * i] = global_timer();
#endif
    // This task's stage 2 (issued when the previous one ended) lands while thread 0 polls: the
    // poll needs only the descriptor (stage 1, waited for when the previous task ended).
    // (The barrier stays: without it ptxas spills more of the loop.)
    __syncthreads();
    const bool fits = T.n_ptr_all <= SLOT_PTRS && T.n_sub <= SLOT_SUBS;
    if (next >= 0) slot_stage1(tasks + next, &s_task[slot ^ 1]);   // lands during the poll
    else cp_async_commit();
    if (AMK_EARLY && threadIdx.x >= 32 && T.op == OP_ATTENTION_TILE && T.ip[P_ATTN_EARLY]) {
      cp_async_wait<1>();          // this task's stage 2 (its pointers: warps 1-15 copied them)
      asm volatile("bar.sync 1, %0;" :: "r"(NT - 32) : "memory");
      run_early(T, s_ptrs[slot], smem, st);
    }
    if (threadIdx.x == 0) {
      s_ok = wait_task(&T, A, epoch) ? 1 : 0;
      if (AMK_PRE) { amk_pre_slot = slot; amk_pre_pending = s_ok ? T.n_pre : 0; }   // the next task's
#ifdef AMK_PROFILE
      prof[AMK_PROF_W * i + 1] = global_timer();
      amk_mark_row = prof + AMK_PROF_W * i + AMK_PROF_MARK0;     // step 0's (a FUSED task's too)
#endif
    }
    // stage 2, and the next task's stage 1: no group left for the task but its early copies
    // (the test above repeated, not kept across the poll: a live flag spilled the loop; a
    // helper function for it changed the cubin, NOTES v61)
    if (AMK_EARLY && threadIdx.x >= 32 && T.op == OP_ATTENTION_TILE && T.ip[P_ATTN_EARLY]) cp_async_wait<2>();
    else cp_async_wait<0>();
    __syncthreads();
    if (!s_ok) { aborted = true; break; }
#ifdef AMK_PROFILE
    if (threadIdx.x == 0) prof[AMK_PROF_W * i + 4] = global_timer();
#endif
    if (T.op == OP_FUSED) {
      const RangeDesc* z = (const RangeDesc*)A.ranges + T.zero_begin;
      for (int r = 0; r < (AMK_ZERO ? T.n_zero : 0); r++) {
        const unsigned long long za = z[r].addr, zn = z[r].bytes;
        const unsigned long long n16 = (za & 15ull) == 0 ? zn >> 4 : 0;
        for (unsigned long long k = threadIdx.x; k < n16; k += NT) ((uint4*)za)[k] = make_uint4(0u, 0u, 0u, 0u);
        for (unsigned long long k = n16 * 16 + threadIdx.x; k < zn; k += NT) ((char*)za)[k] = 0;
      }
      for (int s = 0; s < T.n_sub; s++) {
#ifdef AMK_PROFILE
        if (threadIdx.x == 0)
          amk_mark_row = s < AMK_PROF_STEPS ? prof + AMK_PROF_W * i + AMK_PROF_MARK0 + s * AMK_PROF_MARKS : nullptr;
#endif
        if (fits) {
          if (s > 0 || T.n_zero > 0) __syncthreads();
#ifdef AMK_PROFILE
          if (threadIdx.x == 0 && s < AMK_PROF_STEPS) prof[AMK_PROF_W * i + AMK_PROF_HEAD + s] = global_timer();
#endif
          const TaskDesc& S = s_subs[slot][s];
          run_variant(S, &s_ptrs[slot][S.ptr_begin - T.ptr_begin], smem, st);
        } else {
          run_unstaged(tasks + T.sub_begin + s, ptrs, &s_sub, s_sub_ptrs, smem, st);
        }
      }
    } else {
      run_variant(T, s_ptrs[slot], smem, st);
    }
    const int out_counter = T.out_counter;   // the slot is refilled once everyone passes below
    cp_async_wait<0>();            // the task's own copies
    __syncthreads();
    if (threadIdx.x == 0 && out_counter >= 0)   // after the barrier: the CTA's writes, released
      red_release_add((unsigned*)A.counters + (long long)out_counter * AMK_CSTRIDE, 1u);
    if (AMK_PRE && threadIdx.x == 0) preload_next(smem);   // the next task's rows, unless issued
    if (next >= 0) slot_stage2(s_task[slot ^ 1], tasks, ptrs, s_subs[slot ^ 1], s_ptrs[slot ^ 1], ranges, amk_pre_ranges[slot ^ 1]);
#ifdef AMK_PROFILE
    if (threadIdx.x == 0) {
      unsigned smid; asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
      prof[AMK_PROF_W * i + 2] = global_timer(); prof[AMK_PROF_W * i + 3] = smid;
    }
#endif
  }
  cp_async_wait<0>();              // nothing may land in shared memory after the CTA exits
  if (AMK_PRE && threadIdx.x == 0 && amk_pre_n > 0) mbar_wait(&amk_pre_bar, (amk_pre_n - 1) & 1u);
  if (threadIdx.x == 0 && !aborted) {
    __threadfence();
    const unsigned old = atomicAdd(&st->done, 1u);
    if (old == (epoch + 1u) * gridDim.x - 1u) { __threadfence(); atomicExch(&st->epoch, epoch + 1u); }
  }
}
