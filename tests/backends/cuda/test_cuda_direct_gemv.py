"""The default batch-1 float GEMV (op_gemv_direct, templates/gemv.cuh) on the CPU: which GEMVs
take it, the gate/up + silu pairing in either argument order, the residual fold, and that it
compiles for sm_90a without spilling (a spilled weight register serialises the loads)."""
import copy
import re

import pytest

pytest.importorskip("cuda.bindings")

from amk.program.ir import InstructionKind as K
from amk.backends.cuda import CudaOptions, abi, compile_source, render
from amk.backends.cuda.codegen import call_text
from amk.testing import cuda_examples as examples
from amk.backends.cuda.lower import lower_program


def _variants(case_name: str) -> list[str]:
    case = next(c for c in examples.cases() if c.name == case_name)
    return [call_text(v) for v in lower_program(case.program).variants]


def test_float_batch1_gemvs_take_the_direct_gemv_and_others_do_not():
    assert ("op_gemv_direct<bf16, bf16, bf16, bf16, 1, 0, true, float, bf16, false, float, float, "
            "false, 8, 2>(AMK_ARGS)") in _variants("gemv_bf16_bias_tile")     # SR 2: 512-byte rows
    assert any(v.startswith("op_gemv_direct<bf16, float, bf16, float, 1, 0, false")
               for v in _variants("gemv_f32_k1000_odd_rows"))
    assert not any("op_gemv_direct" in v for v in _variants("gemv_f32_batched_novec"))   # M = 3
    assert not any("op_gemv_direct" in v for v in _variants("gemv_i4_k256_g64"))


def test_short_rows_share_an_item_where_no_warp_gets_more_rows():
    """direct_sr: rows of at most 2 KiB (1 KiB) take 2 (4) row groups an item, so a warp keeps
    8 KiB of loads in flight; never where the busiest warp would get more rows than with one
    group an item (a q/k/v tile of 32 rows keeps one: 16 items for 16 warps)."""
    from amk.backends.cuda.encoders import direct_sr
    assert direct_sr(1, 1152, 2048) == 2          # Qwen3-0.6B's LM head tile
    assert direct_sr(2, 24, 2048) == 2            # its gate/up: 24 groups, 2 a warp either way
    assert direct_sr(1, 32, 2048) == 1            # its q/k/v: 16 groups, one a warp
    assert direct_sr(1, 1152, 4096) == 1          # the 1B's rows fill an item
    assert direct_sr(1, 128, 512) == 4 and direct_sr(1, 127, 512) == 4
    assert direct_sr(1, 130, 512) == 1            # 65 groups: 5 a warp, 8 with four an item
    assert direct_sr(1, 128, 1536) == 2           # 1.5 KiB rows: two fit an item


def _gate_up_task(swap: bool):
    case = examples.gate_up_case()
    prog = copy.deepcopy(case.program)
    if swap:               # silu_mul(second tile, first tile): silu applies to w_up's tile
        silu = prog.tasks[0].params["recipe"]["steps"][3]
        silu["args"] = silu["args"][::-1]
    low = lower_program(prog)
    d = low.tasks[0]
    refs = [tuple(r) for r in low.ptr_refs[int(d["ptr_begin"]):][:int(d["n_in"] + d["n_out"])]]
    names = {b.id: b.name for b in prog.buffers}
    return low, d, [names[i] if k == 0 else "scratch" for k, i in refs]


@pytest.mark.parametrize("swap", [False, True])
def test_gate_up_their_silu_and_the_norm_become_one_gemv_of_two_matrices(swap):
    """norm, gate, up, silu_mul: one op_gemv_direct task (no FUSED steps) that normalises x
    itself (folds.norm_into_gemv) and applies silu to the right matrix's sums."""
    low, d, ptrs = _gate_up_task(swap)
    assert int(d["op"]) == int(K.GEMV_TILE) and int(d["n_sub"]) == 0
    assert int(d["ip"][abi.ip_index("GEMV", "XS_READY")]) == 0
    assert float(d["fp"][abi.fp_index("GEMV", "EPS")]) > 0
    assert (int(d["n_in"]), int(d["n_out"])) == (4, 1)       # x, W_gate, W_up, norm weight -> y
    assert [call_text(v) for v in low.variants] == ["op_gemv_direct<bf16, bf16, bf16, float, 2, 2, false, float, bf16, "
                            "true, bf16, bf16, false, 1, 2>(AMK_ARGS)"]      # RN: a 64-wide x; SR 2
    # the matrix silu is applied to comes first, whichever GEMV step computed it
    assert ptrs == (["x", "w_up", "w_gate", "norm_w", "y"] if swap else ["x", "w_gate", "w_up", "norm_w", "y"])


