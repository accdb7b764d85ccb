"""bench/traffic.py: what each GEMV tile reads, weights against activations, without a GPU."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(tmp_path, *args):
    out = tmp_path / "traffic.json"
    r = subprocess.run([sys.executable, "bench/traffic.py", *args, "--json", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    return r, (json.loads(out.read_text()) if out.is_file() else None)


def test_a_batch_16_down_tile_reads_a_quarter_of_x_as_a_k_slice(tmp_path):
    r, rep = run(tmp_path, "--model", "llama-3.2-1b", "--batch", "1", "16", "--layers", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    by = {(b["batch"], row["kind"].split("+")[0]): row for b in rep for row in b["rows"]}
    d1, d16 = by[(1, "w_down")], by[(16, "w_down")]
    # 2048 rows of K 8192 in 128 tiles: 16 rows x 16 KB of bf16 weights a tile at batch 1; at
    # batch 16, 64 rows x a 2048-wide K slice (split_k, C = 4): as many weight bytes a tile
    assert d1["weight_kb"] == d16["weight_kb"] == 256.0 and d1["tasks_a_layer"] == d16["tasks_a_layer"] == 128
    # x: the 8192-wide silu output, bf16, read whole by every tile at batch 1 (plus the residual
    # rows it adds); at batch 16 a quarter of its 16 rows (64 KB, not 256: the SUM adds the
    # residual)
    assert 16.0 <= d1["act_kb"] < 16.1 and d16["act_kb"] == 64.0
    assert 0.19 < d16["act_share"] < 0.21
    # q/k/v at batch 16: the 16 rows of x (64 KB) against ~97-99 KB of weights a tile
    assert 60.0 < by[(16, "wq")]["act_kb"] < 68.0
    assert "w_down | 128 | 256.0 | 64.0 | 20% |" in r.stdout


def test_a_bad_batch_is_refused(tmp_path):
    r, rep = run(tmp_path, "--batch", "0")
    assert r.returncode == 2 and "--batch must be >= 1" in r.stderr and rep is None


def test_quantized_tiles_are_named_by_their_matrix_and_read_a_quarter_of_the_bytes(tmp_path):
    r, rep = run(tmp_path, "--model", "tiny-llama", "--batch", "1", "--quant", "int4")
    assert r.returncode == 0, r.stderr[-2000:]
    _, bf = run(tmp_path, "--model", "tiny-llama", "--batch", "1", "--layers", "2")
    q = {row["kind"].split("+")[0]: row for row in rep[0]["rows"]}
    b = {row["kind"].split("+")[0]: row for row in bf[0]["rows"]}
    assert {"wq", "w_down", "lm_head"} <= set(q) and set(q) == set(b)
    # down's K is 128, one group: half a byte a weight and an fp32 scale a row, against fp32's 4
    assert q["w_down"]["weight_kb"] / b["w_down"]["weight_kb"] == (0.5 + 4 / 128) / 4


def test_the_plan_columns_say_what_the_cuda_tiles_run(tmp_path):
    """The plan of each kind's tile, read off the CUDA lowering: the direct GEMV at batch 1; at
    batch 64 the tensor-core GEMV's passes (8 NB rows of x a pass), windows and ring stages as
    gemv_batch.plan gives them, and "SM reads" counting the weights once a pass."""
    from amk.backends.cuda import gemv_batch
    r, rep = run(tmp_path, "--model", "llama-3.2-1b", "--batch", "1", "64", "--layers", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    by = {(b["batch"], row["kind"].split("+")[0]): row for b in rep for row in b["rows"]}
    assert {row["plan"] for (b, _), row in by.items() if b == 1} == {"op_gemv_direct"}
    gu = by[(64, "w_up")]                      # gate/up: 2 x 64 rows of K 2048, with the norm
    p = gemv_batch.plan(64, 2048, 64, 2, 0, True)
    passes = -(-64 // (8 * p.nb))
    assert gu["passes"] == passes >= 2
    assert gu["plan"] == f"mma NB {p.nb}, {passes} pass(es), 1 window(s), ring {p.rd}"
    assert abs(gu["sm_kb"] - (gu["weight_kb"] * passes + gu["act_kb"])) < 1e-6
    assert "x in the ring" in by[(64, "w_down")]["plan"]
    assert "| mma NB" in r.stdout and "| SM reads" in r.stdout
