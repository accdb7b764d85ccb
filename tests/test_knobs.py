"""Every environment knob is read in amk/knobs.py, by one function each: bad values are clear
errors, the CUDA backend gets its knobs once as a CudaOptions built at the edge (amk.jit), and
the options that change its output are part of its cache keys."""
import re
from pathlib import Path

import pytest

from amk import knobs
from amk.backends.cuda import CudaOptions

AMK = Path(__file__).parents[1] / "amk"


@pytest.mark.parametrize("name, bad", [
    ("AMK_SPIN_NS", "8"), ("AMK_COUNTER_STRIDE", "3"), ("AMK_PRELOAD", "65552"),
    ("AMK_PRELOAD", "100"), ("AMK_SPIN_NS", "fast"), ("AMK_CUDA_SOURCE", "/nonexistent/kernel.cu")])
def test_a_bad_knob_value_names_the_knob(monkeypatch, name, bad):
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=name):
        knobs.cuda_options()


@pytest.mark.parametrize("name, value", [
    ("AMK_SPIN_NS", "1024"), ("AMK_COUNTER_STRIDE", "64"), ("AMK_PRELOAD", "0"),
    ("AMK_PROFILE", "1"), ("AMK_LINEINFO", "1")])
def test_cuda_knobs_change_the_cache_keys(monkeypatch, name, value):
    from amk.backends.cuda import lowered_cache
    from amk.testing import cuda_examples as examples
    prog = examples.combined_program()
    monkeypatch.delenv(name, raising=False)
    before = knobs.cuda_options()
    monkeypatch.setenv(name, value)
    after = knobs.cuda_options()
    assert before.key() != after.key()
    assert lowered_cache._key(prog, 132, before) != lowered_cache._key(prog, 132, after)


def test_the_source_override_is_keyed_by_its_content(monkeypatch, tmp_path):
    src = tmp_path / "kernel.cu"
    src.write_text("// one\n")
    monkeypatch.setenv("AMK_CUDA_SOURCE", str(src))
    one = knobs.cuda_options()
    assert one.source == "// one\n" and one.source_path == str(src)
    src.write_text("// two\n")
    assert knobs.cuda_options().key() != one.key()
    monkeypatch.delenv("AMK_CUDA_SOURCE")
    assert knobs.cuda_options().source is None


def test_defaults_are_the_options_defaults(monkeypatch):
    for name in ("AMK_SPIN_NS", "AMK_COUNTER_STRIDE", "AMK_PRELOAD", "AMK_PROFILE",
                 "AMK_LINEINFO", "AMK_CUDA_SOURCE", "AMK_WATCHDOG_S"):
        monkeypatch.delenv(name, raising=False)
    assert knobs.cuda_options() == CudaOptions(cache_dir=knobs.cache_dir())
    assert (CudaOptions().spin_ns, CudaOptions().counter_stride,
            CudaOptions().preload_bytes) == (128, 1, 65536)


def test_jit_reads_the_cuda_knobs_once_per_function(monkeypatch):
    """Jitted._key does not read the knobs at every call: a function keeps the options of its
    first call; a new amk.jit sees a changed knob."""
    import torch
    import amk
    from amk import ops
    monkeypatch.delenv("AMK_SPIN_NS", raising=False)
    f = amk.jit(lambda w, x: ops.linear(x, w))
    w, x = torch.randn(8, 4), torch.randn(1, 4)
    f(w, x)
    monkeypatch.setenv("AMK_SPIN_NS", "1024")
    f(w, x)
    assert f.trace_count == 1 and f.cuda_options.spin_ns == 128
    g = amk.jit(lambda w, x: ops.linear(x, w))
    assert g.lower(w, x).cuda_options.spin_ns == 1024


def test_no_backend_module_reads_the_environment_or_imports_amk_itself():
    for f in sorted((AMK / "backends").rglob("*.py")):
        text = f.read_text()
        assert not re.search(r"^\s*import amk\s*$", text, re.M), f
        if f.parent.name == "cuda":
            assert "os.environ" not in text and "knobs" not in text.replace("amk.knobs.cuda_options", ""), f
    assert "knobs" not in (AMK / "passes" / "options.py").read_text()
