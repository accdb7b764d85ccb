"""plan_memory: activations whose lifetimes do not overlap share one buffer (same shape and
dtype only, and a KV append's rows only with other appends' rows); the tasks stay, their buffer
ids change."""
import pytest
from pass_helpers import golden

from small_programs import chain_program
from amk.passes.options import PassOptions
from amk.passes.plan_memory import plan_memory
from amk.program.ir import BufferKind

GOLDEN = """
program chain outputs=(b3)
buffers:
  b0 x io_input f32[1,8] source="x"
  b1 v1 activation f32[1,8]
  b2 v2 activation f32[1,8]
  b3 v4 io_output f32[1,8]
counters:
  c0 init=0
  c1 init=0
  c2 init=0
  c3 init=0
tasks:
  t0 GELU in=(b0) out=(b1) waits=() -> c0 {} # gelu @ small_programs.py:N
  t1 GELU in=(b1) out=(b2) waits=(c0>=1) -> c1 {} # gelu @ small_programs.py:N
  t2 GELU in=(b2) out=(b1) waits=(c1>=1) -> c2 {} # gelu @ small_programs.py:N
  t3 GELU in=(b1) out=(b3) waits=(c2>=1) -> c3 {} # gelu @ small_programs.py:N
"""


def test_plan_memory_golden_text():
    # v1 is dead once the second gelu read it: the third gelu writes it again, and v3 is gone
    golden(plan_memory(chain_program(), PassOptions()), GOLDEN)


def test_plan_memory_reuses_activations(stages):
    before, after = stages["fuse"], stages["plan_memory"]
    acts = lambda p: [b for b in p.buffers if b.kind is BufferKind.ACTIVATION]  # noqa: E731
    assert len(acts(after)) < len(acts(before))
    assert sum(b.nbytes for b in acts(after)) < sum(b.nbytes for b in acts(before))
    # plan_memory keeps the tasks: map each old output buffer to its new one; some new buffer
    # holds several old values (reuse), and only same-shape, same-dtype values share
    merged = {}
    for t0, t1 in zip(before.tasks, after.tasks):
        for b0, b1 in zip(t0.outputs, t1.outputs):
            merged.setdefault(b1, set()).add(b0)
    assert any(len(v) > 1 for v in merged.values())
    for b1, olds in merged.items():
        assert {(before.buffers[b].shape, before.buffers[b].dtype) for b in olds} == \
            {(after.buffers[b1].shape, after.buffers[b1].dtype)}


def test_a_kv_appends_rows_share_storage_only_with_other_appends_rows():
    """Qwen3-0.6B's k and v rows (8 kv heads x 128) are as wide as its hidden state (1024):
    sharing by shape alone gave the o and down tiles the storage the layer's deferred KV
    appends still read, so they waited for those appends (NOTES v32). Now only the next layer's
    k / v projection reuses it (off the critical path, as at any other shape), and the step
    computes what it did."""
    from dataclasses import replace
    from pass_helpers import TINY, bindings, llama_program, run, run_passes, same
    from amk.passes.fuse import root_op
    from amk.program.ir import InstructionKind as K
    cfg = replace(TINY, n_layers=3, hidden=16, n_heads=4, n_kv_heads=2, head_dim=8)
    assert cfg.n_kv_heads * cfg.head_dim == cfg.hidden
    p = llama_program(cfg)
    prog = run_passes(p, PassOptions.for_backend("cuda"), upto="place")["place"]
    by_counter = {t.out_counter for t in prog.tasks if root_op(t) is K.KV_APPEND}
    waiters = [t for t in prog.tasks if any(w.counter in by_counter for w in t.waits)]
    # the next layer's k / v projection tiles, never the residual adds (o, down)
    assert waiters and {root_op(t) for t in waiters} == {K.GEMV_TILE}, [t.name for t in waiters]
    b = bindings(p, pos=5)
    same(run(prog, b), run(p, b))


