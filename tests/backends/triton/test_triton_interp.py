"""Every Triton micro-kernel on the CPU (TRITON_INTERPRET=1) against an independent fp32 torch
computation, and against the reference semantics. Outputs are poisoned (NaN / -1) first, so a
kernel that skips an element fails; tiled ops must leave the other columns poisoned.
Small shapes: the interpreter runs each program instance in numpy."""
from __future__ import annotations

import importlib
import math
import os
import sys

import pytest
import torch

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    # Setting TRITON_INTERPRET here would turn tests/gpu's compiled kernels into interpreted
    # ones for the whole session; on a CUDA machine tests/gpu/test_triton_gpu.py covers these.
    pytest.skip("CUDA present: tests/gpu covers the triton kernels (set TRITON_INTERPRET=1 to "
                "run these anyway)", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"          # before triton decorates any kernel

pytest.importorskip("triton")

_KERNEL_MODULES = [f"amk.backends.triton.kernels_{m}"
                   for m in ("elementwise", "gemv", "gemm", "attention", "block_attention",
                             "movement")]
for _m in _KERNEL_MODULES:                    # imported earlier without the interpreter: redo
    if _m in sys.modules:
        importlib.reload(sys.modules[_m])

from amk.errors import ValidationError                     # noqa: E402
from amk.program.ir import InstructionKind as K            # noqa: E402
from amk.backends.triton.launch import launch_op           # noqa: E402

F32 = torch.float32
# numpy evaluates both sides of tl.where: -inf - -inf in a masked-off lane is expected
pytestmark = pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")


def _semantics():
    try:
        from amk.backends.reference.semantics import semantics_for
        return semantics_for
    except ImportError:
        return None


def poisoned(shape, dtype=F32):
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype)
    return torch.full(shape, -1, dtype=dtype)


def run(op, inputs, out_shapes, params, dtypes=None, outs=None):
    """Run the kernel on poisoned outputs; also the reference semantics (when present) on a
    second poisoned copy, asserting they agree. Returns the kernel's outputs."""
    dtypes = dtypes or [F32] * len(out_shapes)
    if outs is None:
        outs = [poisoned(s, d) for s, d in zip(out_shapes, dtypes)]
    ref_outs = [o.clone() for o in outs]
    launch_op(op, inputs, outs, params)
    sem = _semantics()
    if sem is not None:
        sem(op)([x.clone() for x in inputs], ref_outs, params, None)
        for got, want in zip(outs, ref_outs):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    return outs


def close(got, want, tol=1e-5):
    torch.testing.assert_close(got, want.to(got.dtype), rtol=tol, atol=tol, equal_nan=True)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---------------------------------------------------------------------------- elementwise
@pytest.mark.parametrize("op,fn,n_in", [
    (K.COPY, lambda a: a, 1),
    (K.ADD, lambda a, b: a + b, 2),
    (K.MUL, lambda a, b: a * b, 2),
    (K.GELU, lambda a: 0.5 * a * (1 + torch.erf(a / math.sqrt(2))), 1),
    (K.SILU_MUL, lambda g, u: g * torch.sigmoid(g) * u, 2),
])
def test_elementwise_full_and_tiled(op, fn, n_in):
    xs = [torch.randn(3, 40) for _ in range(n_in)]
    (y,) = run(op, xs, [(3, 40)], {})
    close(y, fn(*xs))
    (y,) = run(op, xs, [(3, 40)], {"n_off": 8, "N_tile": 16})
    close(y[:, 8:24], fn(*xs)[:, 8:24])
    assert torch.isnan(y[:, :8]).all() and torch.isnan(y[:, 24:]).all()


def test_mul_by_scale_and_copy_casts():
    x = torch.randn(2, 33)
    (y,) = run(K.MUL, [x], [(2, 33)], {"scale": 0.37})
    close(y, x * 0.37)
    xb = x.to(torch.bfloat16)       # (the interpreter truncates fp32->bf16; the GPU rounds)
    (y,) = run(K.COPY, [xb], [(2, 33)], {})
    assert torch.equal(y, xb.float())


