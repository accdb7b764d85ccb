"""bench/generate.py runs: its CPU measurement on a tiny preset (a prefill's cost in decode steps,
JSON written) and its GPU table printer on a made-up row (no GPU needed)."""
import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).parents[2] / "bench"


def _load():
    sys.path.insert(0, str(BENCH))            # it imports gpu_tool beside it
    try:
        spec = importlib.util.spec_from_file_location("bench_generate", BENCH / "generate.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


def test_cpu_mode_reports_the_prefill_in_decode_steps(tmp_path, capsys):
    gen = _load()
    out = tmp_path / "g.json"
    assert gen.main(["--cpu", "--model", "tiny-llama", "--prompt", "20", "--json", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row["model"] == "tiny-llama" and row["prompt"] == 20
    assert row["prefill_ms"] > 0 and row["decode_step_ms"] > 0
    assert abs(row["prefill_in_decode_steps"] - row["prefill_ms"] / row["decode_step_ms"]) < 1e-6
    assert "decode steps" in capsys.readouterr().out


def test_gpu_table_prints_every_measured_column(capsys):
    gen = _load()
    gen.print_table({"device": "X", "torch": "t", "prompt": 1000, "new": 256,
                     "amk_cuda_first_token_ms": 12.5, "amk_cuda_ms_per_token": 1.01,
                     "hf_static_ms_per_token": 1.9, "hf_error": "RuntimeError: boom"})
    out = capsys.readouterr().out
    assert "12.50" in out and "1.01" in out and "1.90" in out and "hf_error: RuntimeError" in out


def test_gpu_table_prints_the_prefill_chunks_tasks_and_replays(capsys):
    gen = _load()
    gen.print_table({"device": "X", "torch": "t", "prompt": 1000, "new": 256,
                     "amk_triton_prefill_chunks": [512, 512],
                     "amk_triton_prefill_chunk_tasks": {"512": 276},
                     "amk_triton_prefill_graph_captures": 1,
                     "amk_triton_prefill_replay_ms": {"512": 4.25}})
    out = capsys.readouterr().out
    assert "[512, 512]" in out and "{'512': 276}" in out and "4.25" in out
