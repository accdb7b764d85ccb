"""The pipe GEMV (AMK_GEMV_PIPE, templates/gemv_pipe.cuh) on the CPU: which GEMVs take it, the
gate/up pairing, the knob, and that every variant compiles for sm_90a within the CTA's smem."""
import re

import pytest

pytest.importorskip("cuda.bindings")

from amk import knobs
from amk.program.ir import InstructionKind as K
from amk.backends.cuda import abi, compile_source, examples, render, smem
from amk.backends.cuda.lower import lower_program


def _variants(case_name: str) -> list[str]:
    case = next(c for c in examples.cases() if c.name == case_name)
    return lower_program(case.program).variants


def test_float_batch1_gemvs_take_the_pipe_and_others_do_not(monkeypatch):
    monkeypatch.setenv("AMK_GEMV_PIPE", "1")
    monkeypatch.delenv("AMK_GEMV_RING", raising=False)
    assert knobs.gemv_pipe() == (4, 4)
    assert any(v.startswith("op_gemv_pipe<bf16, bf16, bf16, bf16, 1, true>")
               for v in _variants("gemv_bf16_bias_tile"))
    assert any(v.startswith("op_gemv_pipe<bf16, float, bf16, float, 1, false>")
               for v in _variants("gemv_f32_k1000_odd_rows"))
    batched = _variants("gemv_f32_batched_novec")          # M = 3 and K = 100 (not 16-byte rows)
    assert not any("op_gemv_pipe" in v for v in batched)
    assert not any("op_gemv_pipe" in v for v in _variants("gemv_i4_k256_g64"))


def test_gate_and_up_become_one_stream_of_two_matrices(monkeypatch):
    monkeypatch.setenv("AMK_GEMV_PIPE", "1")
    monkeypatch.delenv("AMK_GEMV_RING", raising=False)
    case = examples.gate_up_case()
    low = lower_program(case.program)
    d = low.tasks[0]
    subs = low.tasks[d["sub_begin"]:d["sub_begin"] + d["n_sub"]]
    assert [int(s["op"]) for s in subs] == [int(K.RMSNORM), int(K.GEMV_TILE), int(K.SILU_MUL)]
    g = subs[1]
    ip = lambda name: int(g["ip"][abi.ip_index("GEMV", name)])
    assert (ip("PIPE"), ip("NMAT"), ip("NV"), ip("RB"), ip("XS_READY")) == (1, 2, 40, 640, 1)
    assert (int(g["n_in"]), int(g["n_out"])) == (3, 2)           # x, W_gate, W_up -> y_gate, y_up
    assert "op_gemv_pipe<bf16, bf16, bf16, float, 2, false>(AMK_ARGS)" in low.variants
    assert d["n_ptr_all"] == d["n_in"] + d["n_out"] + sum(int(s["n_in"] + s["n_out"]) for s in subs)


def test_fused_gemvs_writing_one_scratch_are_not_paired(monkeypatch):
    monkeypatch.setenv("AMK_GEMV_PIPE", "1")
    monkeypatch.delenv("AMK_GEMV_RING", raising=False)
    low = lower_program(examples.fused_case().program)       # two k tiles into one scratch
    assert not any(", 2, false>" in v for v in low.variants)