def test_add_broadcasts_one_row():
    a, b = torch.randn(4, 24), torch.randn(24)
    (y,) = run(K.ADD, [a, b], [(4, 24)], {})
    close(y, a + b)


def test_allreduce_shard_sums_in_order():
    for s in (1, 3, 6):
        xs = [torch.randn(2, 20) for _ in range(s)]
        (y,) = run(K.ALLREDUCE_SHARD, xs, [(2, 20)], {})
        want = xs[0].clone()
        for x in xs[1:]:
            want += x
        assert torch.equal(y, want)          # fp32, same order: exact


def test_softmax():
    x = torch.randn(3, 50) * 4
    x[1, 7] = float("-inf")
    (y,) = run(K.SOFTMAX, [x], [(3, 50)], {})
    close(y, torch.exp(x - x.max(-1, keepdim=True).values)
          / torch.exp(x - x.max(-1, keepdim=True).values).sum(-1, keepdim=True))


# ---------------------------------------------------------------------------- norms
def test_rmsnorm_rows():
    x, w = torch.randn(3, 48), torch.randn(48)
    (y,) = run(K.RMSNORM, [x, w], [(3, 48)], {"eps": 1e-5})
    close(y, x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w)


@pytest.mark.parametrize("bias", [True, False])
def test_layernorm(bias):
    x, w, b = torch.randn(2, 40) + 3, torch.randn(40), torch.randn(40)
    ins = [x, w, b] if bias else [x, w]
    (y,) = run(K.LAYERNORM, ins, [(2, 40)], {"eps": 1e-5})
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    close(y, (x - mu) / torch.sqrt(var + 1e-5) * w + (b if bias else 0))


# ---------------------------------------------------------------------------- gemv
def test_gemv_fp_tile_with_bias():
    x, w, b = torch.randn(1, 300), torch.randn(24, 300), torch.randn(24)
    (y,) = run(K.GEMV_TILE, [x, w, b], [(1, 24)], {"n_off": 8, "N_tile": 12, "K": 300})
    close(y[:, 8:20], (x.double() @ w[8:20].double().T + b[8:20].double()).float(), 1e-4)
    assert torch.isnan(y[:, :8]).all() and torch.isnan(y[:, 20:]).all()


def test_gemm_tile_rows():
    x, w = torch.randn(3, 64), torch.randn(16, 64)
    (y,) = run(K.GEMM_TILE, [x, w], [(3, 16)], {})
    close(y, (x.double() @ w.double().T).float(), 1e-4)


