"""bench/sass.py: the step's machine code read on a machine without a GPU. The readers on small
SASS texts whose answer is known, then the tool on the tiny preset."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import sass  # noqa: E402


def sass_text(*lines):
    return "\n".join(f"        /*{16 * k:04x}*/                   {ln} ;   /* 0x0 */" for k, ln in enumerate(lines))


# combine_direct before v47: each m load predicated into the register of the running max
CHAIN = sass_text("MOV R9, 0xff800000", "@P0 LDG.E R9, desc[UR4][R2.64]", "FMNMX R10, R9, -INF , !PT",
                  "@P1 LDG.E R10, desc[UR4][R4.64+0x4]", "FMNMX R11, R10, R9, !PT",
                  "@P2 LDG.E R11, desc[UR4][R6.64+0x8]", "FMNMX R12, R11, R10, !PT",
                  "@P3 LDG.E R12, desc[UR4][R2.64+0xc]", "FMNMX R13, R12, R11, !PT", "EXIT")
TOGETHER = sass_text("@P0 LDG.E R9, desc[UR4][R2.64]", "@P1 LDG.E R10, desc[UR4][R4.64+0x4]",
                     "@P2 LDG.E R11, desc[UR4][R6.64+0x8]", "@P3 LDG.E R12, desc[UR4][R2.64+0xc]",
                     "FMNMX R13, R9, R10, !PT", "FMNMX R13, R13, R11, !PT", "FMNMX R13, R13, R12, !PT", "EXIT")


def test_a_chain_of_dependent_loads_is_found_and_loads_issued_together_are_not():
    assert sass.load_chains(sass.parse(CHAIN)) == [(0x10, 4)]
    assert sass.load_chains(sass.parse(TOGETHER)) == []


def test_an_address_from_a_load_makes_a_chain_but_a_branch_ends_it():
    pointer_chase = sass_text("LDG.E.64 R2, desc[UR4][R2.64]", "LDG.E.64 R4, desc[UR4][R2.64]",
                              "LDG.E.64 R6, desc[UR4][R4.64]", "LDG.E R8, desc[UR4][R6.64]", "EXIT")
    assert sass.load_chains(sass.parse(pointer_chase)) == [(0x0, 4)]
    broken = sass_text("LDG.E.64 R2, desc[UR4][R2.64]", "LDG.E.64 R4, desc[UR4][R2.64]", "BRA 0x40",
                       "LDG.E.64 R6, desc[UR4][R4.64]", "LDG.E R8, desc[UR4][R6.64]", "EXIT")
    assert sass.load_chains(sass.parse(broken), min_len=2) == [(0x0, 2), (0x30, 2)]


def test_opcodes_permute_blocks_and_spills_are_counted():
    text = sass_text(*(["PRMT R1, R2, 0x7440, R3", "FFMA R4, R1, R5, R4"] * 32), "LDS.128 R8, [R9]",
                     "LD.E.128 R8, desc[UR4][R10.64]", "BRA 0x0")
    instrs = sass.parse(text)
    assert sass.opcode_counts(instrs) == {"LDG": 0, "LDS": 1, "LD": 1, "PRMT": 32, "HMMA": 0, "FFMA": 32}
    assert sass.permute_blocks(instrs) == [round(67 / 32, 2)]
    log = ("ptxas info    : Function properties for amk_megakernel\n"
           "ptxas         .     88 bytes stack frame, 36 bytes spill stores, 84 bytes spill loads\n"
           "ptxas info    : Function properties for _Z7op_normv\n"
           "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n")
    assert sass.spills(log) == {"amk_megakernel": "88 bytes stack frame, 36 bytes spill stores, 84 bytes spill loads"}


def test_loops_are_found_by_their_back_branches_with_their_local_memory():
    """An outer loop whose spill reload sits outside the inner HMMA loop (NOTES v53's sweep loop):
    the inner loop has no local memory, the outer one has both accesses; a forward branch is no
    loop, nor the branch to itself after EXIT."""
    text = sass_text("MOV R1, c[0x0][0x28]", "LDL R2, [R1+0x24]", "HMMA.16816.F32.BF16 R4, R8, R12, R4",
                     "LDS.128 R8, [R9]", "@P0 BRA 0x20", "STL [R1+0x24], R2", "@P1 BRA 0x10", "BRA 0x90", "EXIT",
                     "BRA 0x90")
    assert sass.loops(sass.parse(text)) == [
        {"start": 0x10, "end": 0x60, "instructions": 6, "hmma": 1, "local": 2, "innermost": False},
        {"start": 0x20, "end": 0x40, "instructions": 3, "hmma": 1, "local": 0, "innermost": True}]


@pytest.mark.parametrize("quant", [None, "int4"])
def test_the_tool_reads_the_tiny_presets_machine_code(tmp_path, quant):
    pytest.importorskip("cuda.bindings")
    try:
        sass.cuobjdump()
    except SystemExit:
        pytest.skip("no cuobjdump (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cmd = [sys.executable, "bench/sass.py", "--model", "tiny-llama", "--max-seq", "256", "--out", str(tmp_path)]
    r = subprocess.run(cmd + (["--quant", quant] if quant else []), cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads((tmp_path / "sass.json").read_text())
    assert (tmp_path / "kernel.cubin").read_bytes()[:4] == b"\x7fELF"
    assert "Function : amk_megakernel" in (tmp_path / "kernel.sass").read_text()
    assert rep["instructions"] > 1000 and len(rep["md5"]) == 32
    assert rep["opcodes"]["LDG"] > 0 and rep["opcodes"]["LDS"] > 0
    # int4: a byte permute a weight, in blocks of 32 or more (the GEMV loops); bf16 has a few
    assert (rep["opcodes"]["PRMT"] > 100) == (quant == "int4")
    assert bool(rep["permute_blocks"]) == (quant == "int4")
    assert rep["model"] in r.stdout and "loops with local memory" in r.stdout
    # the real cubin's loops: found by their back branches (the GEMV loops: innermost ones
    # among them), the report's loops with local memory among them
    lps = sass.loops(sass.parse((tmp_path / "kernel.sass").read_text()))
    assert any(lp["innermost"] and lp["instructions"] > 10 for lp in lps)
    assert rep["loops_with_local_memory"] == [lp for lp in lps if lp["local"]]
    # code bytes by device function: every function's once, the scheduler's the entry's rest,
    # together the kernel's text (16 bytes an instruction)
    fb = rep["function_bytes"]
    assert fb["amk_megakernel (scheduler)"] > 0 and any(k.startswith("op_gemv_") for k in fb)
    assert sum(fb.values()) == 16 * rep["instructions"] and "code bytes by device function" in r.stdout


def test_an_unknown_preset_is_refused(tmp_path):
    r = subprocess.run([sys.executable, "bench/sass.py", "--model", "gpt-9", "--out", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "unknown preset 'gpt-9'" in (r.stderr + r.stdout)
