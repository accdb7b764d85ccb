"""The ops families need (issue 25): sub, a vector broadcast over the batch, slice and concat
on the feature axis, tanh / soft-cap, exact and tanh GELU, sliding-window and soft-capped
attention: shape/dtype rules, and results through amk.jit (reference VM) against torch."""
import pytest
import torch
import torch.nn.functional as F

import amk
from amk import ops
from amk.errors import TraceError
from amk.program.ir import InstructionKind as K


def run(fn, *args):
    return amk.jit(fn, backend="reference")(*args)


def test_sub_is_bit_identical_to_torch_subtraction():
    a, b = torch.randn(3, 33), torch.randn(3, 33)
    assert torch.equal(run(lambda a, b: ops.sub(a, b), a, b), a - b)
    ab, bb = a.bfloat16(), b.bfloat16()
    assert torch.equal(run(lambda a, b: ops.sub(a, b), ab, bb), (ab.float() - bb.float()).bfloat16())


@pytest.mark.parametrize("vec_shape", [(33,), (1, 33)])
def test_add_mul_sub_broadcast_a_vector_over_the_batch(vec_shape):
    x, v = torch.randn(3, 33), torch.randn(*vec_shape)
    got = run(lambda x, v: (ops.add(x, v), ops.mul(v, x), ops.sub(x, v)), x, v)
    assert torch.equal(got[0], x + v) and torch.equal(got[1], x * v) and torch.equal(got[2], x - v)
    low = amk.jit(lambda x, v: ops.add(x, v), backend="reference").lower(x, v)
    assert [t.op for t in low.program.tasks] == [K.ADD] and amk.validate(low.program).ok


def test_broadcast_shape_error_names_the_argument():
    with pytest.raises(TraceError, match=r"amk.ops.add: argument 'b' shape \[3, 5\] neither matches"):
        run(lambda x, v: ops.add(x, v), torch.randn(3, 33), torch.randn(3, 5))


def test_slice_and_concat_on_the_feature_axis():
    x, y = torch.randn(2, 20), torch.randn(2, 7)

    def f(x, y):
        a = ops.slice(x, 3, 11)
        return a, ops.concat([y, a, ops.slice(x, 0, 2)])

    a, c = run(f, x, y)
    assert torch.equal(a, x[:, 3:11])
    assert torch.equal(c, torch.cat([y, x[:, 3:11], x[:, 0:2]], dim=1))
    low = amk.jit(f, backend="reference").lower(x, y)
    assert amk.validate(low.program).ok
    with pytest.raises(TraceError, match=r"amk.ops.slice: argument 'start/stop' \[5, 30\)"):
        run(lambda x: ops.slice(x, 5, 30), x)
    with pytest.raises(TraceError, match=r"amk.ops.concat: argument 'xs\[1\]' has 3 rows"):
        run(lambda x, z: ops.concat([x, z]), x, torch.randn(3, 4))


def test_tanh_softcap_and_both_gelus():
    x = torch.randn(2, 29) * 5
    t, s, g, gt = run(lambda x: (ops.tanh(x), ops.softcap(x, 30.0), ops.gelu(x),
                                 ops.gelu(x, approximate="tanh")), x)
    assert torch.equal(t, torch.tanh(x))
    assert torch.equal(s, torch.tanh(x / 30.0) * 30.0)
    assert torch.equal(g, F.gelu(x)) and torch.equal(gt, F.gelu(x, approximate="tanh"))
    with pytest.raises(TraceError, match="'approximate' must be 'none' or 'tanh'"):
        run(lambda x: ops.gelu(x, approximate="fast"), x)
    with pytest.raises(TraceError, match="'cap' must be a positive float"):
        run(lambda x: ops.softcap(x, 0.0), x)


@pytest.mark.parametrize("window, cap", [(4, None), (None, 2.0), (6, 3.0), (64, None)])
def test_attention_window_and_softcap_against_torch(window, cap):
    nh, nkv, hd, S = 4, 2, 8, 40
    q = torch.randn(1, nh * hd)
    k, v = torch.randn(S, nkv, hd), torch.randn(S, nkv, hd)
    pos = torch.tensor([25], dtype=torch.int32)

    def f(q, k, v, pos):
        return ops.attention(q, k, v, pos, nh, nkv, hd, window=window, softcap=cap)

    got = run(f, q, k, v, pos)
    lo = max(0, 26 - window) if window else 0
    kk = k[lo:26].repeat_interleave(nh // nkv, 1)
    vv = v[lo:26].repeat_interleave(nh // nkv, 1)
    sc = torch.einsum("hd,lhd->hl", q.view(nh, hd), kk) / hd ** 0.5
    if cap:
        sc = torch.tanh(sc / cap) * cap
    want = torch.einsum("hl,lhd->hd", torch.softmax(sc, -1), vv).reshape(1, -1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_windowed_attention_survives_split_kv():
    """split_kv cuts the cache into shards; the window must clamp each one (an empty shard has
    zero weight), giving the unsplit result."""
    from amk.passes.options import PassOptions
    nh, nkv, hd, S = 4, 2, 8, 64
    q, k, v = torch.randn(1, nh * hd), torch.randn(S, nkv, hd), torch.randn(S, nkv, hd)
    pos = torch.tensor([50], dtype=torch.int32)

    def f(q, k, v, pos):
        return ops.attention(q, k, v, pos, nh, nkv, hd, window=9)

    whole = run(f, q, k, v, pos)
    split = amk.jit(f, backend="reference", options=PassOptions(attn_splits=4))
    assert any(t.op is K.ATTENTION_COMBINE for t in split.lower(q, k, v, pos).program.tasks)
    torch.testing.assert_close(split(q, k, v, pos), whole, rtol=1e-5, atol=1e-6)


def test_attention_window_must_be_positive():
    q, k = torch.randn(1, 16), torch.randn(8, 1, 16)
    with pytest.raises(TraceError, match="'window' must be a positive"):
        run(lambda q, k, p: ops.attention(q, k, k, p, 1, 1, 16, window=0), q, k,
            torch.zeros(1, dtype=torch.int32))
