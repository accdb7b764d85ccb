"""Reference opcode semantics checked against independent torch computations."""
import math

import pytest
import torch
import torch.nn.functional as F

from amk.backends.reference.semantics import SEMANTICS, RefCtx, semantics_for
from amk.errors import TraceError, ValidationError
from amk.program.ir import DType, InstructionKind as K
from amk.program.recipe import recipe_errors
from amk.program.regions import combine_live, kv_window, live_shards


def run(op, inputs, outputs, **params):
    semantics_for(op)(inputs, outputs, params, RefCtx())
    return outputs[0]


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def rnd(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=gen(seed)).to(dtype)


def test_registry_covers_every_opcode():
    assert set(SEMANTICS) == set(K)
    assert semantics_for(int(K.ADD)) is SEMANTICS[K.ADD]
    with pytest.raises(ValidationError, match="no reference semantics"):
        semantics_for(999)


# ---------------------------------------------------------------- elementwise
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_elementwise_ops_match_torch_and_cast_once(out_dtype):
    a, b = rnd(2, 16, seed=1, dtype=torch.bfloat16), rnd(2, 16, seed=2, dtype=torch.bfloat16)
    af, bf = a.float(), b.float()
    cases = [
        (K.ADD, [a, b], {}, af + bf),
        (K.MUL, [a, b], {}, af * bf),
        (K.MUL, [a], {"scale": 0.5}, af * 0.5),
        (K.SILU_MUL, [a, b], {}, af * torch.sigmoid(af) * bf),
        (K.GELU, [a], {}, 0.5 * af * (1 + torch.erf(af / math.sqrt(2)))),
        (K.COPY, [a], {}, af),
    ]
    for op, ins, params, want in cases:
        got = run(op, ins, [torch.empty(2, 16, dtype=out_dtype)], **params)
        # one rounding of the fp32 result (silu via sigmoid may differ by an fp32 ulp)
        torch.testing.assert_close(got.float(), want.to(out_dtype).float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op,n_in", [(K.ADD, 2), (K.MUL, 2), (K.SILU_MUL, 2), (K.GELU, 1),
                                     (K.COPY, 1)])
def test_column_tiled_elementwise_equals_untiled(op, n_in):
    ins = [rnd(3, 24, seed=i) for i in range(n_in)]
    whole = run(op, ins, [torch.empty(3, 24)])
    tiled = torch.full((3, 24), float("nan"))
    for n_off in (16, 0, 8):                  # any order of disjoint tiles
        run(op, ins, [tiled], n_off=n_off, N_tile=8)
    assert torch.equal(tiled, whole)


def test_tile_writes_only_its_columns_and_reads_flat_inputs_as_output_shape():
    a, b = rnd(24, seed=1), rnd(1, 24, seed=2)     # [24] viewed as the output's [1, 24]
    out = torch.full((1, 24), -7.0)
    run(K.ADD, [a, b], [out], n_off=8, N_tile=8)
    assert torch.equal(out[0, 8:16], (a[8:16] + b[0, 8:16]))
    assert (out[0, :8] == -7).all() and (out[0, 16:] == -7).all()
    with pytest.raises(ValidationError, match="outside the output"):
        run(K.ADD, [a, b], [out], n_off=20, N_tile=8)


def test_softmax_and_allreduce():
    x = rnd(3, 10, seed=3)
    torch.testing.assert_close(run(K.SOFTMAX, [x], [torch.empty(3, 10)]),
                               torch.exp(x) / torch.exp(x).sum(-1, keepdim=True))
    shards = [rnd(4, 8, seed=s) for s in range(3)]
    torch.testing.assert_close(run(K.ALLREDUCE_SHARD, shards, [torch.empty(4, 8)]),
                               shards[0] + shards[1] + shards[2])


