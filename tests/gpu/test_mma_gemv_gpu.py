"""The tensor-core GEMV (op_gemv_mma) and the batch-1 quantized GEMV (op_gemv_qdirect) on the
GPU against the reference semantics: every case of amk.testing.mma_examples (batched bf16 at M
in {2, 5, 8, 16, 64}, int8 / int4 / fp8 weights batched, odd K and tiles) and of
amk.testing.quant_examples (batch 1: every format x groups 32 / 64 / 128 / one a row x zeros,
biases, odd K and tiles), outputs poisoned with NaN first; and whole Llama-shaped steps at
batch 2-64 and quantized (batch 1 at several groups too), against the reference VM on the same
GPU."""
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cuda.bindings")

from amk.models.presets import LLAMA_3_2_1B, QWEN3_0_6B, random_model  # noqa: E402
from amk.testing import mma_examples, quant_examples  # noqa: E402
from amk.testing.cuda_check import run_cases  # noqa: E402

CASES = mma_examples.cases() + quant_examples.cases()


@pytest.fixture(scope="module")
def runs():
    return run_cases(CASES, seed=3)


@pytest.mark.parametrize("case", [c.name for c in CASES])
def test_mma_gemv_matches_reference(runs, case):
    prog, ref, got = runs
    (t,) = [t for t in prog.tasks if t.name == case]
    o = t.outputs[0]
    lo, n = int(t.params["n_off"]), int(t.params["N_tile"])
    want, have = ref[o].float(), got[o].float().cpu()
    tile_w, tile_g = want[:, lo:lo + n], have[:, lo:lo + n]
    assert not tile_g.isnan().any(), f"{case}: unwritten elements in the tile"
    outside = torch.cat([have[:, :lo], have[:, lo + n:]], 1)
    assert outside.isnan().all(), f"{case}: writes outside the tile"
    rel = ((tile_g - tile_w).norm() / tile_w.norm()).item()
    assert rel < 1e-2, f"{case}: relative error {rel:.2e}"
    # every element: within 1e-2 of the row's scale (bf16 output rounding included)
    err = (tile_g - tile_w).abs().amax(1) / tile_w.abs().amax(1).clamp_min(1e-6)
    assert err.max().item() < 2e-2, f"{case}: worst element error {err.max().item():.2e}"


def _step_matches_reference(cfg, batch, fmt, pos, seed, group=128, max_seq=256):
    m = random_model(cfg, device="cuda", max_seq=max_seq, seed=seed)
    if fmt:
        m.quantize(fmt, group=group)
    params, token, p, kv = m.example_args(batch)
    g = torch.Generator(device="cuda").manual_seed(seed)
    for layer in kv:
        for c in layer.values():
            c.copy_(torch.randn(c.shape, generator=g, device="cuda"))
    token.copy_(torch.randint(0, cfg.vocab, (batch,), generator=g, device="cuda", dtype=torch.int32))
    p.fill_(pos)
    out = {}
    for backend in ("cuda", "reference"):
        cache = [{k: c.clone() for k, c in layer.items()} for layer in kv]
        ids, logits, cache = m.jit(backend)(params, token, p, cache)
        out[backend] = (ids.clone(), logits.float())
    (gi, got), (wi, want) = out["cuda"], out["reference"]
    for b in range(batch):
        rel = ((got[b] - want[b]).norm() / want[b].norm()).item()
        assert rel < 2e-2, f"batch {batch} {fmt}: row {b} relative error {rel:.2e}"
    # the argmax partials of every row: the token of the logits the kernel wrote
    assert torch.equal(gi.view(-1).long(), got.argmax(-1).view(-1))
    assert (gi.view(-1) == wi.view(-1)).float().mean().item() >= 0.9


@pytest.mark.parametrize("batch", [2, 5, 8, 16, 64])
def test_batched_llama_shape_step_matches_reference_vm(batch):
    _step_matches_reference(replace(LLAMA_3_2_1B, n_layers=2, vocab=8192), batch, None, 100, seed=7)


