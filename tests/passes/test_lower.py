"""lower: graph IR -> Program, one task per op, one buffer per value, one counter per task;
each task waits (threshold 1) on the writers of what it reads."""
import inspect

from pass_helpers import golden

import small_programs
from small_programs import mlp_program

GOLDEN = """
program mlp outputs=(b9)
buffers:
  b0 params.embed weight f32[12,8] source="params.embed"
  b1 params.norm weight f32[8] source="params.norm"
  b2 params.w weight f32[16,8] source="params.w"
  b3 params.b weight f32[1,16] source="params.b"
  b4 token io_input i32[1] source="token"
  b5 v5 activation f32[1,8]
  b6 v6 activation f32[1,8]
  b7 v7 activation f32[1,16]
  b8 v8 activation f32[1,16]
  b9 v9 io_output i32[1]
counters:
  c0 init=0
  c1 init=0
  c2 init=0
  c3 init=0
  c4 init=0
tasks:
  t0 EMBED in=(b4,b0) out=(b5) waits=() -> c0 {} # embed(params.embed) @ small_programs.py:N
  t1 RMSNORM in=(b5,b1) out=(b6) waits=(c0>=1) -> c1 {"eps": 1e-05} # rmsnorm(params.norm) @ small_programs.py:N
  t2 GEMV_TILE in=(b6,b2) out=(b7) waits=(c1>=1) -> c2 {"n_off": 0, "N_tile": 16, "K": 8} # linear(params.w) @ small_programs.py:N
  t3 ADD in=(b7,b3) out=(b8) waits=(c2>=1) -> c3 {} # add(params.b) @ small_programs.py:N
  t4 SAMPLE_ARGMAX in=(b8) out=(b9) waits=(c3>=1) -> c4 {} # argmax @ small_programs.py:N
"""


def test_lower_golden_text():
    golden(mlp_program(), GOLDEN)


def test_task_names_point_at_the_users_source_lines():
    lines, first = inspect.getsourcelines(small_programs.mlp_step)
    where = {s.split("=")[0].split("(")[0].strip().split(".")[-1]: first + i
              for i, s in enumerate(lines) if "ops." in s}
    names = [t.name for t in mlp_program().tasks]
    assert names[0] == f"embed(params.embed) @ small_programs.py:{where['x']}"
    assert names[1] == f"rmsnorm(params.norm) @ small_programs.py:{where['h']}"
    assert names[2:4] == [f"linear(params.w) @ small_programs.py:{where['y']}",
                          f"add(params.b) @ small_programs.py:{where['y']}"]
