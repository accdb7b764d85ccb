"""Tracing and amk.jit: the graph text, hash-consing, signature caching, input errors."""
import pytest
import torch

import amk
from amk import ops
from amk.errors import TraceError
from amk.graph import verify_graph

I32 = torch.int32


def tiny_params(h=16, v=12, dt=torch.float32):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(dt)
    return {"embed": r(v, h), "norm": r(h), "w1": r(2 * h, h), "w2": r(h, 2 * h), "lm": r(v, h)}


def mlp_step(params, token, pos):
    x = ops.embed(params["embed"], token)
    h = ops.rmsnorm(x, params["norm"], 1e-5)
    y = ops.add(x, ops.linear(ops.gelu(ops.linear(h, params["w1"])), params["w2"]))
    logits = ops.linear(y, params["lm"])
    return ops.argmax(logits), logits


def test_graph_text_is_one_equation_per_line_with_source():
    f = amk.jit(mlp_step)
    low = f.lower(tiny_params(), torch.tensor([1], dtype=I32), torch.tensor([0], dtype=I32))
    text = str(low.graph)
    lines = text.splitlines()
    assert lines[:8] == ["{ lambda",                 # one input per line, in argument order
                         "    params.embed:f32[12,16]",
                         "    params.norm:f32[16]",
                         "    params.w1:f32[32,16]",
                         "    params.w2:f32[16,32]",
                         "    params.lm:f32[12,16]",
                         "    token:i32[1]",
                         "    pos:i32[1] ."]
    eqns = lines[8:-1]
    prims = [l.split("=")[1].split()[0] for l in eqns]
    assert prims == ["embed", "rmsnorm", "linear", "gelu", "linear", "add", "linear", "argmax"]
    assert eqns[0].startswith("  %7:f32[1,16] = embed params.embed token ")
    assert all("test_trace.py:" in l for l in eqns)
    assert lines[-1].strip().startswith("in (")
    verify_graph(low.graph)


def test_identical_equations_are_recorded_once():
    def f(params, token, pos):
        x = ops.embed(params["embed"], token)
        a = ops.rmsnorm(x, params["norm"])
        b = ops.rmsnorm(x, params["norm"])
        return ops.add(a, b)
    low = amk.jit(f).lower(tiny_params(), torch.tensor([1], dtype=I32), torch.tensor([0], dtype=I32))
    assert [e.prim for e in low.graph.eqns] == ["embed", "rmsnorm", "add"]


def test_new_data_is_not_a_new_signature():
    f = amk.jit(mlp_step)
    p = tiny_params()
    outs = []
    for t in range(10):
        tok, logits = f(p, torch.tensor([t], dtype=I32), torch.tensor([t], dtype=I32))
        outs.append(int(tok))
        ref = ops_reference(p, t)
        torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
        assert int(tok) == int(ref.argmax())
    assert f.trace_count == 1
    f(tiny_params(dt=torch.bfloat16), torch.tensor([1], dtype=I32), torch.tensor([0], dtype=I32))
    assert f.trace_count == 2          # a new dtype is a new signature


def ops_reference(p, t):
    x = p["embed"][[t]]
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * p["norm"]
    y = x + torch.nn.functional.gelu(h @ p["w1"].T) @ p["w2"].T
    return y @ p["lm"].T


def _call(fn, params=None, token=None, pos=None):
    params = params if params is not None else tiny_params()
    token = token if token is not None else torch.tensor([1], dtype=I32)
    pos = pos if pos is not None else torch.tensor([0], dtype=I32)
    return amk.jit(fn).lower(params, token, pos)


def test_wrong_dtype_names_op_argument_and_line():
    with pytest.raises(TraceError, match=r"amk.ops.embed: argument 'ids' must have dtype i32, got i64 \(at test_trace.py:\d+\)"):
        _call(mlp_step, token=torch.tensor([1]))


def test_mismatched_shapes_name_the_weight():
    p = tiny_params()
    p["w2"] = torch.randn(16, 31)
    with pytest.raises(TraceError, match=r"amk.ops.linear: argument 'weight' shape \[16, 31\].*K_in 31 != 32"):
        _call(mlp_step, params=p)


def test_missing_weight_is_an_amk_error_naming_the_key():
    p = tiny_params()
    del p["w1"]
    with pytest.raises(TraceError, match=r"params\['w1'\] does not exist \(test_trace.py:\d+\); params has \['embed', 'lm', 'norm', 'w2'\]"):
        _call(mlp_step, params=p)


def test_non_tensor_leaf_names_its_path():
    p = tiny_params()
    p["norm"] = [1.0] * 16
    with pytest.raises(TraceError, match=r"params.norm.0: leaf of type float is not a tensor"):
        _call(mlp_step, params=p)


def test_captured_concrete_tensor_is_refused():
    w = torch.randn(16, 16)
    def f(params, token, pos):
        return ops.linear(ops.embed(params["embed"], token), w)
    with pytest.raises(TraceError, match="concrete tensor captured"):
        _call(f)


def test_ops_outside_jit_say_so():
    with pytest.raises(TraceError, match="outside amk.jit"):
        ops.add(torch.ones(1, 2), torch.ones(1, 2))


def test_control_flow_on_traced_values_is_an_error():
    def f(params, token, pos):
        x = ops.embed(params["embed"], token)
        if x:
            return x
        return x
    with pytest.raises(TraceError, match="control flow"):
        _call(f)


def test_attention_rules_check_heads_and_cache():
    def f(params, token, pos, kv):
        q = ops.embed(params["embed"], token)          # [1, 16] = 4 heads x 4
        return ops.attention(q, kv["k"], kv["v"], pos, n_heads=4, n_kv_heads=3, head_dim=4)
    kv = {"k": torch.zeros(8, 2, 4), "v": torch.zeros(8, 2, 4)}
    with pytest.raises(TraceError, match="n_kv_heads.*3 must divide n_heads 4"):
        amk.jit(f).lower(tiny_params(), torch.tensor([1], dtype=I32), torch.tensor([0], dtype=I32), kv)
    def g(params, token, pos, kv):
        q = ops.embed(params["embed"], token)
        return ops.attention(q, kv["k"], kv["v"], pos, n_heads=4, n_kv_heads=2, head_dim=4)
    with pytest.raises(TraceError, match=r"argument 'pos' must be int32 of shape \[1\]"):
        amk.jit(g).lower(tiny_params(), torch.tensor([1], dtype=I32), torch.tensor([0, 1], dtype=I32), kv)


def test_reading_the_old_cache_after_kv_update_is_refused():
    def f(params, token, pos, kv):
        x = ops.embed(params["embed"], token)              # [1, 16]: 4 kv heads x 4
        new = ops.kv_update(kv["k"], x, pos)
        return ops.attention(x, kv["k"], new, pos, 4, 4, 4)
    kv = {"k": torch.zeros(8, 4, 4)}
    with pytest.raises(TraceError, match="used again after it was updated"):
        amk.jit(f, donate=("kv",)).lower(tiny_params(), torch.tensor([1], dtype=I32),
                                         torch.tensor([0], dtype=I32), kv)


def test_the_cuda_backend_on_cpu_tensors_says_what_to_do():
    with pytest.raises(amk.BackendUnavailable, match="backend 'cuda' needs CUDA tensors"):
        amk.jit(mlp_step, backend="cuda")(tiny_params(), torch.tensor([1], dtype=I32),
                                          torch.tensor([0], dtype=I32))
