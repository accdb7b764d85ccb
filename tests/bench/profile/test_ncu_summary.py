"""bench/profile/ncu_summary.py maps Nsight Compute's per-instruction samples to device functions and
source lines: checked on a real megakernel (NVRTC with line info, no GPU), the SASS table of
ncu's source page stood in for by a CSV with samples on chosen instructions."""
import csv
import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("cuda.bindings")

from amk.backends.cuda import compile_source, examples, render  # noqa: E402
from amk.backends.cuda.compile import DEFAULT_OPTIONS  # noqa: E402

# Triton's package carries nvdisasm. Found without importing triton: an import here, at
# collection, would come before test_triton_interp sets TRITON_INTERPRET in the same worker.
_triton = importlib.util.find_spec("triton")
NVDISASM = (Path(_triton.origin).parent / "backends" / "nvidia" / "bin" / "nvdisasm" if _triton
            else Path("/nonexistent"))
spec = importlib.util.spec_from_file_location("ncu_summary", Path(__file__).parents[3] / "bench" / "profile" / "ncu_summary.py")
ns = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ns)


def test_functions_by_line_names_the_kernel_not_its_launch_bounds():
    src = render(examples.combined_program())
    fn = ns.functions_by_line(src)
    lines = src.splitlines()
    entry = next(i for i, l in enumerate(lines, 1) if "amk_megakernel(" in l)
    assert fn[entry + 3] == "amk_megakernel"
    body = next(i for i, l in enumerate(lines, 1) if "void op_argmax_parts(" in l)
    assert fn[body + 2] == "op_argmax_parts" and fn[body - 1] != "op_argmax_parts"


@pytest.mark.skipif(not NVDISASM.exists(), reason="needs Triton's nvdisasm")
def test_samples_land_on_the_function_of_their_instruction(tmp_path, capsys):
    src = render(examples.combined_program())
    res = compile_source(src, "sm_90a", DEFAULT_OPTIONS + ("-lineinfo",), use_cache=False)
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(res.cubin)
    (tmp_path / "k.cu").write_text(src)
    dis = subprocess.run([str(NVDISASM), "-c", "-gi", str(cubin)], capture_output=True, text=True,
                         check=True).stdout
    where = ns.line_of_offsets(dis)
    fn = ns.functions_by_line(src)
    # one instruction of op_rmsnorm and one of the kernel get 7 and 3 samples
    picks = {next(o for o, (ln, _) in sorted(where.items()) if fn[ln] == f): n
             for f, n in (("op_rmsnorm", 7), ("amk_megakernel", 3))}
    base = 0x7F0000000000
    cols = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
            "stall_long_sb", "stall_barrier"]
    with open(tmp_path / "sass.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "amk_megakernel"])
        w.writerow(cols)
        for off, (_, text) in sorted(where.items()):
            n = picks.get(off, 0)
            w.writerow([hex(base + off), text, n, 1, n, 0])
    assert ns.main([str(tmp_path / "sass.csv"), str(cubin), str(tmp_path / "k.cu"),
                    "--nvdisasm", str(NVDISASM)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"op_rmsnorm +7 +70\.0 .*long_sb 100", out)
    assert re.search(r"amk_megakernel +3 +30\.0", out)
