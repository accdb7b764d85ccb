"""Prompt blocks (pos int32 [T], row t at pos[t]) on the triton backend, on the CPU under
TRITON_INTERPRET=1: the chunk programs of a tiny Llama give the reference backend's logits and
cache rows, the second chunk attending causally over the first chunk's cache rows."""
from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CUDA present: tests/gpu/test_generate_gpu.py and test_triton_gpu.py cover this", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"          # before triton decorates any kernel
pytest.importorskip("triton")
transformers = pytest.importorskip("transformers")
for _m in [f"amk.backends.triton.kernels_{m}"
           for m in ("elementwise", "gemv", "gemm", "attention", "block_attention", "movement")]:
    if _m in sys.modules:                     # imported earlier without the interpreter: redo
        importlib.reload(sys.modules[_m])

from amk.models import from_hf  # noqa: E402
from tests.models.test_prefill import TINY  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")


def test_two_prompt_chunks_on_triton_equal_the_reference():
    torch.manual_seed(3)     # one layer, small: the interpreter runs every program in numpy
    cfg = transformers.LlamaConfig(**{**TINY, "num_hidden_layers": 1, "hidden_size": 32,
                                      "intermediate_size": 48, "head_dim": 8})
    model = from_hf(transformers.AutoModelForCausalLM.from_config(cfg).eval(), max_seq=16)
    ids = torch.randint(0, 96, (7,), generator=torch.Generator().manual_seed(2)).to(torch.int32)
    results = {}
    for backend in ("reference", "triton"):
        step = model.jit(backend)
        kv = model.new_kv()
        logits = []
        for start, n in ((0, 4), (4, 3)):     # (16+ rows take the GEMM kernel: tested below)
            pos = torch.arange(start, start + n, dtype=torch.int32)
            _, lg, kv = step(model.params, ids[start:start + n].clone(), pos, kv)
            logits.append(lg.clone())
        results[backend] = (torch.cat(logits), kv)
    (ref, ref_kv), (got, got_kv) = results["reference"], results["triton"]
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
    for a, b in zip(got_kv, ref_kv):
        torch.testing.assert_close(a["k"], b["k"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a["v"], b["v"], atol=1e-5, rtol=1e-5)
    assert got.argmax(-1).tolist() == ref.argmax(-1).tolist()


@pytest.mark.parametrize("bias", [False, True])
def test_gemm_tile_kernel_matches_torch(bias):
    from amk.backends.triton.launch import launch_op
    from amk.program.ir import InstructionKind as K
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(20, 40, generator=g), torch.randn(70, 40, generator=g)
    b = torch.randn(70, generator=g)
    out = torch.full((20, 70), float("nan"))
    ins = [x, w, b] if bias else [x, w]
    launch_op(K.GEMM_TILE, ins, [out], {"n_off": 8, "N_tile": 50, "K": 40})
    want = x @ w[8:58].T + (b[8:58] if bias else 0)
    torch.testing.assert_close(out[:, 8:58], want, atol=1e-4, rtol=1e-4)
    assert out[:, :8].isnan().all() and out[:, 58:].isnan().all()     # other columns untouched


def test_gemm_config_fills_the_gpu_with_the_largest_tiles_that_do():
    from amk.backends.triton.kernels_gemm import gemm_config
    tiles = lambda M, N, K=2048, up=False: (lambda c: (c.block_m, c.block_n, c.block_k))(
        gemm_config(M, N, K, up, sms=132))
    assert tiles(512, 8192) == (128, 128, 64)      # 256 programs
    assert tiles(512, 2048) == (128, 64, 64)       # 128x128 would be 64 programs on 132 SMs
    assert tiles(512, 512) == (64, 32, 64) and tiles(128, 2048) == (64, 32, 64)
    assert tiles(128, 8192) == (128, 64, 64)
    assert tiles(16, 8192) == (16, 64, 64) and tiles(16, 512) == (16, 32, 64)   # never taller
    assert tiles(40, 40, K=40) == (16, 32, 64)     # too small to fill: the smallest tile
    assert tiles(512, 8192, up=True) == (64, 64, 32)   # fp32 operands: small fp32 blocks


@pytest.mark.parametrize("tiles", [(128, 128, 64, 8), (128, 64, 64, 8), (64, 64, 32, 2),
                                   (32, 32, 16, 1), (16, 32, 64, 8)])
def test_gemm_kernel_every_tile_shape_with_ragged_edges_matches_torch(tiles):
    # ragged M, N and K (masked K tail, wrapped edge rows), a column offset, a bias, and the
    # grouped program order with fewer row blocks than a group
    from amk.backends.triton.kernels_gemm import GemmConfig
    from amk.backends.triton.launch import _gemm
    bm, bn, bk, group = tiles
    g = torch.Generator().manual_seed(bm + bn + bk)
    M, K, N, n_off, n_tile = 150, 136, 200, 24, 170
    x, w, b = (torch.randn(M, K, generator=g), torch.randn(N, K, generator=g),
               torch.randn(N, generator=g))
    out = torch.full((M, N), float("nan"))
    _gemm(x, w, b, out, M, K, n_off, n_tile, GemmConfig(bm, bn, bk, 4, 3, group))
    want = (x.double() @ w[n_off:n_off + n_tile].double().T + b[n_off:n_off + n_tile].double())
    torch.testing.assert_close(out[:, n_off:n_off + n_tile], want.float(), atol=1e-4, rtol=1e-4)
    assert out[:, :n_off].isnan().all() and out[:, n_off + n_tile:].isnan().all()


def _causal_attention(q, kc, vc, pos, n_kv, hd, window=0, softcap=0.0):
    """Row t attends cache rows [0, pos[t]] (within the window), in float64, independently."""
    R, n_heads = q.shape[0], q.shape[1] // hd
    rep = n_heads // n_kv
    out = torch.zeros(R, n_heads, hd, dtype=torch.float64)
    for t, p in enumerate(pos.tolist()):
        lo = max(0, p + 1 - window) if window else 0
        kk = kc[lo:p + 1].double().repeat_interleave(rep, dim=1)        # [n, heads, hd]
        vv = vc[lo:p + 1].double().repeat_interleave(rep, dim=1)
        s = torch.einsum("hd,nhd->hn", q[t].double().view(n_heads, hd), kk) / hd ** 0.5
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        out[t] = torch.einsum("hn,nhd->hd", s.softmax(-1), vv)
    return out.reshape(R, -1)


@pytest.mark.parametrize("n_heads,n_kv,hd,R,extra", [
    (4, 2, 8, 6, {}),                       # head_dim padded to 16, one row block
    (8, 2, 64, 40, {}),                     # GQA rep 4: 32 rows a block, two blocks
    (4, 4, 128, 20, {"window": 5}),         # no GQA, sliding window
    (2, 1, 256, 9, {"softcap": 20.0}),      # head_dim 256 (Gemma), soft-capped scores
    (6, 2, 16, 11, {}),                     # rep 3: a head block of 4, one lane masked
])
def test_block_attention_kernel_matches_causal_math(n_heads, n_kv, hd, R, extra):
    from amk.backends.triton.launch import launch_op
    from amk.program.ir import InstructionKind as K
    g = torch.Generator().manual_seed(hd + R)
    S, start = 80, 23                        # cache rows before the block: [0, start)
    q = torch.randn(R, n_heads * hd, generator=g)
    kc, vc = torch.randn(S, n_kv, hd, generator=g), torch.randn(S, n_kv, hd, generator=g)
    pos = torch.arange(start, start + R, dtype=torch.int32)
    pos[R // 2:-1], pos[-1] = pos[R // 2 + 1:].clone(), int(pos[R // 2])   # a padded chunk's order
    out = torch.full((R, n_heads * hd), float("nan"))
    params = {"head_dim": hd, "n_heads": n_heads, "n_kv_heads": n_kv, "scale": hd ** -0.5,
              "kv_start": 0, "kv_len": S, "flags": 0, **extra}
    launch_op(K.ATTENTION_TILE, [q, kc, vc, pos], [out], params)
    want = _causal_attention(q, kc, vc, pos, n_kv, hd, **extra)
    torch.testing.assert_close(out, want.float(), atol=2e-5, rtol=1e-4)
    # a head range (one task's kv groups) writes only its heads
    half = torch.full_like(out, float("nan"))
    rep = n_heads // n_kv
    if n_kv > 1:
        launch_op(K.ATTENTION_TILE, [q, kc, vc, pos], [half],
                  {**params, "h_off": rep, "h_count": rep})
        cols = slice(rep * hd, 2 * rep * hd)
        torch.testing.assert_close(half[:, cols], out[:, cols], atol=0, rtol=0)
        assert half[:, :rep * hd].isnan().all() and half[:, 2 * rep * hd:].isnan().all()
