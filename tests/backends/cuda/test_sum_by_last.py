"""sum_by_last (amk/backends/cuda/sum_by_last.py) on the CPU: a K-split GEMV's SUM leaves its
queue and the last of its slices runs it, read off the lowered tables; where the rule does
not hold the SUM stays a task. The GPU check against the reference VM is
tests/gpu/test_mma_gemv_gpu.py::test_a_step_with_down_split_over_k_matches_reference_vm."""
from dataclasses import replace

import pytest

pytest.importorskip("cuda.bindings")

from amk.program.ir import InstructionKind as K, Wait
from amk.backends.cuda import abi, compile_source, render
from amk.backends.cuda.codegen import render_lowered
from amk.backends.cuda.lower import fold_program, lower_program
from amk.backends.cuda.options import CudaOptions
from amk.models.presets import LLAMA_3_2_1B, random_model


def _step(batch: int, k_split: int | None = None):
    import amk
    from amk.passes.options import PassOptions
    m = random_model(replace(LLAMA_3_2_1B, max_seq=1088, n_layers=2), device="meta")
    f = amk.jit(m.fn, backend="cuda", options=PassOptions.for_backend("cuda").with_(k_split=k_split))
    return f.lower(*m.example_args(batch)).program


def _sums(prog):
    return [t for t in prog.tasks if t.name.endswith("+sum")]


def test_the_last_slice_runs_each_sum_of_the_split_down_projection():
    prog = _step(1, k_split=4)
    low = lower_program(prog)
    sums = _sums(prog)
    assert len(sums) == 2 * 32                                  # a row tile a layer
    queued = {j for q in low.queues for j in q}
    assert len(queued) == len(prog.tasks) - len(sums)
    then = low.tasks["ip"][:low.n_program_tasks, abi.ip_index("GEMV", "THEN")] - 1
    then[[int(d["op"]) not in (int(K.GEMV_TILE), int(K.GEMM_TILE)) for d in low.tasks[:low.n_program_tasks]]] = -1
    for s in sums:
        assert s.id not in queued
        (w,) = s.waits
        slices = [t.id for t in prog.tasks if t.out_counter == w.counter]
        assert len(slices) == w.threshold == 4
        assert all("k_off" in prog.tasks[p].params for p in slices)
        assert all(int(then[p]) == s.id for p in slices)
        # its one step is op_sum over every slice's partials and the residual, no zeroing first
        d = low.tasks[s.id]
        assert int(d["op"]) == int(K.SUM) and int(d["n_sub"]) == 0
        assert low.variants[int(d["variant"])].fn == "op_sum"
    assert int((then >= 0).sum()) == 4 * len(sums)
    src = render_lowered(low)
    assert "#define AMK_THEN 1" in src
    assert compile_source(src, "sm_90a", use_cache=False).cubin


@pytest.mark.parametrize("batch", [1, 16])
def test_a_step_without_a_one_row_split_is_unchanged(batch):
    """No K split at batch 1, or the split SUMs of batch 16 (their own stage: NOTES v50): every
    task queued, no descriptor names a task, the path compiled out (AMK_THEN 0: the
    scheduler's machine code as before)."""
    prog = _step(batch)
    assert (batch == 16) == any("k_off" in t.params for t in prog.tasks)
    low = lower_program(prog)
    assert sorted(j for q in low.queues for j in q) == list(range(len(prog.tasks)))
    gemv = [int(d["op"]) in (int(K.GEMV_TILE), int(K.GEMM_TILE)) for d in low.tasks]
    assert (low.tasks["ip"][gemv, abi.ip_index("GEMV", "THEN")] == 0).all()
    assert "#define AMK_THEN 0" in render(prog)


def test_a_sum_whose_counter_another_task_waits_on_stays_a_task():
    prog = _step(1, k_split=4)
    s = _sums(prog)[0]
    (w,) = s.waits
    # a later task that also waits for the slices: the SUM is no longer their counter's only
    # waiter, so the slices keep their plain release and the SUM its queue slot
    late = prog.tasks[-1]
    tasks = list(prog.tasks)
    tasks[late.id] = late.with_(waits=late.waits + (Wait(w.counter, w.threshold),))
    folded = fold_program(prog.with_(tasks=tuple(tasks)))
    assert s.id in {j for q in folded.queues for j in q}
    assert all(v != s.id for v in folded.then.values())
    assert len(set(folded.then.values())) == len(_sums(prog)) - 1
