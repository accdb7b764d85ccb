"""tile: GEMV/GEMM tasks split into output-column tiles sharing one counter (consumers wait for
all of them), and the elementwise ops reading a tiled GEMV tiled alike."""
from pass_helpers import SMALL, check_lines, golden, llama_program, run_passes, text

from small_programs import TWO_SMS, mlp_program
from amk.passes.options import PassOptions
from amk.passes.tile import tile
from amk.program.ir import InstructionKind as K

GOLDEN = """
tasks:
  t0 EMBED in=(b4,b0) out=(b5) waits=() -> c0 {} # embed(params.embed) @ small_programs.py:N
  t1 RMSNORM in=(b5,b1) out=(b6) waits=(c0>=1) -> c1 {"eps": 1e-05} # rmsnorm(params.norm) @ small_programs.py:N
  t2 GEMV_TILE in=(b6,b2) out=(b7) waits=(c1>=1) -> c2 {"n_off": 0, "N_tile": 8, "K": 8} # linear(params.w) @ small_programs.py:N[tile 0/2]
  t3 GEMV_TILE in=(b6,b2) out=(b7) waits=(c1>=1) -> c2 {"n_off": 8, "N_tile": 8, "K": 8} # linear(params.w) @ small_programs.py:N[tile 1/2]
  t4 ADD in=(b7,b3) out=(b8) waits=(c2>=2) -> c3 {"n_off": 0, "N_tile": 8} # add(params.b) @ small_programs.py:N[tile 0/2]
  t5 ADD in=(b7,b3) out=(b8) waits=(c2>=2) -> c3 {"n_off": 8, "N_tile": 8} # add(params.b) @ small_programs.py:N[tile 1/2]
  t6 SAMPLE_ARGMAX in=(b8) out=(b9) waits=(c3>=2) -> c4 {} # argmax @ small_programs.py:N
"""


def test_tile_golden_text():
    golden(tile(mlp_program(), TWO_SMS), GOLDEN, start="tasks:")


def test_tile_text(stages):
    t = text(stages["tile"])
    # wq [32,32] in two 16-column tiles sharing one counter; the rmsnorm before them waits once
    check_lines(t, [r"RMSNORM .* -> c(\d+)",
                    r'GEMV_TILE in=\(b\d+,b5\) .*waits=\(c\d+>=1\) -> c(\d+) .*"n_off": 0, "N_tile": 16',
                    r'GEMV_TILE in=\(b\d+,b5\) .*"n_off": 16, "N_tile": 16',
                    r'ROPE .*waits=\(c\d+>=2\).*"n_off": 0, "N_tile": 16',   # rope per kv group
                    r'ROPE .*"n_off": 16, "N_tile": 16',
                    r"SILU_MUL .*waits=\(c\d+>=4,c\d+>=4\).*\"n_off\": 48"])
    lo = stages["lower"]
    assert len(stages["tile"].tasks) > len(lo.tasks)


def test_tile_width_from_options():
    p = llama_program()
    wide = run_passes(p, PassOptions(target=SMALL, tile_n=64), upto="tile")["tile"]
    gate = [t for t in wide.tasks if t.op is K.GEMV_TILE and "w_gate" in t.name]
    assert [t.params["N_tile"] for t in gate] == [64, 64]          # 64 wide: one tile per layer
    narrow = run_passes(p, PassOptions(target=SMALL, tile_n=16), upto="tile")["tile"]
    gate = [t for t in narrow.tasks if t.op is K.GEMV_TILE and "layers.0.w_gate" in t.name]
    assert [(t.params["n_off"], t.params["N_tile"]) for t in gate] == [(0, 16), (16, 16),
                                                                         (32, 16), (48, 16)]
