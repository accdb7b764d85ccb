"""bench/shape_scan.py: shapes that are not presets, compiled for sm_90a without a GPU, with
ptxas's spills per step, for this tree and another beside it."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("cuda.bindings")


def run(tmp_path, *args):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = tmp_path / "scan.json"
    r = subprocess.run([sys.executable, "bench/shape_scan.py", *args, "--json", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    return r, (json.loads(out.read_text()) if out.is_file() else None)


def test_a_shape_builds_and_its_spills_are_read_for_this_tree_and_a_base(tmp_path):
    # the base: this tree's amk/ again, as another checkout would be
    base = tmp_path / "base"
    base.mkdir()
    (base / "amk").symlink_to(ROOT / "amk")
    r, rep = run(tmp_path, "--shapes", "h576-gqa3", "--fmts", "bf16", "--batches", "1", "--base", str(base))
    assert r.returncode == 0, r.stderr[-2000:]
    (row,) = rep["rows"]
    (other,) = rep["base"]
    assert row["ok"] and other["ok"] and (row["shape"], row["fmt"], row["batch"]) == ("h576-gqa3", "bf16", 1)
    assert "amk_megakernel" not in row["spills"]          # this shape's scheduler spills nothing
    assert row["spills"] == other["spills"]
    assert "h576-gqa3 | bf16 | 1 | no spill | no spill" in r.stdout


def test_a_missing_base_and_a_bad_batch_are_refused(tmp_path):
    r, _ = run(tmp_path, "--shapes", "h576-gqa3", "--base", str(tmp_path / "nowhere"))
    assert r.returncode == 2 and "no amk/ package" in r.stderr
    r, _ = run(tmp_path, "--batches", "0")
    assert r.returncode == 2 and "positive" in r.stderr