def test_a_norm_whose_gemv_adds_a_residual_stays_a_step():
    """norm_into_gemv never meets the ADD epilogue (its residual is the last input, where the
    norm's weight would go): a norm before an o-style GEMV + ADD stays its own FUSED step; the
    same GEMV without the ADD takes the norm in."""
    from amk.backends.cuda.encoders import gemv_direct
    from amk.backends.cuda.folds import norm_into_gemv
    from amk.backends.cuda.steps import REF_BUFFER, REF_SCRATCH, Encoded, Fused, Variant, View
    from amk.program.ir import DType

    def v(ref):
        return View((1, 64), DType.BF16, ref)
    x, w, s, wo, r, y = (v((REF_BUFFER, 0)), v((REF_BUFFER, 1)), v((REF_SCRATCH, 0)),
                         v((REF_BUFFER, 2)), v((REF_BUFFER, 3)), v((REF_BUFFER, 4)))

    def steps(epi):
        norm = Encoded(int(K.RMSNORM), Variant.of("op_rmsnorm", tx="bf16", tw="bf16", ty="bf16"),
                       group="NORM", ip=dict(ROWS=1, H=64, TO_SMEM=1), fp=dict(EPS=1e-5))
        var = gemv_direct(tx="bf16", tw="bf16", ty="bf16", ts="float", nmat=1, epi=epi,
                          bias=False, tr="bf16", to="bf16")
        gemv = Encoded(int(K.GEMV_TILE), var, group="GEMV", ip=dict(XS_READY=1))
        return Fused([(norm, [x, w], [s]), (gemv, [s, wo, r] if epi == 1 else [s, wo], [y])], [])

    assert len(norm_into_gemv(steps(1)).steps) == 2
    (e, args, outs), = norm_into_gemv(steps(0)).steps
    assert e.variant.arg("norm") and e.ip["XS_READY"] == 0 and e.fp["EPS"] == 1e-5
    assert [a.ref for a in args] == [x.ref, wo.ref, w.ref] and outs == [y]
    assert call_text(e.variant).endswith(", true, bf16, bf16, false, 1, 1>(AMK_ARGS)")  # RN: 1 a thread


@pytest.mark.parametrize("which", ["examples", "llama_1b_layer"])
def test_the_direct_gemv_compiles_without_spills(which):
    """Also in the 1B step's kernel: a change to another device function (the attention's, NOTES
    v14d) once made every GEMV there spill, through ptxas's register allocation across calls."""
    prog = examples.combined_program() if which == "examples" else _one_layer_1b()[0]
    src = render(prog)
    assert "op_gemv_direct<" in src
    res = compile_source(src, "sm_90a")
    blocks = re.findall(r"Function properties for (\S*op_gemv_direct\S*)\n(.*)\n", res.log)
    assert blocks
    for name, line in blocks:
        assert "0 bytes spill stores" in line, (name, line)


def _one_layer_1b(options=CudaOptions()):
    from dataclasses import replace
    from amk.models.presets import LLAMA_3_2_1B, random_model
    prog = random_model(replace(LLAMA_3_2_1B, max_seq=1088, n_layers=1), device="meta") \
        .lower(backend="cuda").program
    return prog, lower_program(prog, options=options)


