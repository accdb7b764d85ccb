"""Every bench tool starts from the repository root as its docstring says (`python bench/X.py`,
`python bench/profile/X.py`): its imports and paths resolve, `--help` prints its docstring, and
a tool that needs a GPU says so and exits 2 on a machine without one."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
