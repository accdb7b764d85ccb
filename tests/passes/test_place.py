"""place: every task on one per-SM queue, in program order within a queue, balanced by cost."""
from pass_helpers import SMALL, golden, run_passes

from small_programs import TWO_SMS, mlp_program

GOLDEN = """
tasks:
  t0 EMBED in=(b4,b0) out=(b5) waits=() -> c0 {} # embed(params.embed) @ small_programs.py:N
  t1 FUSED in=(b5,b1,b2,b3) out=(b6) waits=(c0>=1) -> c1 {"recipe": {"steps": [{"op": "RMSNORM", "args": [{"in": 0}, {"in": 1}], "out": 0, "params": {"eps": 1e-05}, "out_shape": [1, 8], "out_dtype": "f32"}, {"op": "GEMV_TILE", "args": [{"s": 0}, {"in": 2}], "out": 1, "params": {"n_off": 0, "N_tile": 8, "K": 8}, "out_shape": [1, 16], "out_dtype": "f32"}, {"op": "ADD", "args": [{"s": 1}, {"in": 3}], "out": "final", "params": {"n_off": 0, "N_tile": 8}}]}} # add(params.b) @ small_programs.py:N[tile 0/2] +rmsnorm+gemv_tile
  t2 FUSED in=(b5,b1,b2,b3) out=(b6) waits=(c0>=1) -> c1 {"recipe": {"steps": [{"op": "RMSNORM", "args": [{"in": 0}, {"in": 1}], "out": 0, "params": {"eps": 1e-05}, "out_shape": [1, 8], "out_dtype": "f32"}, {"op": "GEMV_TILE", "args": [{"s": 0}, {"in": 2}], "out": 1, "params": {"n_off": 8, "N_tile": 8, "K": 8}, "out_shape": [1, 16], "out_dtype": "f32"}, {"op": "ADD", "args": [{"s": 1}, {"in": 3}], "out": "final", "params": {"n_off": 8, "N_tile": 8}}]}} # add(params.b) @ small_programs.py:N[tile 1/2] +rmsnorm+gemv_tile
  t3 SAMPLE_ARGMAX in=(b6) out=(b7) waits=(c1>=2) -> c2 {} # argmax @ small_programs.py:N
queues:
  q0 (t0,t2)
  q1 (t1,t3)
"""


def test_place_golden_text():
    # the two fused tiles (the expensive tasks) run side by side on the two SMs
    golden(run_passes(mlp_program(), TWO_SMS)["place"], GOLDEN, start="tasks:")


def test_place_queues(stages):
    from amk.passes.place import placement_balance
    p = stages["place"]
    assert len(p.queues) == SMALL.num_sms
    flat = sorted(i for q in p.queues for i in q)
    assert flat == list(range(len(p.tasks)))
    assert all(list(q) == sorted(q) for q in p.queues)
    assert 1.0 <= placement_balance(p) < 1.5