def _gemv_step(low, j):
    """Task j's op_gemv_direct step (its own descriptor, or the one after its combine)."""
    t = low.tasks[j]
    if int(t["op"]) != int(K.FUSED):
        return t
    steps = low.tasks[t["sub_begin"]:t["sub_begin"] + t["n_sub"]]
    ops = [int(s["op"]) for s in steps]
    return steps[1] if ops[0] == int(K.ATTENTION_COMBINE) else steps[0]


def test_every_gemv_tile_is_preloaded_by_the_task_before_it():
    """preload.py: every batch-1 GEMV tile (q/k/v, o after its combine, gate/up, down, the LM
    head) that has a task before it in its queue gets its first rows, up to 64 KiB, copied into
    shared memory by that task: the task before carries the ranges (n_pre from pre_begin), one
    a matrix, and the tile's GEMV step reads PRE rows of each from there. The o tiles' whole
    64 KiB tile (16 rows of 4 KiB), gate/up 8 rows of each matrix, down 4 rows of 16 KiB."""
    prog, low = _one_layer_1b()
    pre_ip, off_ip = abi.ip_index("GEMV", "PRE"), abi.ip_index("GEMV", "N_OFF")
    kinds, targets = set(), set()
    for q in low.queues:
        for i, j in zip(q, q[1:]):
            g = _gemv_step(low, j)
            pr = int(g["ip"][pre_ip]) if int(g["op"]) == int(K.GEMV_TILE) else 0
            d = low.tasks[i]
            assert (int(d["n_pre"]) > 0) == (pr > 0)
            if not pr:
                continue
            lo = int(d["pre_begin"])
            rng = low.ranges[lo:lo + int(d["n_pre"])]
            row = rng[0][2] // pr
            assert sum(nb for _, _, nb in rng) <= 65536
            assert all((off, nb) == (int(g["ip"][off_ip]) * row, pr * row) for _, off, nb in rng)
            kinds.add((len(rng), pr, row))
            targets.add(j)
        first = _gemv_step(low, q[0]) if q else None      # nobody copies for a queue's first task
        assert first is None or int(first["op"]) != int(K.GEMV_TILE) or int(first["ip"][pre_ip]) == 0
    assert {(1, 16, 4096),                # o: the whole tile
            (2, 8, 4096),                 # gate/up: 8 rows of each matrix
            (1, 4, 16384)} <= kinds       # down: 4 rows of 8192 bf16
    assert len(targets) > 3 * 128         # o, gate/up, down, the LM head (q/k/v: first in queue)
    gemvs = low.tasks[low.tasks["op"] == int(K.GEMV_TILE)]
    assert (gemvs["ip"][:, pre_ip] > 0).sum() == len(targets)          # no GEMV reads rows nobody copied
    assert "#define AMK_PRE 1" in render(prog)


@pytest.mark.parametrize("preload", [65536, 0])
def test_only_the_gemv_variants_that_preload_compile_the_preload_path(preload):
    """The template's PRE (the path that reads preloaded rows) is on exactly in the
    op_gemv_direct variants some descriptor of which has ip PRE > 0: in a one-layer 1B step the
    ADD tiles (o, down), gate/up and the LM head, not q/k/v (each the first task of its queue:
    nobody copies for it)."""
    _, low = _one_layer_1b(CudaOptions(preload_bytes=preload))
    pre = low.tasks["ip"][:, abi.ip_index("GEMV", "PRE")] > 0
    direct = [i for i, v in enumerate(low.variants) if v.fn == "op_gemv_direct"]
    assert len(direct) == 4
    args = {i: low.variants[i] for i in direct}
    with_path = {i for i in direct if args[i].arg("pre")}              # template argument PRE
    assert with_path == {i for i in direct if pre[low.tasks["variant"] == i].any()}
    assert len(with_path) == (3 if preload else 0)
    # RN: a NORM variant's threads hold H / 512 = 4 row elements (2048 wide), not RMS_RN = 8
    assert sorted(a.arg("rn") for a in args.values() if a.arg("norm")) == [4, 4, 4]


def test_no_preload_when_turned_off():
    off = CudaOptions(preload_bytes=0)
    prog, low = _one_layer_1b(off)
    assert not low.tasks["n_pre"].any()
    assert "#define AMK_PRE 0" in render(prog, off)