def test_knob_off_ring_on_or_two_ctas_use_the_other_gemvs(monkeypatch):
    prog = examples.gate_up_case().program
    for env in ({}, {"AMK_GEMV_PIPE": "0"}, {"AMK_GEMV_PIPE": "1", "AMK_GEMV_RING": "1"},
                {"AMK_GEMV_PIPE": "1", "AMK_CTAS_PER_SM": "2"}):
        for k in ("AMK_GEMV_PIPE", "AMK_GEMV_RING", "AMK_CTAS_PER_SM"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert not any("op_gemv_pipe" in v for v in lower_program(prog).variants), env


@pytest.mark.parametrize("pipe", ["1", "2x8", "8x2"])
def test_all_cases_compile_with_the_pipe_within_the_ctas_smem(tmp_path, monkeypatch, pipe):
    monkeypatch.setenv("AMK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("AMK_GEMV_PIPE", pipe)
    monkeypatch.delenv("AMK_GEMV_RING", raising=False)
    monkeypatch.setenv("AMK_CTAS_PER_SM", "1")
    src = render(examples.combined_program())
    v, s = knobs.gemv_pipe()
    assert f"#define AMK_PIPE_V {v}\n#define AMK_PIPE_S {s}\n" in src
    assert "op_gemv_pipe<" in src
    assert smem.NTHREADS // 32 * v * s * 512 <= smem.RING_BYTES   # the stages fit
    res = compile_source(src, "sm_90a")
    static = max(int(m) for m in re.findall(r"(\d+) bytes smem", res.log))
    assert smem.SMEM_BYTES + static <= 227 * 1024
    assert re.search(r"op_gemv_pipe.*\n.*0 bytes spill stores", res.log)


def _combine_o_add_steps(monkeypatch, pipe: str):
    """The combine -> o -> add example lowered: (variants, its FUSED steps' descriptors), after
    checking the add was folded into the GEMV (x, wo, h -> y)."""
    monkeypatch.setenv("AMK_GEMV_PIPE", pipe)
    monkeypatch.delenv("AMK_GEMV_RING", raising=False)
    low = lower_program(examples.combine_o_add_case().program)
    d = low.tasks[0]
    subs = low.tasks[d["sub_begin"]:d["sub_begin"] + d["n_sub"]]
    assert [int(s["op"]) for s in subs] == [int(K.ATTENTION_COMBINE), int(K.GEMV_TILE)]
    assert (int(subs[1]["n_in"]), int(subs[1]["n_out"])) == (3, 1)
    return low.variants, subs


def test_combine_leaves_x_in_smem_and_the_pipe_gemv_adds_the_residual(monkeypatch):
    variants, subs = _combine_o_add_steps(monkeypatch, "1")
    assert subs[0]["ip"][abi.ip_index("COMB", "TO_SMEM")] == 1
    assert subs[1]["ip"][abi.ip_index("GEMV", "XS_READY")] == 1
    assert "op_gemv_pipe<bf16, bf16, bf16, float, 1, false, true, bf16, float>(AMK_ARGS)" in variants


def test_an_add_that_broadcasts_or_reads_other_columns_is_not_folded():
    from amk.backends.cuda.lower import Encoded, View, REF_SCRATCH, _fold_add
    from amk.program.ir import DType
    s = View((1, 64), DType.BF16, (REF_SCRATCH, 0))
    x, r, o = (View((1, 64), DType.BF16, (0, i)) for i in (1, 2, 3))
    g = Encoded(int(K.GEMV_TILE), "op_gemv_pipe<bf16, bf16, bf16, float, 1, false>(AMK_ARGS)",
                ip=dict(PIPE=1, NMAT=1, N_OFF=0, N_TILE=16, N=64))
    add = lambda c1, rs: Encoded(int(K.ADD), "", ip=dict(  # noqa: E731
        KIND=abi.EW_KINDS.index("ADD"), ROWS=1, COLS=64, C0=0, C1=c1, A_RS=64, B_RS=rs, A_CS=1, B_CS=1))
    assert len(_fold_add([(g, [x, x], [s]), (add(16, 64), [s, r], [o])])) == 1
    assert len(_fold_add([(g, [x, x], [s]), (add(32, 64), [s, r], [o])])) == 2   # other columns
    assert len(_fold_add([(g, [x, x], [s]), (add(16, 0), [s, r], [o])])) == 2    # broadcast
    later = (add(16, 64), [s, r], [x])                                           # s read again
    assert len(_fold_add([(g, [x, x], [s]), (add(16, 64), [s, r], [o]), later])) == 3


def test_the_direct_load_gemv_adds_the_residual_too(monkeypatch):
    variants, _ = _combine_o_add_steps(monkeypatch, "0")
    assert ("op_gemv_direct<bf16, bf16, bf16, float, 1, 1, false, bf16, float, false, float, float, "
            "false, 8>(AMK_ARGS)") in variants
