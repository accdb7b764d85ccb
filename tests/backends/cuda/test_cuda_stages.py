"""The CUDA backend's stages are stages like the passes': after `place`, Lowered.stages holds
the folded program, the lowered tables, kernel.cu and the cubin; AMK_DUMP_IR writes them
beside the pass stages; AMK_CUDA_SOURCE feeds an edited kernel.cu back in. (NVRTC only.)"""
import re

import pytest

pytest.importorskip("cuda.bindings")

import amk  # noqa: E402
from amk.models.presets import TINY_LLAMA, random_model  # noqa: E402

BACKEND_STAGES = ["cuda_folded", "cuda_tables", "kernel.cu", "cubin"]


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("AMK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("AMK_CUDA_SOURCE", raising=False)
    return random_model(TINY_LLAMA)


def _lower(m):
    return amk.jit(m.fn, donate=("kv",), backend="cuda").lower(*m.example_args())


def test_the_backend_stages_follow_the_pass_stages_and_name_every_op(tiny):
    low = _lower(tiny)
    names = list(low.stages)
    assert names[names.index("place") + 1:] == BACKEND_STAGES
    folded, tables = low.stages["cuda_folded"], low.stages["cuda_tables"]
    assert "GEMV_TILE op_gemv_direct<" in folded and "ATTENTION_TILE op_attention_smem<" in folded
    assert re.search(r"^d\d+ FUSED ", tables, re.M) and "# waits" in tables
    for text in (folded, tables):                # opcodes by name, never by number
        assert not re.search(r"['\"]op['\"]: \d", text)
    assert low.stages["kernel.cu"].startswith("// AMK megakernel")
    assert low.stages["cubin"].startswith("cubin: ") and low.cuda_build().compiled.cubin[:4] == b"\x7fELF"


def test_dump_ir_writes_kernel_cu_and_the_cubin_beside_the_pass_stages(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("AMK_DUMP_IR", str(tmp_path / "dump"))
    low = _lower(tiny)
    (d,) = (tmp_path / "dump").iterdir()
    files = sorted(p.name for p in d.iterdir())
    assert "kernel.cu" in files and "kernel.cubin" in files and "repro.py" in files
    assert any(f.endswith("_place.txt") for f in files) and any(f.endswith("_cuda_tables.txt") for f in files)
    assert (d / "kernel.cu").read_text() == low.stages["kernel.cu"] + "\n"
    assert (d / "kernel.cubin").read_bytes()[:4] == b"\x7fELF"
    place = next(f for f in files if f.endswith("_place.txt"))
    assert place in (d / "repro.py").read_text()          # repro re-parses the final program


def test_an_edited_kernel_cu_is_compiled_instead(tiny, tmp_path, monkeypatch):
    src = _lower(tiny).stages["kernel.cu"]
    edited = tmp_path / "kernel.cu"
    edited.write_text(src + "\n// an experiment\n")
    monkeypatch.setenv("AMK_CUDA_SOURCE", str(edited))
    low = _lower(tiny)
    assert low.stages["kernel.cu"].endswith("// an experiment\n")
    assert low.cuda_build().compiled.key != _key_of(tiny, monkeypatch)


def _key_of(m, monkeypatch):
    monkeypatch.delenv("AMK_CUDA_SOURCE")
    return _lower(m).cuda_build().compiled.key


def test_without_nvrtc_the_text_stages_are_still_there(tiny, monkeypatch):
    from amk.backends.cuda import stages
    from amk.errors import BackendUnavailable

    def no_nvrtc(*a, **k):
        raise BackendUnavailable("the CUDA backend needs cuda-python's NVRTC bindings")
    monkeypatch.setattr(stages, "compile_source", no_nvrtc)
    st = _lower(tiny).stages
    assert st["cubin"] == "cubin: not built (the CUDA backend needs cuda-python's NVRTC bindings)"
    assert "op_gemv_direct<" in st["kernel.cu"] and st["cuda_folded"].startswith("# ")
