"""tile.split_k: a batched GEMV whose x outweighs its weights is tiled rows x K slices, each slice
writing fp32 partial sums that a SUM a row tile adds in order (the residual ADD folded into it
by `fuse`); its readers wait for the SUMs. The reference VM runs the split program to the
unsplit one's numbers, and the checks refuse a malformed K slice."""
from dataclasses import replace

import pytest
import torch

import amk
from amk.models.model import Model
from amk.models.presets import PRESETS, random_params
from amk.passes.options import H100, PassOptions
from amk.passes.pipeline import run_pipeline
from amk.program.ir import InstructionKind as K
from amk.program.opcode_checks import check_opcode
from amk.program.recipe import recipe_of
from amk.testing.cuda_examples import _single
from amk.program.ir import BufferKind as BK, DType as D

from test_stamp import decoder_graph


def _fused(cfg, batch, opts):
    return run_pipeline(decoder_graph(cfg, batch=batch), opts, stop_after="fuse")["fuse"]


def _down(prog):
    return [t for t in prog.tasks if t.op is K.GEMM_TILE and "w_down" in t.name]


ONE_B = replace(PRESETS["llama-3.2-1b"], n_layers=2, max_seq=1088)
CUDA_H100 = PassOptions.for_backend("cuda").with_(target=H100)


def test_down_at_batch_16_is_four_k_slices_of_64_rows_and_a_sum_with_the_residual():
    prog = _fused(ONE_B, 16, CUDA_H100)
    down = [t for t in _down(prog) if "layers.0" in t.name]
    assert len(down) == 128                                   # 32 row tiles x 4 K slices
    assert {(t.params["k_off"], t.params["K_tile"]) for t in down} == {(k, 2048) for k in range(0, 8192, 2048)}
    assert {t.params["N_tile"] for t in down} == {64}
    parts = {t.outputs[0] for t in down}
    assert len(parts) == 4 and all(prog.buffers[b].dtype == D.F32 for b in parts)
    sums = [t for t in prog.tasks if t.op is K.FUSED and [s.op for s in recipe_of(t).steps] == [K.SUM, K.ADD]
            and set(t.inputs) & parts]
    assert len(sums) == 32
    assert {recipe_of(t).steps[0].params["n_off"] for t in sums} == set(range(0, 2048, 64))
    # the SUMs wait for the slices' counter; nothing else waits for it
    slice_counter = down[0].out_counter
    waiting = [t for t in prog.tasks if any(w.counter == slice_counter for w in t.waits)]
    assert waiting and all(t in sums for t in waiting)
    # q/k/v and gate/up (x from a norm), o (x too small to pay) are not split; nor is batch 1
    assert not any("k_off" in t.params for t in prog.tasks if "w_down" not in t.name)
    assert not any("k_off" in t.params for t in _fused(ONE_B, 1, CUDA_H100).tasks)


def test_the_split_count_follows_the_bytes_and_the_option():
    small = replace(ONE_B, hidden=256, ffn=1024, n_heads=4, n_kv_heads=2, head_dim=64)
    assert not any("k_off" in t.params for t in _fused(small, 16, CUDA_H100).tasks)   # x 32 KB: no
    # the 1B at batch 8 saves 80 KB a tile, less than the SUM's stage (measured slower, v49)
    assert not any("k_off" in t.params for t in _fused(ONE_B, 8, CUDA_H100).tasks)
    forced = _fused(small, 16, CUDA_H100.with_(k_split=2))
    assert {t.params["K_tile"] for t in _down(forced)} == {512}
    assert not any("k_off" in t.params for t in _fused(ONE_B, 16, CUDA_H100.with_(k_split=1)).tasks)


@pytest.mark.parametrize("quant", [None, "int4", "fp8"])
def test_the_reference_vm_runs_a_split_step_to_the_unsplit_numbers(quant):
    cfg = replace(PRESETS["llama-3.2-1b"], vocab=512, hidden=256, n_layers=2, n_heads=8,
                  n_kv_heads=2, head_dim=32, ffn=1024, max_seq=64, dtype=torch.bfloat16)
    m = Model(cfg, random_params(cfg, seed=1))
    if quant:
        m.quantize(quant, group=128)
    batch, pos = 4, torch.tensor([5], dtype=torch.int32)
    token = torch.tensor([3, 77, 140, 501], dtype=torch.int32)
    g = torch.Generator().manual_seed(2)
    kv0 = m.new_kv(batch)
    for layer in kv0:
        for c in layer.values():
            c.copy_(torch.randn(c.shape, generator=g).to(c.dtype))
    out = {}
    for ks in (1, 2):
        f = amk.jit(m.fn, backend="reference", options=PassOptions.for_backend("reference").with_(k_split=ks))
        kv = [{k: c.clone() for k, c in layer.items()} for layer in kv0]
        low = f.lower(m.params, token, pos, kv)
        assert any("k_off" in t.params for t in low.program.tasks) == (ks == 2)
        ids, logits, kv = f(m.params, token, pos, kv)
        out[ks] = ids, logits.float(), kv
    (i1, l1, kv1), (i2, l2, kv2) = out[1], out[2]
    assert ((l1 - l2).norm() / l1.norm()).item() < 1e-2
    assert (i1 == i2).float().mean().item() >= 0.75
    # layer 1's new cache rows come from layer 0's split down projection (its residual sum)
    assert torch.allclose(kv1[1]["k"].float(), kv2[1]["k"].float(), rtol=2e-2, atol=2e-2)


def _gemv_case(params, bias=False):
    ins = [("x", BK.IO_INPUT, D.BF16, (4, 512)), ("W", BK.WEIGHT, D.BF16, (32, 512))]
    if bias:
        ins.append(("b", BK.WEIGHT, D.BF16, (32,)))
    return _single("ks", K.GEMM_TILE, ins, [("y", BK.IO_OUTPUT, D.F32, (4, 32))],
                   {"K": 512, **params}, {}).program


@pytest.mark.parametrize("params,bias,msg", [
    ({"k_off": 256, "K_tile": 512}, False, "exceeds K=512"),
    ({"k_off": 0, "K_tile": 256}, True, "takes no bias"),
    ({"k_off": -1}, False, "must be >= 0"),
])
def test_a_malformed_k_slice_is_refused_by_name(params, bias, msg):
    prog = _gemv_case(params, bias)
    msgs = check_opcode(prog.tasks[0], prog.buffers)
    assert any(msg in m for m in msgs), msgs


def test_a_sum_of_mismatched_partials_is_refused():
    prog = _single("sum", K.SUM, [("a", BK.IO_INPUT, D.F32, (4, 32)), ("b", BK.IO_INPUT, D.F32, (4, 16))],
                   [("y", BK.IO_OUTPUT, D.BF16, (4, 32))], {}, {}).program
    assert any("input 1" in m for m in check_opcode(prog.tasks[0], prog.buffers))
