"""The default batch-1 float GEMV (op_gemv_direct, templates/gemv.cuh) on the CPU: which GEMVs
take it, the gate/up + silu pairing in either argument order, the residual fold, and that it
compiles for sm_90a without spilling (a spilled weight register serialises the loads)."""
import copy
import re

import pytest

pytest.importorskip("cuda.bindings")

from amk.program.ir import InstructionKind as K
from amk.backends.cuda import abi, compile_source, examples, render
from amk.backends.cuda.lower import lower_program


@pytest.fixture(autouse=True)
def _defaults(monkeypatch):
    for k in ("AMK_GEMV_PIPE", "AMK_GEMV_RING", "AMK_CTAS_PER_SM"):
        monkeypatch.delenv(k, raising=False)


def _variants(case_name: str) -> list[str]:
    case = next(c for c in examples.cases() if c.name == case_name)
    return lower_program(case.program).variants


def test_float_batch1_gemvs_take_the_direct_gemv_and_others_do_not():
    assert "op_gemv_direct<bf16, bf16, bf16, bf16, 1, 0, true, float, bf16>(AMK_ARGS)" in \
        _variants("gemv_bf16_bias_tile")
    assert any(v.startswith("op_gemv_direct<bf16, float, bf16, float, 1, 0, false")
               for v in _variants("gemv_f32_k1000_odd_rows"))
    assert not any("op_gemv_direct" in v for v in _variants("gemv_f32_batched_novec"))   # M = 3
    assert not any("op_gemv_direct" in v for v in _variants("gemv_i4_k256_g64"))


def _gate_up_steps(swap: bool):
    case = examples.gate_up_case()
    prog = copy.deepcopy(case.program)
    if swap:               # silu_mul(second tile, first tile): silu applies to w_up's tile
        silu = prog.tasks[0].params["recipe"]["steps"][3]
        silu["args"] = silu["args"][::-1]
    low = lower_program(prog)
    d = low.tasks[0]
    subs = low.tasks[d["sub_begin"]:d["sub_begin"] + d["n_sub"]]
    refs = [tuple(r) for r in low.ptr_refs[int(subs[-1]["ptr_begin"]):][:int(subs[-1]["n_in"])]]
    names = {b.id: b.name for b in prog.buffers}
    return low, subs, [names[i] if k == 0 else "scratch" for k, i in refs]


@pytest.mark.parametrize("swap", [False, True])
def test_gate_up_and_their_silu_become_one_gemv_of_two_matrices(swap):
    low, subs, ins = _gate_up_steps(swap)
    assert [int(s["op"]) for s in subs] == [int(K.RMSNORM), int(K.GEMV_TILE)]
    g = subs[1]
    assert int(g["ip"][abi.ip_index("GEMV", "XS_READY")]) == 1
    assert (int(g["n_in"]), int(g["n_out"])) == (3, 1)          # x, W_gate, W_up -> silu(g) * u
    assert "op_gemv_direct<bf16, bf16, bf16, float, 2, 2, false, float, bf16>(AMK_ARGS)" in low.variants
    # the matrix silu is applied to comes first, whichever GEMV step computed it
    assert ins[1:] == (["w_up", "w_gate"] if swap else ["w_gate", "w_up"])


def test_the_direct_gemv_compiles_without_spills(tmp_path, monkeypatch):
    monkeypatch.setenv("AMK_CACHE_DIR", str(tmp_path))
    src = render(examples.combined_program())
    assert "op_gemv_direct<" in src
    res = compile_source(src, "sm_90a")
    blocks = re.findall(r"Function properties for (\S*op_gemv_direct\S*)\n(.*)\n", res.log)
    assert blocks
    for name, line in blocks:
        assert "0 bytes spill stores" in line, (name, line)
