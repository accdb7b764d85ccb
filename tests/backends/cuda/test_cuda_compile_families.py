"""CPU CI: issue 25's families render to CUDA that NVRTC compiles for sm_90a, and their new
ops reach the descriptors (window, soft-cap, op_ewx kinds)."""
import sys
from pathlib import Path

import pytest

pytest.importorskip("cuda.bindings")
pytest.importorskip("transformers")

from amk.backends.cuda import abi  # noqa: E402
from amk.backends.cuda.codegen import call_text  # noqa: E402
from amk.backends.cuda.lower import lower_program  # noqa: E402
from amk.models import from_hf  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "models"))
from test_families import cases, tiny_hf  # noqa: E402


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AMK_CACHE_DIR", str(tmp_path))


def test_gemma2_lowers_its_windows_caps_and_gelu_into_the_descriptors():
    m = from_hf(tiny_hf(cases()["gemma2"]()), max_seq=24)
    low = lower_program(m.lower("cuda").program)
    ip = {name: i for i, name in enumerate(abi.IP_SLOTS["ATTN"])}
    attn = [t for t in low.tasks if int(t["op"]) == 7]
    assert attn, "attention descriptors"
    windows = {int(t["ip"][ip["WINDOW"]]) for t in attn}
    assert windows == {0, 6}
    assert {float(t["fp"][abi.fp_index("ATTN", "SOFTCAP")]) for t in attn} == {4.0}
    calls = [call_text(v) for v in low.variants]
    assert any("op_ewx<EWX_GELU_TANH" in c for c in calls)
    assert any("op_ewx<EWX_SOFTCAP" in c for c in calls)             # the final logit cap


@pytest.mark.parametrize("case", ["gemma2", "gpt2"])
def test_family_decode_step_compiles_for_sm90a(case, cache):
    m = from_hf(tiny_hf(cases()[case]()), max_seq=24)
    cubin = m.lower("cuda").compile_cuda(arch="sm_90a")
    assert cubin[:4] == b"\x7fELF"
