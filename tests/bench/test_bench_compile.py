"""bench/compile.py: the cold and warm compile of a preset on a machine without a GPU; the warm
run hits the pass cache and builds the same kernel.cu, tables and program."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_compile_bench_times_a_cold_and_a_warm_compile(tmp_path):
    out = tmp_path / "compile.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}     # the tool finds amk
    r = subprocess.run([sys.executable, "bench/compile.py", "--models", "tiny-llama", "--no-nvrtc",
                        "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "tiny-llama" in r.stdout and "warm" in r.stdout
    (row,) = json.loads(out.read_text())
    cold, warm = row["cold"], row["warm"]
    assert not cold["pass_cache_hit"] and warm["pass_cache_hit"]
    for k in ("kernel_sha", "tables_sha", "program_sha", "variants"):
        assert cold[k] == warm[k]
    assert cold["variants"] >= 5           # embed, GEMVs, attention, argmax: one case each at least
    assert warm["cpu"]["total"] > 0 and set(cold["wall"]) >= {"trace", "passes", "lower", "render"}


def test_an_unknown_preset_is_refused():
    r = subprocess.run([sys.executable, "bench/compile.py", "--models", "gpt-5"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "unknown preset" in r.stderr
