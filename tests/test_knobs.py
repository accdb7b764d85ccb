"""Every environment knob is read in amk/knobs.py: bad values are clear errors, and the knobs
that change the CUDA backend's output are part of its cache keys."""
import pytest

from amk import knobs


@pytest.mark.parametrize("name, bad", [
    ("AMK_SPIN_NS", "8"), ("AMK_COUNTER_STRIDE", "3"), ("AMK_PRELOAD", "65552"),
    ("AMK_PRELOAD", "100")])
def test_a_bad_knob_value_names_the_knob(monkeypatch, name, bad):
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=name):
        knobs.backend_knobs()


@pytest.mark.parametrize("name, value", [
    ("AMK_SPIN_NS", "1024"), ("AMK_COUNTER_STRIDE", "64"), ("AMK_PRELOAD", "0")])
def test_backend_knobs_change_the_cache_keys(monkeypatch, name, value):
    from amk.backends.cuda import examples, lowered_cache
    prog = examples.combined_program()
    monkeypatch.delenv(name, raising=False)
    before = (knobs.backend_knobs(), lowered_cache._key(prog, 132))
    monkeypatch.setenv(name, value)
    after = (knobs.backend_knobs(), lowered_cache._key(prog, 132))
    assert before[0] != after[0] and before[1] != after[1]


def test_defaults(monkeypatch):
    for name in ("AMK_SPIN_NS", "AMK_COUNTER_STRIDE", "AMK_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    assert knobs.spin_ns() == 128 and knobs.counter_stride() == 1
    assert knobs.preload_bytes() == 65536


def test_jit_lowers_again_when_a_backend_knob_changes(monkeypatch):
    """The in-memory cache of amk.jit keys on the backend knobs too (a cuda build made under
    other knobs must not be reused)."""
    import torch
    import amk
    from amk import ops
    monkeypatch.delenv("AMK_SPIN_NS", raising=False)
    f = amk.jit(lambda w, x: ops.linear(x, w))
    w, x = torch.randn(8, 4), torch.randn(1, 4)
    f(w, x)
    f(w, x)
    assert f.trace_count == 1
    monkeypatch.setenv("AMK_SPIN_NS", "1024")
    f(w, x)
    assert f.trace_count == 2
