"""Every bench tool starts from the repository root as its docstring says (`python bench/X.py`,
`python bench/profile/X.py`): its imports and paths resolve, `--help` prints its docstring, and
a tool that needs a GPU says so and exits 2 on a machine without one."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
# the tools: every script under bench/ (the helpers beside them have no __main__)
TOOLS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "bench").rglob("*.py")
               if 'if __name__ == "__main__":' in p.read_text())
NEEDS_GPU = [t for t in TOOLS if "have_gpu(__file__)" in (ROOT / t).read_text()]


def _run(tool: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # the tool finds amk itself
    return subprocess.run([sys.executable, tool, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_benchmarks_and_profilers_are_found():
    assert {"bench/decode.py", "bench/ab.py", "bench/profile/profile_decode.py",
            "bench/profile/ncu_step.py", "bench/profile/ncu_summary.py"} <= set(TOOLS)
    assert {"bench/decode.py", "bench/profile/profile_decode.py", "bench/profile/ncu_step.py"} <= set(NEEDS_GPU)


@pytest.mark.parametrize("tool", TOOLS)
def test_help_prints_the_tools_docstring(tool):
    r = _run(tool, "--help")
    assert r.returncode == 0, r.stderr
    first = (ROOT / tool).read_text().split('"""')[1].splitlines()[0]
    assert first.split(":")[0] in " ".join(r.stdout.split()), r.stdout


@pytest.mark.parametrize("tool", NEEDS_GPU)
def test_without_a_gpu_the_tool_says_so(tool):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    r = _run(tool)
    assert r.returncode == 2, r.stderr
    assert f"{tool} needs a CUDA GPU" in r.stderr


def test_decode_refuses_a_bad_shape_override_before_it_needs_a_gpu():
    r = _run("bench/decode.py", "--set", "hidden=x")
    assert r.returncode == 2 and "hidden takes a int" in r.stderr, r.stderr


def test_the_decode_floor_counts_quantized_weights_and_an_untied_embedding_row():
    """bench/decode.py's floor: a QuantizedWeight's codes and scales count (a walk over dicts
    and lists alone dropped them); an embedding the LM head does not share counts only its
    looked-up rows; a tied one once, whole."""
    import sys
    from dataclasses import replace
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from decode import weight_bytes
    from amk.models.presets import LLAMA_3_2_1B, random_model
    cfg = replace(LLAMA_3_2_1B, n_layers=1, vocab=512, hidden=256, n_heads=4, n_kv_heads=2, ffn=512,
                  max_seq=64)
    m = random_model(cfg, device="cpu")
    p = m.params
    tensors = [p["embed"], p["norm"], p["inv_freq"]] + [t for layer in p["layers"] for t in layer.values()]
    assert weight_bytes(p) == sum(t.numel() * t.element_size() for t in tensors)    # lm_head is embed
    m.quantize("int8")
    q = m.params
    row = q["embed"].shape[1] * q["embed"].element_size()
    def nbytes(t):
        return 0 if t is None else t.numel() * t.element_size()
    lin = [w for layer in q["layers"] for w in layer.values() if not isinstance(w, torch.Tensor)] + [q["lm_head"]]
    codes = sum(nbytes(w.q) + nbytes(w.scales) + nbytes(w.zeros) for w in lin)
    rest = sum(nbytes(t) for layer in q["layers"] for t in layer.values() if isinstance(t, torch.Tensor))
    rest += nbytes(q["norm"]) + nbytes(q["inv_freq"])
    assert codes > 0 and weight_bytes(q, batch=3) == codes + rest + 3 * row
