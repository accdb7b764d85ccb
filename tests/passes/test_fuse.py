"""fuse: producer -> consumer chains folded into FUSED tasks whose recipes recompute the producer
over scratch typed like the unfused buffer (bit-identical results)."""
import re

from pass_helpers import (OPTS, bindings, check_lines, golden, llama_program, run, run_passes,
                          same, text)

from small_programs import TWO_SMS, mlp_program
from amk.program.ir import BufferKind, DType, InstructionKind as K
from amk.program.recipe import recipe_of
from amk.program.regions import task_regions

GOLDEN = """
program mlp outputs=(b7)
buffers:
  b0 params.embed weight f32[12,8] source="params.embed"
  b1 params.norm weight f32[8] source="params.norm"
  b2 params.w weight f32[16,8] source="params.w"
  b3 params.b weight f32[1,16] source="params.b"
  b4 token io_input i32[1] source="token"
  b5 v5 activation f32[1,8]
  b6 v8 activation f32[1,16]
  b7 v9 io_output i32[1]
counters:
  c0 init=0
  c1 init=0
  c2 init=0
tasks:
  t0 EMBED in=(b4,b0) out=(b5) waits=() -> c0 {} # embed(params.embed) @ small_programs.py:N
  t1 FUSED in=(b5,b1,b2,b3) out=(b6) waits=(c0>=1) -> c1 {"recipe": {"steps": [{"op": "RMSNORM", "args": [{"in": 0}, {"in": 1}], "out": 0, "params": {"eps": 1e-05}, "out_shape": [1, 8], "out_dtype": "f32"}, {"op": "GEMV_TILE", "args": [{"s": 0}, {"in": 2}], "out": 1, "params": {"n_off": 0, "N_tile": 8, "K": 8}, "out_shape": [1, 16], "out_dtype": "f32"}, {"op": "ADD", "args": [{"s": 1}, {"in": 3}], "out": "final", "params": {"n_off": 0, "N_tile": 8}}]}} # add(params.b) @ small_programs.py:N[tile 0/2] +rmsnorm+gemv_tile
  t2 FUSED in=(b5,b1,b2,b3) out=(b6) waits=(c0>=1) -> c1 {"recipe": {"steps": [{"op": "RMSNORM", "args": [{"in": 0}, {"in": 1}], "out": 0, "params": {"eps": 1e-05}, "out_shape": [1, 8], "out_dtype": "f32"}, {"op": "GEMV_TILE", "args": [{"s": 0}, {"in": 2}], "out": 1, "params": {"n_off": 8, "N_tile": 8, "K": 8}, "out_shape": [1, 16], "out_dtype": "f32"}, {"op": "ADD", "args": [{"s": 1}, {"in": 3}], "out": "final", "params": {"n_off": 8, "N_tile": 8}}]}} # add(params.b) @ small_programs.py:N[tile 1/2] +rmsnorm+gemv_tile
  t3 SAMPLE_ARGMAX in=(b6) out=(b7) waits=(c1>=2) -> c2 {} # argmax @ small_programs.py:N
"""


def test_fuse_golden_text():
    golden(run_passes(mlp_program(), TWO_SMS, upto="fuse")["fuse"], GOLDEN)


def test_no_stage_prints_a_recipe_op_as_a_number(stages):
    for name, program in stages.items():
        t = text(program)
        assert not re.search(r'"op": \d', t), name
    assert '"op": "GEMV_TILE"' in text(stages["fuse"])


def test_fuse_text_and_dropped_buffers(stages):
    f = stages["fuse"]
    t = text(f)
    check_lines(t, [r"FUSED .*# rope.*\[tile 0/2\] \+rmsnorm\+gemv_tile",  # norm -> q tile -> rope
                    r"FUSED .*kv_update.*\+rmsnorm\+gemv_tile\+rope",  # k: one tile + rope + append
                    r"FUSED .*# add .*\[tile 0/2\] \+gemv_tile",         # o tile + residual
                    r"FUSED .*# silu_mul .*\[tile 3/4\]",                # norm + gate + up + silu
                    r"FUSED .*# add .*\+gemv_tile",                      # down tile + residual
                    r"FUSED .*lm_head.*\+rmsnorm", r"SAMPLE_ARGMAX"])
    assert not any(t.op in (K.RMSNORM, K.GEMV_TILE, K.SILU_MUL, K.ADD, K.ROPE) for t in f.tasks)
    # every buffer is used, ids are dense, intermediates kept their dtypes in the recipes
    used = {b for t in f.tasks for b in t.inputs + t.outputs} | set(f.outputs)
    assert [b.id for b in f.buffers] == list(range(len(f.buffers)))
    assert all(b.id in used for b in f.buffers if b.kind is BufferKind.ACTIVATION)
    silu = next(t for t in f.tasks if "silu_mul" in t.name)
    steps = recipe_of(silu).steps
    assert [s.op for s in steps] == [K.RMSNORM, K.GEMV_TILE, K.GEMV_TILE, K.SILU_MUL]
    assert steps[0].out_dtype is DType.F32 and steps[0].out_shape == (1, 32)


def test_fused_regions_kept_by_fuse_equal_task_regions(stages):
    from amk.passes.sync import regions_of
    f = stages["fuse"]
    for t in f.tasks:
        assert regions_of(t, f.buffers) == task_regions(t, f.buffers)


def test_fuse_off_and_rule_subset():
    p = run_passes(llama_program(), OPTS, upto="split_kv")["split_kv"]
    from amk.passes.fuse import fuse
    assert fuse(p, OPTS.with_(fuse=False)) is p
    only_norm = fuse(p, OPTS.with_(fuse_rules=(("RMSNORM", "GEMV_TILE"),)))
    ops = {t.op for t in only_norm.tasks}
    assert K.RMSNORM not in ops and K.ADD in ops and K.SILU_MUL in ops and K.FUSED in ops
    b = bindings(p)
    same(run(only_norm, b, order="random"), run(p, b))