@pytest.mark.parametrize("preset", ["LLAMA_3_2_1B", "QWEN3_0_6B", "LLAMA_3_8B"])
def test_no_residual_tile_of_a_preset_waits_for_a_kv_append(preset):
    """The presets on the cuda options at a user's cache: the appends run after the attention,
    off the critical path; only the next layer's k / v projections (the same storage) may wait
    for them, never an o or down tile (Qwen3's did, NOTES v32)."""
    from dataclasses import replace
    from pass_helpers import llama_program, run_passes
    from amk.models import presets
    from amk.passes.fuse import root_op
    from amk.program.ir import InstructionKind as K
    cfg = replace(getattr(presets, preset), n_layers=3, vocab=256, max_seq=8192,
                  qk_norm=False)            # (pass_helpers' params have no q/k norms)
    prog = run_passes(llama_program(cfg), PassOptions.for_backend("cuda"), upto="place")["place"]
    by_counter = {t.out_counter for t in prog.tasks if root_op(t) is K.KV_APPEND}
    waiters = {root_op(t) for t in prog.tasks if any(w.counter in by_counter for w in t.waits)}
    assert waiters <= {K.GEMV_TILE}, waiters


def test_renamed_regions_are_the_ones_task_regions_gives():
    """After plan_memory the regions memo holds task_regions' regions of the renamed tasks
    (computed, not renamed: an entry of the program before serves only a task whose operands
    have the same shapes), so the final proof, which computes its own, finds the last resync's
    scan of equal regions (renamed ones could sort in another order: 2 tasks of tiny-llama,
    1920 of Llama-3-8B, whose proof scanned the whole program again)."""
    import amk
    from amk.models.model import Model
    from amk.models.presets import TINY_LLAMA, random_params
    from amk.passes.pipeline import run_pipeline
    from amk.passes.sync import forget, regions_of
    from amk.program.regions import task_regions
    model = Model(TINY_LLAMA, random_params(TINY_LLAMA, device="meta"))
    low = amk.jit(model.fn, backend="cuda", donate=("kv",)).lower(*model.example_args(1))
    fused = run_pipeline(low.graph, low.options, stop_after="fuse")["fuse"]
    forget()
    try:
        after = plan_memory(fused, low.options)
        memo = [regions_of(t, after.buffers) for t in after.tasks]
    finally:
        forget()
    assert memo == [task_regions(t, after.buffers) for t in after.tasks]


def test_regions_memo_serves_another_buffers_only_at_the_same_shapes():
    """regions_of's memo has no buffers in its key: an entry made over other buffers serves a
    task with the same params and operand ids only where those operands have the same shapes."""
    from amk.passes.sync import forget, regions_of, remember_regions
    from amk.program.ir import Buffer, DType, InstructionKind as K, Task
    from amk.program.regions import task_regions

    def bufs(width):
        return tuple(Buffer(i, f"b{i}", BufferKind.ACTIVATION, DType.F32, (1, width))
                     for i in range(3))

    task = Task(0, K.ADD, (0, 1), (2,), {"n_off": 8, "N_tile": 8}, (), 0, "")
    narrow, same, wide = bufs(16), bufs(16), bufs(32)
    forget()
    try:
        seeded = ([], [])                    # a seed that no computation would give
        remember_regions(task, narrow, seeded)
        assert regions_of(task, narrow) is seeded
        assert regions_of(task, same) is seeded            # another tuple, the same shapes
        assert regions_of(task, wide) == task_regions(task, wide) != seeded
    finally:
        forget()


def test_runs_of_equal_operands_are_consecutive_only():
    """plan_memory reads first and last touches per run of tasks with equal operands: a run
    ends where the inputs or the outputs change, and a later task with the same operands
    starts another."""
    from amk.passes.plan_memory import _runs
    from amk.program.ir import InstructionKind as K, Task

    def task(i, ins, outs):
        return Task(i, K.ADD, ins, outs, {}, (), 0, "")

    tasks = [task(0, (0, 1), (2,)), task(1, (0, 1), (2,)), task(2, (0, 1), (3,)),
             task(3, (2, 1), (3,)), task(4, (0, 1), (2,)), task(5, (0, 1), (2,))]
    assert _runs(tasks) == [(0, 2), (2, 3), (3, 4), (4, 6)]
    assert _runs([]) == []