# ---------------------------------------------------------------- norms, embed, argmax
def test_rmsnorm_rows_match_explicit_formula():
    x, w = rnd(1, 3 * 32, seed=4), rnd(32, seed=5)       # flat buffer read as 3 rows of 32
    got = run(K.RMSNORM, [x, w], [torch.empty(1, 96, dtype=torch.bfloat16)], eps=1e-5)
    rows = x.view(3, 32)
    want = rows / torch.sqrt(rows.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(got.float().view(3, 32), want.bfloat16().float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(run(K.RMSNORM, [x, w], [torch.empty(1, 96)], eps=1e-5).view(3, 32),
                               want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_bias", [False, True])
def test_layernorm_matches_f_layer_norm(with_bias):
    x, w, b = rnd(2, 16, seed=6), rnd(16, seed=7), rnd(16, seed=8)
    ins = [x, w, b] if with_bias else [x, w]
    got = run(K.LAYERNORM, ins, [torch.empty(2, 16)], eps=1e-5)
    torch.testing.assert_close(got, F.layer_norm(x, (16,), w, b if with_bias else None, 1e-5))


def test_embed_and_argmax_first_max():
    table = rnd(10, 6, seed=9, dtype=torch.bfloat16)
    ids = torch.tensor([3, 7], dtype=torch.int32)
    out = run(K.EMBED, [ids, table], [torch.empty(2, 6, dtype=torch.bfloat16)])
    assert torch.equal(out, table[[3, 7]])
    logits = torch.tensor([[1.0, 5.0, 5.0, 2.0], [9.0, 0.0, 9.0, 9.0]])
    ids_out = run(K.SAMPLE_ARGMAX, [logits], [torch.full((2,), -1, dtype=torch.int32)])
    assert ids_out.tolist() == [1, 0]


# ---------------------------------------------------------------- matmuls
def test_gemv_tiles_with_bias_match_linear():
    x, W, bias = rnd(1, 32, seed=10), rnd(24, 32, seed=11, dtype=torch.bfloat16), rnd(24, seed=12)
    out = torch.full((1, 24), float("nan"))
    for n_off in range(0, 24, 8):
        run(K.GEMV_TILE, [x, W, bias], [out], n_off=n_off, N_tile=8, K=32)
    torch.testing.assert_close(out, x @ W.float().T + bias, rtol=1e-5, atol=1e-5)
    y = run(K.GEMM_TILE, [rnd(3, 32, seed=13), W], [torch.empty(3, 24)], n_off=0, N_tile=24, K=32)
    torch.testing.assert_close(y, rnd(3, 32, seed=13) @ W.float().T, rtol=1e-5, atol=1e-5)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Manual packing: q in [-8, 7], stored q+8, even column in the low nibble."""
    u = (q + 8).to(torch.uint8)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()


@pytest.mark.parametrize("qdtype", [DType.I8, DType.I4])
@pytest.mark.parametrize("asym", [False, True])
def test_quantized_gemv_and_dequant_match_manual_dequant(qdtype, asym):
    N, Kdim, group = 16, 32, 8
    g = gen(14)
    lo, hi = (-8, 8) if qdtype == DType.I4 else (-128, 128)
    q = torch.randint(lo, hi, (N, Kdim), generator=g)
    scales = torch.rand(N, Kdim // group, generator=g) + 0.1
    zeros = torch.randint(-2, 3, (N, Kdim // group), generator=g).float() if asym else None
    W = (q.float() - (zeros.repeat_interleave(group, 1) if asym else 0)) * scales.repeat_interleave(group, 1)
    qw = pack_int4(q) if qdtype == DType.I4 else q.to(torch.int8)
    x = rnd(1, Kdim, seed=15)
    extra = [zeros] if asym else []
    out = torch.full((1, N), float("nan"))
    for n_off in (0, 8):
        run(K.GEMV_TILE, [x, qw, scales, *extra], [out], qdtype=int(qdtype), group=group,
            n_off=n_off, N_tile=8, K=Kdim)
    torch.testing.assert_close(out, x @ W.T, rtol=1e-5, atol=1e-4)
    deq = run(K.DEQUANT, [qw, scales, *extra], [torch.empty(N, Kdim)], qdtype=int(qdtype),
              group=group, K=Kdim)
    assert torch.equal(deq, W)


def test_dequant_accepts_seed_unpacked_int4_values():
    g = gen(16)
    q = torch.randint(-8, 8, (4, 16), generator=g).to(torch.int8)
    scales = torch.rand(4, 2, generator=g)
    deq = run(K.DEQUANT, [q, scales], [torch.empty(4, 16)], qdtype=int(DType.I4), group=8, K=16)
    assert torch.equal(deq, q.float() * scales.repeat_interleave(8, 1))


def test_int4_ragged_last_group():
    g = gen(17)
    q = torch.randint(-8, 8, (2, 12), generator=g)
    scales = torch.rand(2, 2, generator=g)          # group 8: columns 8..11 use the 2nd scale
    deq = run(K.DEQUANT, [pack_int4(q), scales], [torch.empty(2, 12)], qdtype=int(DType.I4),
              group=8, K=12)
    s = torch.cat([scales[:, :1].expand(2, 8), scales[:, 1:].expand(2, 4)], 1)
    assert torch.equal(deq, q.float() * s)


# ---------------------------------------------------------------- attention
HD, NH, NKV, S = 8, 4, 2, 12


def attn_inputs(B=None, seed=20, dtype=torch.float32):
    q = rnd(*(() if B is None else (B,)), 1, NH * HD, seed=seed, dtype=dtype)
    cshape = (S, NKV, HD) if B is None else (B, S, NKV, HD)
    return q, rnd(*cshape, seed=seed + 1, dtype=dtype), rnd(*cshape, seed=seed + 2, dtype=dtype)


def sdpa_ref(q, k, v, n):
    """Independent: F.scaled_dot_product_attention over the first n cache rows, GQA expanded."""
    B = 1 if k.dim() == 3 else k.shape[0]
    k4, v4 = k.reshape(B, S, NKV, HD)[:, :n].float(), v.reshape(B, S, NKV, HD)[:, :n].float()
    rep = NH // NKV
    kk = k4.repeat_interleave(rep, 2).transpose(1, 2)             # [B, NH, n, HD]
    vv = v4.repeat_interleave(rep, 2).transpose(1, 2)
    qq = q.float().reshape(B, NH, 1, HD)
    return F.scaled_dot_product_attention(qq, kk, vv).reshape(B, NH * HD)


@pytest.mark.parametrize("B", [None, 2])
def test_attention_clamped_by_runtime_pos_matches_sdpa(B):
    q, k, v = attn_inputs(B)
    pos = torch.tensor([6], dtype=torch.int32)
    out = torch.empty(q.shape)
    run(K.ATTENTION_TILE, [q, k, v, pos], [out], head_dim=HD, n_heads=NH, n_kv_heads=NKV,
        kv_start=0, kv_len=S, flags=0)
    torch.testing.assert_close(out.reshape(-1, NH * HD), sdpa_ref(q, k, v, 7), rtol=1e-5, atol=1e-5)


def test_attention_head_range_writes_only_its_heads():
    q, k, v = attn_inputs()
    pos = torch.tensor([S - 1], dtype=torch.int32)
    out = torch.full((1, NH * HD), float("nan"))
    for h_off in (2, 0):                                           # whole kv groups of 2
        run(K.ATTENTION_TILE, [q, k, v, pos], [out], head_dim=HD, n_heads=NH, n_kv_heads=NKV,
            h_off=h_off, h_count=2)
    torch.testing.assert_close(out, sdpa_ref(q, k, v, S), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValidationError, match="whole kv groups"):
        run(K.ATTENTION_TILE, [q, k, v, pos], [out], head_dim=HD, n_heads=NH, n_kv_heads=NKV,
            h_off=1, h_count=2)


@pytest.mark.parametrize("pos_value", [10, 3])     # 3: the last two shards are empty
def test_split_kv_partials_and_combine_equal_unsplit(pos_value):
    q, k, v = attn_inputs(seed=30)
    pos = torch.tensor([pos_value], dtype=torch.int32)
    common = dict(head_dim=HD, n_heads=NH, n_kv_heads=NKV)
    parts = []
    for start in (0, 4, 8):
        p = torch.full((NH, HD + 2), float("nan"))
        run(K.ATTENTION_TILE, [q, k, v, pos], [p], kv_start=start, kv_len=4, flags=2, **common)
        parts.append(p)
    if pos_value == 3:
        assert torch.equal(parts[2][:, :HD], torch.zeros(NH, HD))
        assert (parts[2][:, HD] == float("-inf")).all() and (parts[2][:, HD + 1] == 0).all()
    merged = run(K.ATTENTION_COMBINE, parts, [torch.empty(NH * HD)], head_dim=HD, n_heads=NH)
    whole = run(K.ATTENTION_TILE, [q, k, v, pos], [torch.empty(1, NH * HD)], **common)
    torch.testing.assert_close(merged, whole.view(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(merged, sdpa_ref(q, k, v, pos_value + 1).view(-1), rtol=1e-5, atol=1e-6)


def test_kv_window_splits_the_live_window_not_the_cache():
    # 16 cache rows, 3 shards: at pos 5 the 6 live rows split 2 / 2 / 2, at pos 1 1 / 1 / 0
    assert [kv_window(0, 16, 16, 5, s, 3) for s in range(3)] == [(0, 2), (2, 4), (4, 6)]
    assert [kv_window(0, 16, 16, 1, s, 3) for s in range(3)] == [(0, 1), (1, 2), (2, 2)]
    assert [kv_window(0, 16, 16, 15, s, 3) for s in range(3)] == [(0, 6), (6, 12), (12, 16)]
    assert kv_window(4, 8, 16, 2, 0, 1) == (4, 4)              # the window starts past pos: empty
    assert kv_window(4, 8, 16, None, 1, 2) == (8, 12)          # no pos: the static window
    # 5 live rows in 4 shards of 2 (one row a shard at least): the last is empty at the
    # window's end, not past it (nor past the 5-row cache)
    assert [kv_window(0, 5, 5, 4, s, 4, 0, 1) for s in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]


def test_a_batched_shard_of_one_dead_and_one_empty_sequence_runs():
    """A batched split-KV task (b_off / b_count, a position a sequence) reads every sequence's
    shard from the lowest row to the highest: sequence 0 at pos 0 (its shard 3 of 4 not live:
    its partial untouched) and sequence 1 at pos 4 (5 rows, its shard 3 empty: the empty
    partial). Found by the nightly property run: the union reached past the 5-row cache and
    the VM raised."""
    B, HD = 2, 8
    q, k, v = rnd(B, HD), rnd(B, 5, 1, HD, seed=1), rnd(B, 5, 1, HD, seed=2)
    pos = torch.tensor([0, 4], dtype=torch.int32)
    out = torch.full((1, B * (HD + 2)), 7.0)
    run(K.ATTENTION_TILE, [q, k, v, pos], [out], head_dim=HD, n_heads=1, n_kv_heads=1, kv_start=0,
        kv_len=5, flags=2, b_off=0, b_count=2, kv_shard=3, kv_shards=4, kv_shard_rows=1)
    part = out.view(B, HD + 2)
    assert torch.equal(part[1, :HD], torch.zeros(HD)) and part[1, HD] == float("-inf") and part[1, HD + 1] == 0
    assert torch.equal(part[0], torch.full((HD + 2,), 7.0))    # not live: its partial untouched


def test_live_shard_count_follows_the_live_rows():
    # at least R rows a live shard, 1..P of them; R 0 keeps the seed's fixed count
    assert [live_shards(n, 16, 128) for n in (0, 1, 255, 256, 1500, 2047, 2048, 8192)] == \
        [1, 1, 1, 2, 11, 15, 16, 16]
    assert live_shards(5, 16, 0) == 16
    # 8192-row cache, 16 shards, R 128: at pos 200 shard 0 takes all 201 rows, the rest none
    assert kv_window(0, 8192, 8192, 200, 0, 16, 0, 128) == (0, 201)
    assert [kv_window(0, 8192, 8192, 200, s, 16, 0, 128) for s in (1, 15)] == [None, None]
    # pos 1500: 11 live shards of 137 rows (the last 131); shard 11 is not live
    assert kv_window(0, 8192, 8192, 1500, 0, 16, 0, 128) == (0, 137)
    assert kv_window(0, 8192, 8192, 1500, 10, 16, 0, 128) == (1370, 1501)
    assert kv_window(0, 8192, 8192, 1500, 11, 16, 0, 128) is None
    # a sliding window counts its own rows: 1000 rows at pos 8191 -> 7 live shards of 143
    assert kv_window(0, 8192, 8192, 8191, 6, 16, 1000, 128) == (8050, 8192)
    assert kv_window(0, 8192, 8192, 8191, 7, 16, 1000, 128) is None
    # the combine counts the same shards from its own params
    live = {"kv_shard_rows": 128, "kv_start": 0, "kv_len": 8192, "window": 0}
    assert [combine_live(live, 16, p) for p in (0, 200, 1500, 8191)] == [1, 1, 11, 16]
    assert combine_live(dict(live, window=1000), 16, 8191) == 7
    assert combine_live({}, 16, 200) == 16


@pytest.mark.parametrize("pos_value", [0, 200, 1500, 8191])
def test_live_shards_merge_to_the_plain_attention_at_an_8k_cache(pos_value):
    """16 shards of an 8192-row cache at R 128: shards past the live count write nothing (their
    partials stay NaN) and the combine, given pos, never reads them."""
    NH, NKV, HD, S, P, R = 4, 2, 8, 8192, 16, 128
    g = torch.Generator().manual_seed(pos_value)
    q = torch.randn(1, NH * HD, generator=g)
    k, v = torch.randn(S, NKV, HD, generator=g), torch.randn(S, NKV, HD, generator=g)
    pos = torch.tensor([pos_value], dtype=torch.int32)
    common = dict(head_dim=HD, n_heads=NH, n_kv_heads=NKV, kv_start=0, kv_len=S)
    parts = []
    for s in range(P):
        out = torch.full((NH, HD + 2), float("nan"))
        run(K.ATTENTION_TILE, [q, k, v, pos], [out], **common, flags=2, kv_shard=s,
            kv_shards=P, kv_shard_rows=R)
        assert bool(torch.isnan(out).all()) == (s >= live_shards(pos_value + 1, P, R))
        parts.append(out)
    merged = run(K.ATTENTION_COMBINE, parts + [pos], [torch.empty(NH * HD)], head_dim=HD,
                 n_heads=NH, kv_shard_rows=R, kv_start=0, kv_len=S, window=0)
    rep = NH // NKV
    kk, vv = k[:pos_value + 1].repeat_interleave(rep, 1), v[:pos_value + 1].repeat_interleave(rep, 1)
    scores = torch.einsum("hd,khd->hk", q.view(NH, HD).double(), kk.double()) / HD ** 0.5
    want = torch.einsum("hk,khd->hd", torch.softmax(scores, -1), vv.double())
    torch.testing.assert_close(merged.view(NH, HD), want.float(), rtol=1e-5, atol=1e-5)


def test_live_shards_count_per_row_in_a_block_of_positions():
    """A prompt block (pos [T]): each row counts its own live shards; the combine merges each
    row's own ones."""
    NH, NKV, HD, S, P, R = 2, 1, 8, 512, 4, 64
    g = torch.Generator().manual_seed(3)
    rows = [5, 130, 300]                                  # 1, 2 and 4 live shards
    q = torch.randn(len(rows), NH * HD, generator=g)
    k, v = torch.randn(S, NKV, HD, generator=g), torch.randn(S, NKV, HD, generator=g)
    pos = torch.tensor(rows, dtype=torch.int32)
    common = dict(head_dim=HD, n_heads=NH, n_kv_heads=NKV, kv_start=0, kv_len=S)
    parts = []
    for s in range(P):
        out = torch.full((len(rows), NH, HD + 2), float("nan"))
        run(K.ATTENTION_TILE, [q, k, v, pos], [out], **common, flags=2, kv_shard=s,
            kv_shards=P, kv_shard_rows=R)
        for r, p in enumerate(rows):
            assert bool(torch.isnan(out[r]).all()) == (s >= live_shards(p + 1, P, R))
        parts.append(out)
    merged = run(K.ATTENTION_COMBINE, parts + [pos], [torch.empty(len(rows), NH * HD)],
                 head_dim=HD, n_heads=NH, kv_shard_rows=R, kv_start=0, kv_len=S, window=0)
    for r, p in enumerate(rows):
        scores = (k[:p + 1, 0] @ q[r].view(NH, HD).T).T / HD ** 0.5     # [NH, p + 1]
        want = torch.softmax(scores, -1) @ v[:p + 1, 0]
        torch.testing.assert_close(merged[r].view(NH, HD), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pos_value", [0, 1, 5, 11])
def test_dynamic_shards_merge_to_the_unsplit_attention(pos_value):
    q, k, v = attn_inputs(seed=31)
    pos = torch.tensor([pos_value], dtype=torch.int32)
    common = dict(head_dim=HD, n_heads=NH, n_kv_heads=NKV)
    parts = [run(K.ATTENTION_TILE, [q, k, v, pos], [torch.full((NH, HD + 2), float("nan"))],
                 kv_start=0, kv_len=S, kv_shard=s, kv_shards=3, flags=2, **common)
             for s in range(3)]
    merged = run(K.ATTENTION_COMBINE, parts, [torch.empty(NH * HD)], head_dim=HD, n_heads=NH)
    torch.testing.assert_close(merged, sdpa_ref(q, k, v, pos_value + 1).view(-1), rtol=1e-5, atol=1e-6)


def test_partial_is_explicit_flash_state():
    q, k, v = attn_inputs(seed=40)
    p = run(K.ATTENTION_TILE, [q, k, v], [torch.empty(NH, HD + 2)], head_dim=HD, n_heads=NH,
            n_kv_heads=NKV, kv_start=2, kv_len=5, flags=2)
    kk = k[2:7].repeat_interleave(2, 1)                          # [5, NH, HD]
    s = torch.einsum("hd,khd->hk", q.view(NH, HD), kk) / math.sqrt(HD)
    m = s.max(-1).values
    e = torch.exp(s - m[:, None])
    torch.testing.assert_close(p[:, HD], m)
    torch.testing.assert_close(p[:, HD + 1], e.sum(-1))
    torch.testing.assert_close(p[:, :HD], torch.einsum("hk,khd->hd", e, v[2:7].repeat_interleave(2, 1)))


# ---------------------------------------------------------------- rope, kv append
def hf_rope(x, pos, head_dim, theta=10000.0, inv_freq=None):
    """Independent rotate-half rope (HF Llama formulation, fp32)."""
    if inv_freq is None:
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = pos.float()[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], -1)
    xh = x.float().view(-1, head_dim)
    rot = torch.cat([-xh[:, head_dim // 2:], xh[:, : head_dim // 2]], -1)
    return (xh * emb.cos() + rot * emb.sin()).view(x.shape)


def test_rope_matches_hf_and_tiles_and_inv_freq():
    x = rnd(1, NH * HD, seed=50)
    pos = torch.tensor([5], dtype=torch.int32)
    got = run(K.ROPE, [x, pos], [torch.empty(1, NH * HD)], head_dim=HD, theta=500000.0)
    torch.testing.assert_close(got, hf_rope(x, pos, HD, 500000.0), rtol=1e-5, atol=1e-5)
    tiled = torch.full((1, NH * HD), float("nan"))
    for n_off in (HD * 2, 0):
        run(K.ROPE, [x, pos], [tiled], head_dim=HD, theta=500000.0, n_off=n_off, N_tile=2 * HD)
    assert torch.equal(tiled, got)
    inv = torch.rand(HD // 2, generator=gen(51))
    got2 = run(K.ROPE, [x, pos, inv], [torch.empty(1, NH * HD)], head_dim=HD)
    torch.testing.assert_close(got2, hf_rope(x, pos, HD, inv_freq=inv), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValidationError, match="whole heads"):
        run(K.ROPE, [x, pos], [tiled], head_dim=HD, n_off=4, N_tile=HD)


def test_rope_per_position_rows():
    x = rnd(3, NH, HD, seed=52)
    pos = torch.tensor([0, 4, 9], dtype=torch.int32)
    got = run(K.ROPE, [x, pos], [torch.empty(3, NH, HD)], head_dim=HD)
    want = torch.stack([hf_rope(x[i], pos[i:i + 1], HD) for i in range(3)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kv_append_in_place_at_runtime_pos():
    cache = torch.zeros(S, NKV, HD, dtype=torch.bfloat16)
    ptr = cache.data_ptr()
    new = rnd(1, NKV * HD, seed=60)
    run(K.KV_APPEND, [new, torch.tensor([4], dtype=torch.int32)], [cache])
    assert cache.data_ptr() == ptr
    assert torch.equal(cache[4], new.view(NKV, HD).bfloat16())
    assert cache[:4].abs().sum() == 0 and cache[5:].abs().sum() == 0
    bcache = torch.zeros(2, S, NKV, HD)
    bnew = rnd(2, NKV * HD, seed=61)
    run(K.KV_APPEND, [bnew, torch.tensor([7], dtype=torch.int32)], [bcache])
    assert torch.equal(bcache[:, 7], bnew.view(2, NKV, HD))
    run(K.KV_APPEND, [new], [cache], pos=2)                          # the seed's static pos
    assert torch.equal(cache[2], new.view(NKV, HD).bfloat16())
    with pytest.raises(TraceError, match="outside the cache"):
        run(K.KV_APPEND, [new, torch.tensor([S], dtype=torch.int32)], [cache])


# ---------------------------------------------------------------- FUSED
def test_fused_equals_unfused_bit_identically_with_two_outputs():
    H, N = 32, 16
    x, w, W = rnd(1, H, seed=70), rnd(H, seed=71, dtype=torch.bfloat16), rnd(N, H, seed=72, dtype=torch.bfloat16)
    resid = rnd(1, N, seed=73)
    normed = run(K.RMSNORM, [x, w], [torch.empty(1, H, dtype=torch.bfloat16)], eps=1e-6)
    y = torch.empty(1, N, dtype=torch.bfloat16)
    for n_off in (0, 8):
        run(K.GEMV_TILE, [normed, W], [y], n_off=n_off, N_tile=8, K=H)
    summed = run(K.ADD, [y, resid], [torch.empty(1, N)])
    recipe = {"steps": [
        {"op": int(K.RMSNORM), "args": [{"in": 0}, {"in": 1}], "out": 0, "params": {"eps": 1e-6},
         "out_shape": [1, H], "out_dtype": "bfloat16"},
        {"op": int(K.GEMV_TILE), "args": [{"s": 0}, {"in": 2}], "out": 1,
         "params": {"n_off": 0, "N_tile": 8, "K": H}, "out_shape": [1, N], "out_dtype": "bf16"},
        {"op": int(K.GEMV_TILE), "args": [{"s": 0}, {"in": 2}], "out": 1,
         "params": {"n_off": 8, "N_tile": 8, "K": H}, "out_shape": [1, N], "out_dtype": "bf16"},
        {"op": int(K.COPY), "args": [{"s": 1}], "out": {"o": 1}},
        {"op": int(K.ADD), "args": [{"s": 1}, {"in": 3}], "out": "final"},
    ]}
    assert recipe_errors(recipe, 4, 2) == []
    outs = [torch.empty(1, N), torch.empty(1, N, dtype=torch.bfloat16)]
    semantics_for(K.FUSED)([x, w, W, resid], outs, {"recipe": recipe}, RefCtx())
    assert torch.equal(outs[0], summed) and torch.equal(outs[1], y)


def test_fused_scratch_feeds_a_later_step():
    recipe = {"steps": [{"op": int(K.COPY), "args": [{"in": 0}], "out": 1},
                        {"op": int(K.MUL), "args": [{"s": 1}], "out": "final", "params": {"scale": 2.0}}]}
    x = rnd(1, 8, seed=74)
    out = torch.empty(1, 8)
    semantics_for(K.FUSED)([x], [out], {"recipe": recipe}, RefCtx())
    assert torch.equal(out, x * 2.0)


@pytest.mark.parametrize("recipe,needle", [
    (None, "must be a dict"),
    ({"steps": []}, "non-empty"),
    ({"steps": [{"op": 12, "args": [{"in": 0}, {"in": 5}], "out": "final"}]}, "input index 5"),
    ({"steps": [{"op": 12, "args": [{"s": 3}, {"in": 0}], "out": "final"}]}, "scratch 3 not written"),
    ({"steps": [{"op": 19, "args": [{"in": 0}], "out": "final"}]}, "nested FUSED"),
    ({"steps": [{"op": 77, "args": [{"in": 0}], "out": "final"}]}, "unknown op 77"),
    ({"steps": [{"op": 1, "args": [{"in": 0}], "out": 0}]}, "never writes output"),
    ({"steps": [{"op": 1, "args": [{"in": 0}], "out": {"o": 2}}]}, "output index 2"),
    ({"steps": [{"op": 1, "args": [{"in": 0}], "out": 0, "out_dtype": "torch.Tensor"},
                {"op": 1, "args": [{"s": 0}], "out": "final"}]}, "allowlist"),
    ({"steps": [{"op": 1, "args": [{"x": 0}], "out": "final"}]}, "arg must be"),
])
def test_malformed_recipe_is_a_clear_validation_error(recipe, needle):
    errs = recipe_errors(recipe, 1, 1)
    assert any(needle in e for e in errs), errs
    with pytest.raises(ValidationError, match="malformed FUSED recipe"):
        semantics_for(K.FUSED)([torch.zeros(1, 4)], [torch.zeros(1, 4)], {"recipe": recipe}, RefCtx())


def test_validate_recipe_lists_every_error():
    recipe = {"steps": [{"op": 12, "args": [{"in": 9}, {"s": 4}], "out": "bogus"}]}
    errs = recipe_errors(recipe, 1, 1)
    assert len(errs) == 4, errs          # bad input, unwritten scratch, bad out, no final output