@pytest.mark.parametrize("hidden", [576, 896])
def test_batched_step_of_a_hidden_not_a_multiple_of_256_matches_reference_vm(hidden):
    """The norm in the batched GEMV with one sum-of-squares slot a vector of x (a warp's 32
    vectors are not one row's): SmolLM2-135M's and Qwen2-0.5B's hidden sizes."""
    cfg = replace(LLAMA_3_2_1B, n_layers=2, vocab=8192, hidden=hidden, n_heads=hidden // 64,
                  n_kv_heads=hidden // 64 // (3 if hidden == 576 else 7), ffn=4 * hidden)
    _step_matches_reference(cfg, 16, None, 100, seed=9)


def test_a_batched_norm_over_several_x_windows_matches_reference_vm():
    """Hidden 4096 at batch 16 (the 8B's q/k/v and gate/up): the GEMV's norm stages x in
    windows and adds each window's sums of squares (gemv_batch.plan)."""
    cfg = replace(LLAMA_3_2_1B, n_layers=2, vocab=8192, hidden=4096, n_heads=32, n_kv_heads=8, head_dim=128, ffn=3584)
    _step_matches_reference(cfg, 16, None, 100, seed=11)


@pytest.mark.parametrize("batch", [1, 5, 16])
@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_quantized_llama_shape_step_matches_reference_vm(fmt, batch):
    _step_matches_reference(replace(LLAMA_3_2_1B, n_layers=2, vocab=8192), batch, fmt, 100, seed=8)


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_quantized_qwen3_shape_step_matches_reference_vm(fmt):
    """Head dim 128 with the q/k norm, K 1024 GEMVs (half a segment: never rolled) and tiles of
    one round of items (gemv_quant.plan_items), batch 1."""
    _step_matches_reference(replace(QWEN3_0_6B, n_layers=2, vocab=8192), 1, fmt, 100, seed=10)


@pytest.mark.parametrize("group", [32, 64, 8192])      # 8192: one group a row (per channel)
@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_quantized_batch1_step_at_other_groups_matches_reference_vm(fmt, group):
    """op_gemv_qdirect with every fold (norm, gate/up + silu, residual add, argmax partials)."""
    _step_matches_reference(replace(LLAMA_3_2_1B, n_layers=2, vocab=8192), 1, fmt, 100, seed=9, group=group)


@pytest.mark.parametrize("fmt,batch", [(None, 1), ("int4", 1), ("int8", 1), ("fp8", 1), (None, 16)])
def test_a_down_projection_wider_than_the_work_area_matches_reference_vm(fmt, batch):
    """Qwen2-7B's FFN width (K 18944 > smem.XS_MAX): at batch 1 the GEMV's x and sums run into
    the staging area below the preload (smem.GEMV_X_MAX), at batch 16 x comes in windows."""
    cfg = replace(LLAMA_3_2_1B, n_layers=2, vocab=8192, hidden=512, n_heads=8, n_kv_heads=2, ffn=18944)
    _step_matches_reference(cfg, batch, fmt, 100, seed=12)


@pytest.mark.parametrize("fmt,hidden", [(None, 512), ("int4", 512), (None, 5120)])
def test_a_down_projection_past_the_staging_area_matches_reference_vm(fmt, hidden):
    """Llama-3-70B's FFN width (K 28672 > smem.GEMV_X_MAX) at batch 1: op_gemv_mma, the residual
    add in its epilogue (bf16 weights were refused before). bf16 tiles of 8 rows (hidden 512)
    take x through the ring (XR); of 40 rows (hidden 5120, as Qwen2.5-32B's) x in windows."""
    cfg = replace(LLAMA_3_2_1B, n_layers=2, vocab=8192, hidden=hidden, n_heads=hidden // 64,
                  n_kv_heads=2, ffn=28672)
    _step_matches_reference(cfg, 1, fmt, 100, seed=14)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_a_combine_of_more_partials_than_it_keeps_in_registers_matches_reference_vm(kv_heads, batch):
    """2 or 4 kv heads at an 8K cache: 56 or 33 shards a head at position 5000, merged by
    combine_direct (batch > 1, or partials past the staging area), which loads their m again
    with their l past 16 partials (comb_merge, v47)."""
    cfg = replace(LLAMA_3_2_1B, n_layers=2, vocab=8192, n_kv_heads=kv_heads)
    _step_matches_reference(cfg, batch, None, 5000, seed=13, max_seq=8192)


@pytest.mark.parametrize("fmt,batch,k_split", [(None, 16, None), ("int4", 16, 4), (None, 5, 2),
                                               ("int8", 8, 4), ("fp8", 16, 2)])
def test_a_step_with_down_split_over_k_matches_reference_vm(fmt, batch, k_split):
    """Down projections tiled rows x K slices (passes/tile.split_k): fp32 partial sums from
    op_gemv_mma over [KLO, KHI), one op_sum a row tile adding them and the residual. None: the
    target's own rule (the 1B shape at batch 16 splits in 4); else forced (quantized weights
    only then: the rule leaves them whole, NOTES v49)."""
    from amk import jit
    from amk.passes.options import PassOptions
    cfg = replace(LLAMA_3_2_1B, n_layers=2, vocab=8192)
    if k_split:
        cfg = replace(cfg, hidden=512, n_heads=8, n_kv_heads=2, ffn=2048)
    m = random_model(cfg, device="cuda", max_seq=256, seed=15)
    if fmt:
        m.quantize(fmt)
    params, token, p, kv = m.example_args(batch)
    g = torch.Generator(device="cuda").manual_seed(15)
    for layer in kv:
        for c in layer.values():
            c.copy_(torch.randn(c.shape, generator=g, device="cuda"))
    token.copy_(torch.randint(0, cfg.vocab, (batch,), generator=g, device="cuda", dtype=torch.int32))
    p.fill_(100)
    out = {}
    for backend in ("cuda", "reference"):
        opts = PassOptions.for_backend(backend, token.device).with_(k_split=k_split)
        f = jit(m.fn, backend=backend, options=opts)
        cache = [{k: c.clone() for k, c in layer.items()} for layer in kv]
        if backend == "cuda":
            assert any("k_off" in t.params for t in f.lower(params, token, p, cache).program.tasks)
        ids, logits, cache = f(params, token, p, cache)
        out[backend] = ids.clone(), logits.float(), cache
    (gi, got, gkv), (wi, want, wkv) = out["cuda"], out["reference"]
    for b in range(batch):
        rel = ((got[b] - want[b]).norm() / want[b].norm()).item()
        assert rel < 2e-2, f"row {b}: relative error {rel:.2e}"
    assert (gi.view(-1) == wi.view(-1)).float().mean().item() >= 0.9
    # layer 1's appended k rows come from layer 0's summed down projection
    new = (slice(None), 100) if batch > 1 else (100,)
    k1, k1w = gkv[1]["k"][new].float(), wkv[1]["k"][new].float()
    assert ((k1 - k1w).norm() / k1w.norm()).item() < 2e-2
