"""allocate_counters: each consumer waits for exactly the tiles it reads (one counter per group
of producers it needs), never for a whole op."""
from pass_helpers import golden, run_passes

from small_programs import TWO_SMS, mlp_program
from amk.program.ir import InstructionKind as K
from amk.program.recipe import recipe_of

UNFUSED = TWO_SMS.with_(fuse=False)
GOLDEN = """
counters:
  c0 init=0
  c1 init=0
  c2 init=0
  c3 init=0
  c4 init=0
  c5 init=0
tasks:
  t0 EMBED in=(b4,b0) out=(b5) waits=() -> c0 {} # embed(params.embed) @ small_programs.py:N
  t1 RMSNORM in=(b5,b1) out=(b6) waits=(c0>=1) -> c1 {"eps": 1e-05} # rmsnorm(params.norm) @ small_programs.py:N
  t2 GEMV_TILE in=(b6,b2) out=(b7) waits=(c1>=1) -> c2 {"n_off": 0, "N_tile": 8, "K": 8} # linear(params.w) @ small_programs.py:N[tile 0/2]
  t3 GEMV_TILE in=(b6,b2) out=(b7) waits=(c1>=1) -> c3 {"n_off": 8, "N_tile": 8, "K": 8} # linear(params.w) @ small_programs.py:N[tile 1/2]
  t4 ADD in=(b7,b3) out=(b8) waits=(c2>=1) -> c4 {"n_off": 0, "N_tile": 8} # add(params.b) @ small_programs.py:N[tile 0/2]
  t5 ADD in=(b7,b3) out=(b8) waits=(c3>=1) -> c4 {"n_off": 8, "N_tile": 8} # add(params.b) @ small_programs.py:N[tile 1/2]
  t6 SAMPLE_ARGMAX in=(b8) out=(b9) waits=(c4>=2) -> c5 {} # argmax @ small_programs.py:N
"""


def test_allocate_counters_golden_text():
    # each add tile waits for its own GEMV tile (c2, c3), no longer for both (c2>=2)
    golden(run_passes(mlp_program(), UNFUSED, upto="allocate_counters")["allocate_counters"],
           GOLDEN, start="counters:")


def test_allocate_counters_fine_grained(stages):
    p = stages["allocate_counters"]
    assert len(p.counters) < len(p.tasks)
    by_counter = {}
    for t in p.tasks:
        by_counter.setdefault(t.out_counter, []).append(t)
    for t in p.tasks:
        for w in t.waits:        # a wait is for a whole group of earlier tasks
            members = by_counter[w.counter]
            assert w.threshold == len(members) and all(m.id < t.id for m in members)
    # the attention shards of kv group g wait for the q tile of its heads only, not all of q
    shards = [t for t in p.tasks if t.op is K.ATTENTION_TILE][:6]
    for s in shards:
        waited = [m for w in s.waits for m in by_counter[w.counter]]
        q_tiles = [m for m in waited if s.inputs[0] in m.outputs]     # writers of its q
        assert len(q_tiles) == 1
        rope = recipe_of(q_tiles[0]).steps[-1]
        assert rope.op is K.ROPE and rope.params["n_off"] == s.params["h_off"] * 8