def _quantized(N, Kd, group, int4, zeros):
    """Random quantized weight in the seed layout plus its dequantized fp64 matrix, built
    independently (loops over groups, explicit nibbles)."""
    q = torch.randint(-8, 8, (N, Kd)) if int4 else torch.randint(-128, 128, (N, Kd))
    n_groups = -(-Kd // group)
    s = torch.rand(N, n_groups) * 0.1 + 0.01
    z = torch.randint(-3, 4, (N, n_groups)).float() if zeros else None
    deq = torch.empty(N, Kd, dtype=torch.float64)
    for k in range(Kd):
        g = k // group
        zz = z[:, g].double() if zeros else 0.0
        deq[:, k] = (q[:, k].double() - zz) * s[:, g].double()
    if int4:
        u = (q + 8).to(torch.uint8)
        if Kd % 2:
            u = torch.cat([u, torch.full((N, 1), 8, dtype=torch.uint8)], 1)
        stored = u[:, 0::2] | (u[:, 1::2] << 4)
    else:
        stored = q.to(torch.int8)
    return stored.contiguous(), s, z, deq


@pytest.mark.parametrize("int4", [False, True])
@pytest.mark.parametrize("zeros", [False, True])
def test_gemv_weight_only_quantized(int4, zeros):
    N, Kd, group = 20, 96, 32
    qw, s, z, deq = _quantized(N, Kd, group, int4, zeros)
    x = torch.randn(1, Kd)
    ins = [x, qw, s] + ([z] if zeros else [])
    params = {"qdtype": 7 if int4 else 6, "group": group, "K": Kd, "n_off": 4, "N_tile": 12}
    (y,) = run(K.GEMV_TILE, ins, [(1, N)], params)
    close(y[:, 4:16], (x.double() @ deq[4:16].T).float(), 1e-4)
    assert torch.isnan(y[:, :4]).all() and torch.isnan(y[:, 16:]).all()


@pytest.mark.parametrize("zeros", [False, True])
def test_gemv_quantized_with_a_bias_adds_it_in_the_epilogue(zeros):
    N, Kd, group = 20, 96, 32
    qw, s, z, deq = _quantized(N, Kd, group, False, zeros)
    x, bias = torch.randn(1, Kd), torch.randn(N)
    ins = [x, qw, s] + ([z] if zeros else []) + [bias]
    params = {"qdtype": 6, "group": group, "K": Kd, "n_off": 4, "N_tile": 12, "bias": 1}
    (y,) = run(K.GEMV_TILE, ins, [(1, N)], params)
    close(y[:, 4:16], (x.double() @ deq[4:16].T + bias[4:16].double()).float(), 1e-4)


def test_gemv_fp8_weights():
    N, Kd, group = 20, 96, 32
    real = torch.randn(N, Kd) * 50                        # within E4M3's +-448
    real[:, :8] *= 1e-4                                   # and some subnormals (< 2^-6)
    q = real.to(torch.float8_e4m3fn)
    s = torch.rand(N, Kd // group) * 0.01 + 0.001
    deq = q.double() * s.double().repeat_interleave(group, 1)
    x = torch.randn(1, Kd)
    params = {"qdtype": 8, "group": group, "K": Kd, "n_off": 0, "N_tile": N}
    (y,) = run(K.GEMV_TILE, [x, q, s], [(1, N)], params)
    close(y, (x.double() @ deq.T).float(), 1e-4)
    (w,) = run(K.DEQUANT, [q, s], [(N, Kd)], {"qdtype": 8, "group": group, "K": Kd})
    close(w, deq.float())


@pytest.mark.parametrize("int4", [False, True])
def test_dequant(int4):
    N, Kd, group = 8, 64, 16
    qw, s, z, deq = _quantized(N, Kd, group, int4, True)
    (y,) = run(K.DEQUANT, [qw, s, z], [(N, Kd)], {"qdtype": 7 if int4 else 6, "group": group,
                                                  "K": Kd})
    close(y, deq.float())


# ---------------------------------------------------------------------------- attention
def _attention_ref(q, k, v, lo, hi, scale):
    """Per head, plain softmax over rows [lo, hi) of its kv head (GQA), fp64."""
    n_heads, hd = q.shape
    rep = n_heads // k.shape[1]
    out = torch.zeros(n_heads, hd, dtype=torch.float64)
    parts = torch.zeros(n_heads, hd + 2, dtype=torch.float64)
    for h in range(n_heads):
        kk, vv = k[lo:hi, h // rep].double(), v[lo:hi, h // rep].double()
        sc = kk @ q[h].double() * scale
        m = sc.max()
        e = torch.exp(sc - m)
        out[h] = e @ vv / e.sum()
        parts[h, :hd], parts[h, hd], parts[h, hd + 1] = e @ vv, m, e.sum()
    return out.float(), parts.float()


@pytest.mark.parametrize("n_kv", [1, 2, 4])
def test_attention_gqa_clamped_by_runtime_pos(n_kv):
    n_heads, hd, max_seq = 4, 16, 40
    q = torch.randn(1, n_heads * hd)
    k, v = torch.randn(max_seq, n_kv, hd), torch.randn(max_seq, n_kv, hd)
    pos = torch.tensor([29], dtype=torch.int32)
    params = {"head_dim": hd, "n_heads": n_heads, "n_kv_heads": n_kv, "scale": 0.3}
    (y,) = run(K.ATTENTION_TILE, [q, k, v, pos], [(1, n_heads * hd)], params)
    want, _ = _attention_ref(q.view(n_heads, hd), k, v, 0, 30, 0.3)
    close(y.view(n_heads, hd), want, 1e-4)


def test_new_kv_attention_is_refused_clearly():
    """NEW_KV (defer_kv_append, a CUDA schedule) is not a triton kernel: a clear error."""
    q, k, v = torch.randn(1, 32), torch.randn(8, 2, 16), torch.randn(8, 2, 16)
    pos, new = torch.tensor([3], dtype=torch.int32), torch.randn(1, 32)
    params = {"head_dim": 16, "n_heads": 2, "n_kv_heads": 2, "flags": 4}
    with pytest.raises(ValidationError, match="NEW_KV"):
        run(K.ATTENTION_TILE, [q, k, v, pos, new, new], [(1, 32)], params)


def test_a_long_window_is_split_over_programs_and_merged():
    """Past SPLIT_ROWS rows the kernel runs split-K (flash-decoding) into scratch partials and
    merges them; the last splits lie past pos and must get zero weight."""
    from amk.backends.triton.launch import SPLIT_ROWS
    n_heads, n_kv, hd, max_seq = 4, 2, 16, 3 * SPLIT_ROWS + 40
    q = torch.randn(1, n_heads * hd)
    k, v = torch.randn(max_seq, n_kv, hd), torch.randn(max_seq, n_kv, hd)
    pos = torch.tensor([SPLIT_ROWS + 17], dtype=torch.int32)
    params = {"head_dim": hd, "n_heads": n_heads, "n_kv_heads": n_kv, "scale": 0.25}
    (y,) = run(K.ATTENTION_TILE, [q, k, v, pos], [(1, n_heads * hd)], params)
    want, _ = _attention_ref(q.view(n_heads, hd), k, v, 0, SPLIT_ROWS + 18, 0.25)
    close(y.view(n_heads, hd), want, 1e-4)


def test_attention_partials_heads_and_empty_shard_then_combine():
    n_heads, n_kv, hd, max_seq = 4, 2, 8, 48
    q = torch.randn(n_heads * hd)
    k, v = torch.randn(max_seq, n_kv * hd), torch.randn(max_seq, n_kv * hd)   # flat rows
    pos = torch.tensor([20], dtype=torch.int32)
    base = {"head_dim": hd, "n_heads": n_heads, "n_kv_heads": n_kv, "flags": 2}
    shards = [(0, 16), (16, 16), (32, 16)]            # the last one lies past pos: empty
    parts = []
    for lo, ln in shards:
        (p,) = run(K.ATTENTION_TILE, [q, k, v, pos], [(n_heads, hd + 2)],
                   dict(base, kv_start=lo, kv_len=ln, h_off=2, h_count=2))
        assert torch.isnan(p[:2]).all()               # heads outside [h_off, h_off+h_count)
        parts.append(p)
    kv = k.view(max_seq, n_kv, hd), v.view(max_seq, n_kv, hd)
    scale = 1 / math.sqrt(hd)
    for (lo, ln), p in zip(shards[:2], parts):
        _, want = _attention_ref(q.view(n_heads, hd), *kv, lo, min(lo + ln, 21), scale)
        close(p[2:], want[2:], 1e-4)
    empty = parts[2][2:]
    assert (empty[:, :hd] == 0).all() and (empty[:, hd] == float("-inf")).all()
    assert (empty[:, hd + 1] == 0).all()
    for p in parts:
        p[:2] = parts[0][2:]                           # fill the other heads with a valid shard
    (y,) = run(K.ATTENTION_COMBINE, parts, [(n_heads * hd,)],
               {"head_dim": hd, "n_heads": n_heads, "h_off": 2, "h_count": 2})
    want, _ = _attention_ref(q.view(n_heads, hd), *kv, 0, 21, scale)
    close(y.view(n_heads, hd)[2:], want[2:], 1e-4)
    assert torch.isnan(y[:2 * hd]).all()


@pytest.mark.parametrize("pos_value,P,R", [(0, 16, 128), (200, 16, 128), (1500, 16, 128),
                                           (8191, 16, 128), (1500, 8, 256)])
def test_live_shards_of_an_8k_cache_then_combine(pos_value, P, R):
    """Split-KV's live count (kv_shard_rows R): of P shards over an 8192-row cache only
    max(1, min(P, (pos+1) // R)) split the live window; the others store nothing (their
    partials stay NaN, which the combine, given pos, never reads). P = 16 runs the stacked
    combine, P = 8 the pointer one."""
    from amk.program.regions import live_shards
    n_heads, n_kv, hd, max_seq = 4, 2, 8, 8192
    q = torch.randn(n_heads * hd)
    k, v = torch.randn(max_seq, n_kv, hd), torch.randn(max_seq, n_kv, hd)
    pos = torch.tensor([pos_value], dtype=torch.int32)
    live = live_shards(pos_value + 1, P, R)
    base = {"head_dim": hd, "n_heads": n_heads, "n_kv_heads": n_kv, "flags": 2, "kv_start": 0,
            "kv_len": max_seq, "kv_shards": P, "kv_shard_rows": R}
    parts = []
    for s in range(P):
        (p,) = run(K.ATTENTION_TILE, [q, k, v, pos], [(n_heads, hd + 2)], dict(base, kv_shard=s))
        assert bool(torch.isnan(p).all()) == (s >= live), s
        parts.append(p)
    (y,) = run(K.ATTENTION_COMBINE, parts + [pos], [(n_heads * hd,)],
               {"head_dim": hd, "n_heads": n_heads, "kv_shard_rows": R, "kv_start": 0,
                "kv_len": max_seq, "window": 0})
    want, _ = _attention_ref(q.view(n_heads, hd), k, v, 0, pos_value + 1, 1 / math.sqrt(hd))
    close(y.view(n_heads, hd), want, 1e-4)


def test_attention_batched_caches():
    B, n_heads, n_kv, hd, max_seq = 2, 2, 1, 8, 12
    q = torch.randn(B, n_heads * hd)
    k, v = torch.randn(B, max_seq, n_kv, hd), torch.randn(B, max_seq, n_kv, hd)
    pos = torch.tensor([6], dtype=torch.int32)
    (y,) = run(K.ATTENTION_TILE, [q, k, v, pos], [(B, n_heads * hd)],
               {"head_dim": hd, "n_heads": n_heads, "n_kv_heads": n_kv})
    for b in range(B):
        want, _ = _attention_ref(q[b].view(n_heads, hd), k[b], v[b], 0, 7, 1 / math.sqrt(hd))
        close(y[b].view(n_heads, hd), want, 1e-4)


def test_combine_many_partials_uses_stacked_kernel():
    n_heads, hd, P = 2, 8, 10
    parts = [torch.randn(n_heads, hd + 2) for _ in range(P)]
    for p in parts:
        p[:, hd + 1] = p[:, hd + 1].abs() + 0.5
    parts[3][:, :hd], parts[3][:, hd], parts[3][:, hd + 1] = 0, float("-inf"), 0
    (y,) = run(K.ATTENTION_COMBINE, parts, [(n_heads * hd,)], {"head_dim": hd})
    m = torch.stack([p[:, hd] for p in parts]).max(0).values
    num = sum(p[:, :hd] * torch.exp(p[:, hd] - m)[:, None] for i, p in enumerate(parts) if i != 3)
    den = sum(p[:, hd + 1] * torch.exp(p[:, hd] - m) for i, p in enumerate(parts) if i != 3)
    close(y.view(n_heads, hd), num / den[:, None], 1e-5)


# ---------------------------------------------------------------------------- movement
def _rope_ref(x, pos, inv_freq):
    half = x.shape[-1] // 2
    ang = pos.double()[..., None] * inv_freq.double()
    c, s = torch.cos(ang), torch.sin(ang)
    x1, x2 = x[..., :half].double(), x[..., half:].double()
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).float()


def test_rope_theta_and_tile():
    n_heads, hd = 4, 16
    x = torch.randn(1, n_heads * hd)
    pos = torch.tensor([37], dtype=torch.int32)
    inv = 1.0 / (500000.0 ** (torch.arange(hd // 2, dtype=torch.float64) / (hd // 2)))
    (y,) = run(K.ROPE, [x, pos], [(1, n_heads * hd)], {"head_dim": hd, "theta": 500000.0})
    close(y.view(n_heads, hd), _rope_ref(x.view(n_heads, hd), pos.float(), inv), 1e-4)
    (y,) = run(K.ROPE, [x, pos], [(1, n_heads * hd)],
               {"head_dim": hd, "theta": 500000.0, "n_off": hd, "N_tile": 2 * hd})
    close(y[:, hd:3 * hd].view(2, hd), _rope_ref(x[:, hd:3 * hd].view(2, hd), pos.float(), inv),
          1e-4)
    assert torch.isnan(y[:, :hd]).all() and torch.isnan(y[:, 3 * hd:]).all()


def test_rope_inv_freq_input_and_per_position():
    S, n_heads, hd = 3, 2, 8
    x = torch.randn(S, n_heads, hd)
    pos = torch.tensor([0, 5, 11], dtype=torch.int32)
    inv = torch.rand(hd // 2)
    (y,) = run(K.ROPE, [x, pos, inv], [(S, n_heads, hd)], {"head_dim": hd})
    close(y, _rope_ref(x, pos.float()[:, None].expand(S, n_heads), inv), 1e-4)


def test_embed():
    table = torch.randn(50, 24)
    ids = torch.tensor([3, 49, 3], dtype=torch.int32)
    (y,) = run(K.EMBED, [ids, table], [(3, 24)], {})
    assert torch.equal(y, table[ids.long()])


def test_argmax_first_max():
    x = torch.randn(3, 3000)
    x[1, 17] = x[1, 2900] = 100.0                      # a tie: the first index wins
    x[2, :] = 1.0
    (y,) = run(K.SAMPLE_ARGMAX, [x], [(3,)], {}, dtypes=[torch.int32])
    assert y.tolist() == [int(x[0].argmax()), 17, 0]


@pytest.mark.parametrize("batched", [False, True])
def test_kv_append_in_place_at_runtime_pos(batched):
    n_kv, hd, max_seq = 2, 8, 10
    shape = (2, max_seq, n_kv, hd) if batched else (max_seq, n_kv, hd)
    cache = torch.randn(shape)
    before = cache.clone()
    new = torch.randn(2 if batched else 1, n_kv * hd)
    pos = torch.tensor([7], dtype=torch.int32)
    (out,) = run(K.KV_APPEND, [new, pos], [], {}, outs=[cache])
    assert out is cache
    want = before.clone()
    if batched:
        want[:, 7] = new.view(2, n_kv, hd)
    else:
        want[7] = new.view(n_kv, hd)
    assert torch.equal(cache, want)
    (out,) = run(K.KV_APPEND, [new], [], {"pos": 2}, outs=[cache])   # the seed's param form
    assert torch.equal(cache[:, 2] if batched else cache[2], want[:, 7] if batched else want[7])


# ---------------------------------------------------------------------------- fused
def _step(op, args, out, **params):
    return {"op": int(op), "args": args, "out": out, "params": params}


def test_fused_chains_are_bit_identical_to_unfused():
    H, N = 32, 24
    x, wn, w, res = torch.randn(1, H), torch.randn(H), torch.randn(N, H), torch.randn(1, N)
    wg, wu = torch.randn(N, H), torch.randn(N, H)
    # rmsnorm -> linear -> add residual
    recipe = {"steps": [
        dict(_step(K.RMSNORM, [{"in": 0}, {"in": 1}], 0, eps=1e-6), out_shape=[1, H],
             out_dtype="float32"),
        dict(_step(K.GEMV_TILE, [{"s": 0}, {"in": 2}], 1), out_shape=[1, N], out_dtype="float32"),
        _step(K.ADD, [{"s": 1}, {"in": 3}], "final"),
    ]}
    (y,) = run(K.FUSED, [x, wn, w, res], [(1, N)], {"recipe": recipe})
    h, z, want = poisoned((1, H)), poisoned((1, N)), poisoned((1, N))
    launch_op(K.RMSNORM, [x, wn], [h], {"eps": 1e-6})
    launch_op(K.GEMV_TILE, [h, w], [z], {})
    launch_op(K.ADD, [z, res], [want], {})
    assert torch.equal(y, want)
    # gate/up linear -> silu_mul
    recipe = {"steps": [
        dict(_step(K.GEMV_TILE, [{"in": 0}, {"in": 1}], 0), out_shape=[1, N], out_dtype="float32"),
        dict(_step(K.GEMV_TILE, [{"in": 0}, {"in": 2}], 1), out_shape=[1, N], out_dtype="float32"),
        _step(K.SILU_MUL, [{"s": 0}, {"s": 1}], "final"),
    ]}
    (y,) = run(K.FUSED, [x, wg, wu], [(1, N)], {"recipe": recipe})
    g, u, want = poisoned((1, N)), poisoned((1, N)), poisoned((1, N))
    launch_op(K.GEMV_TILE, [x, wg], [g], {})
    launch_op(K.GEMV_TILE, [x, wu], [u], {})
    launch_op(K.SILU_MUL, [g, u], [want], {})
    assert torch.equal(y, want)


def test_fused_sibling_tiles_fill_one_scratch_slot():
    x, w = torch.randn(1, 16), torch.randn(8, 16)
    tile = lambda lo: dict(_step(K.GEMV_TILE, [{"in": 0}, {"in": 1}], 0, n_off=lo, N_tile=4,  # noqa: E731
                                 K=16), out_shape=[1, 8], out_dtype="f32")
    recipe = {"steps": [tile(0), tile(4), _step(K.MUL, [{"s": 0}], "final", scale=2.0)]}
    (y,) = run(K.FUSED, [x, w], [(1, 8)], {"recipe": recipe})
    close(y, 2 * (x.double() @ w.double().T).float(), 1e-4)


def test_fused_malformed_recipe_is_a_clear_error():
    x = torch.randn(4)
    bad = {"steps": [_step(K.ADD, [{"in": 0}, {"s": 5}], "final")]}
    with pytest.raises(ValidationError, match="scratch"):
        launch_op(K.FUSED, [x], [poisoned((4,))], {"recipe": bad})
    with pytest.raises(ValidationError, match="non-empty"):
        launch_op(K.FUSED, [x], [poisoned((4,))], {"recipe": {"steps": []}})


# ---------------------------------------------------------------------------- whole program
def _programs():
    """The hand-built decode program shared with tests/gpu/test_triton_gpu.py (imported from
    its file: that module compiles nothing at import)."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).parents[2] / "gpu" / "test_triton_gpu.py"
    spec = importlib.util.spec_from_file_location("_triton_gpu_programs", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_decode_program_matches_reference_vm_over_steps():
    mod = _programs()
    program, make = mod.decode_layer_program()
    mod.run_steps_vs_reference(program, make, "cpu", [(7, 0), (50, 2), (1, 15)])


def test_backend_refuses_invalid_programs_and_bad_bindings():
    from amk.errors import TraceError
    from amk.backends.triton.backend import TritonProgram
    program, make = _programs().decode_layer_program()
    broken = program.with_(tasks=tuple(t.with_(waits=()) for t in program.tasks))
    with pytest.raises(ValidationError, match="refuses"):
        TritonProgram(broken, device="cpu")
    tp = TritonProgram(program, device="cpu")
    b = make("cpu")
    del b["wq"]
    b["kv.k"] = b["kv.k"].to(torch.float64)
    b["kv.v"] = b["kv.v"].transpose(0, 1).contiguous().transpose(0, 1)   # right shape, strided
    with pytest.raises(TraceError, match="wq") as e:
        tp.run(b)
    msg = str(e.value)
    assert "'wq'" in msg and "no binding" in msg
    assert "kv.k" in msg and "dtype torch.float64" in msg
    assert "kv.v" in msg and "not contiguous" in msg
    tp.run(make("cpu"))                   # good bindings after bad ones run


def test_backend_keeps_no_reference_to_bound_tensors_after_a_run():
    # a finished generate call's cache must be freed, so the next call's cache can reuse its
    # addresses (and the CUDA graph captured for them)
    import gc
    import weakref
    from amk.backends.triton.backend import TritonProgram
    program, make = _programs().decode_layer_program()
    tp = TritonProgram(program, device="cpu")
    b = make("cpu")
    outs = tp.run(b)
    k = weakref.ref(b["kv.k"])
    assert any(o is b["kv.k"] for o in outs)          # the cache comes back as the bound tensor
    del b, outs
    gc.collect()
    assert k() is None


# ---------------------------------------------------------------------------- issue 25's ops
def test_softcap_and_tanh_gelu_match_torch():
    x = torch.randn(2, 37) * 4
    (y,) = run(K.SOFTCAP, [x], [(2, 37)], {"cap": 3.0})
    close(y, torch.tanh(x / 3.0) * 3.0, 1e-5)
    (g,) = run(K.GELU, [x], [(2, 37)], {"tanh": 1})
    close(g, torch.nn.functional.gelu(x, approximate="tanh"), 1e-5)


def test_copy_with_x_off_slices_and_places_columns():
    x = torch.randn(2, 20)
    (y,) = run(K.COPY, [x], [(2, 7)], {"x_off": 5, "n_off": 0, "N_tile": 7})
    assert torch.equal(y, x[:, 5:12])
    out = poisoned((2, 27))
    run(K.COPY, [x], [(2, 27)], {"x_off": 0, "n_off": 7, "N_tile": 20}, outs=[out])
    assert torch.equal(out[:, 7:], x) and torch.isnan(out[:, :7]).all()


def test_add_broadcasts_a_vector_over_rows():
    a, b = torch.randn(3, 11), torch.randn(11)
    (y,) = run(K.ADD, [a, b], [(3, 11)], {})
    close(y, a + b)


@pytest.mark.parametrize("window, cap", [(5, 0.0), (0, 2.5), (7, 1.5)])
def test_attention_sliding_window_and_softcap(window, cap):
    n_heads, n_kv, hd, max_seq = 4, 2, 16, 24
    q = torch.randn(1, n_heads * hd)
    k, v = torch.randn(max_seq, n_kv, hd), torch.randn(max_seq, n_kv, hd)
    pos = torch.tensor([17], dtype=torch.int32)
    params = {"head_dim": hd, "n_heads": n_heads, "n_kv_heads": n_kv, "scale": 0.3,
              "window": window, "softcap": cap}
    (y,) = run(K.ATTENTION_TILE, [q, k, v, pos], [(1, n_heads * hd)], params)
    lo = 18 - window if window else 0                    # rows (pos - window, pos]
    qh = q.view(n_heads, hd)
    kk = k[lo:18].repeat_interleave(n_heads // n_kv, dim=1)    # [L, n_heads, hd]
    vv = v[lo:18].repeat_interleave(n_heads // n_kv, dim=1)
    s = torch.einsum("hd,lhd->hl", qh, kk) * 0.3
    if cap:
        s = torch.tanh(s / cap) * cap
    want = torch.einsum("hl,lhd->hd", torch.softmax(s, -1), vv)
    close(y.view(n_heads, hd), want, 1e-4)


def test_attention_of_one_sequence_of_a_batch_writes_only_its_rows():
    """b_off/b_count (split_kv's batched tasks): sequence 1 of 3 (its cache, heads 2..3) into a
    sequence-major partial [1, 3*n_heads*(hd+2)]; the other sequences' rows stay untouched."""
    n_heads, n_kv, hd, max_seq, B = 4, 2, 8, 24, 3
    q = torch.randn(B, n_heads * hd)
    k, v = torch.randn(B, max_seq, n_kv, hd), torch.randn(B, max_seq, n_kv, hd)
    pos = torch.tensor([13], dtype=torch.int32)
    params = {"head_dim": hd, "n_heads": n_heads, "n_kv_heads": n_kv, "flags": 2,
              "h_off": 2, "h_count": 2, "b_off": 1, "b_count": 1}
    (p,) = run(K.ATTENTION_TILE, [q, k, v, pos], [(1, B * n_heads * (hd + 2))], params)
    rows = p.view(B, n_heads, hd + 2)
    assert torch.isnan(rows[0]).all() and torch.isnan(rows[2]).all() and torch.isnan(rows[1, :2]).all()
    _, want = _attention_ref(q[1].view(n_heads, hd), k[1], v[1], 0, 14, 1 / math.sqrt(hd))
    close(rows[1, 2:], want[2:], 1e-4)
