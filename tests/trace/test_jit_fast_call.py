"""amk.jit's per-call fast path (the last call's structure, generated straight-line access):
the same results as the full path, and every bad input still a clear error."""
import pytest
import torch

import amk
from amk import ops
from amk.errors import TraceError


def _step(params, x, kv):
    y = ops.add(ops.mul(x, params["w"][0]), params["b"])
    return y, kv


def _args():
    params = {"w": [torch.full((4,), 2.0)], "b": torch.ones(4)}
    return params, torch.arange(4.0), [{"k": torch.zeros(4)}]


def test_fast_path_tracks_new_leaves_and_keeps_the_checks():
    f = amk.jit(_step, backend="reference")
    params, x, kv = _args()
    assert torch.equal(f(params, x, kv)[0], x * 2 + 1)
    assert f._fast is not None
    assert torch.equal(f(params, x + 1, kv)[0], (x + 1) * 2 + 1)      # a new leaf tensor
    params["b"] = torch.full((4,), 5.0)                                # a new weight, same shape
    assert torch.equal(f(params, x, kv)[0], x * 2 + 5)
    params["w"][0] = torch.full((4,), 3.0)                             # inside a list
    assert torch.equal(f(params, x, kv)[0], x * 3 + 5)
    assert f.trace_count == 1
    with pytest.raises(TraceError):
        f(params, torch.arange(4), kv)                                  # int64, not f32: new sig
    # wrong-shape input after the fast path was set up: a new signature (retrace), as before
    y, _ = f(params, torch.arange(8.0).reshape(2, 4), kv)
    assert y.shape == (2, 4) and f.trace_count == 2
    with pytest.raises(TraceError, match="not a tensor"):
        f(params, 3.0, kv)
    params["extra"] = torch.ones(1)                                     # a new key: full path
    assert torch.equal(f(params, x, kv)[0], x * 3 + 5)
    del params["extra"], params["b"]
    with pytest.raises(Exception):
        f(params, x, kv)                                                # a missing key


def test_keyword_calls_take_the_full_path():
    f = amk.jit(_step, backend="reference")
    params, x, kv = _args()
    a = f(params, x, kv)[0]
    assert torch.equal(f(params, x=x, kv=kv)[0], a)
    assert torch.equal(f(params, x, kv)[0], a)
