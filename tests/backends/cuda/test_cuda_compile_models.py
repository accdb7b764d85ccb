"""CPU CI: every model's decode step, and random property programs, render to CUDA that NVRTC
compiles to an sm_90a cubin (no GPU needed)."""
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings

pytest.importorskip("cuda.bindings")

import amk  # noqa: E402
from amk.models.llama import DecoderConfig  # noqa: E402
from amk.models.presets import LLAMA_3_2_1B, QWEN3_0_6B, TINY_LLAMA, random_model  # noqa: E402
from amk.testing import decode_steps  # noqa: E402

SMOLLM2_SHAPE = DecoderConfig(vocab=49152, hidden=576, n_layers=30, n_heads=9, n_kv_heads=3,
                              head_dim=64, ffn=1536, rope_theta=100000.0, tie_embeddings=True,
                              max_seq=512, dtype=torch.float32, arch="smollm2")


def assert_cubin(low):
    cubin = low.compile_cuda(arch="sm_90a")
    assert cubin[:4] == b"\x7fELF", "NVRTC must return a cubin (ELF), never PTX"
    return cubin


@pytest.mark.parametrize("name,cfg,device,fmt", [
    ("tiny-llama f32", TINY_LLAMA, "cpu", None),
    ("tiny-llama bf16", replace(TINY_LLAMA, dtype=torch.bfloat16), "cpu", None),
    ("tiny-llama int8", TINY_LLAMA, "cpu", "int8"),
    ("tiny-llama int4", replace(TINY_LLAMA, dtype=torch.bfloat16), "cpu", "int4"),
    ("tiny-llama fp8", replace(TINY_LLAMA, dtype=torch.bfloat16), "cpu", "fp8"),
    ("tiny qwen2 (biases) int8", replace(TINY_LLAMA, qkv_bias=True, arch="qwen2"), "cpu", "int8"),
    ("smollm2-135m shape", SMOLLM2_SHAPE, "meta", None),
    ("llama-3.2-1b shape", replace(LLAMA_3_2_1B, max_seq=1088), "meta", None),
    # two kv heads at an 8K cache: 64 shards a head made a 66-operand combine (max_kv_shards)
    ("tiny-llama at an 8K cache", replace(TINY_LLAMA, max_seq=8192), "meta", None),
    # head dim 128 at an 8K cache: the o tiles' fold stages 16 partials of 8.3 KB
    ("qwen3-0.6b shape", replace(QWEN3_0_6B, n_layers=2, max_seq=8192), "meta", None),
])
def test_model_decode_steps_compile_for_sm90a(name, cfg, device, fmt):
    m = random_model(cfg, device=device)
    if fmt is not None:
        m.quantize(fmt, group=32)
    low = m.lower(backend="cuda")
    assert low.options.target.num_sms >= 100          # shaped for a GPU, not the CPU target
    assert_cubin(low)


# Qwen2-7B's FFN width: the down projection's K (18944) is past the work area (XS_MAX 16384)
WIDE_FFN = DecoderConfig(vocab=4096, hidden=512, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=64,
                         ffn=18944, qkv_bias=True, arch="qwen2", max_seq=512, dtype=torch.bfloat16)


def _k_variant(low, k: int) -> str:
    """The device function of the first step whose GEMV has this K (cuda_folded stage)."""
    lines = low.stages["cuda_folded"].split("\n")
    i = next(i for i, ln in enumerate(lines) if f" K={k} " in ln)
    return lines[i - 1].split(":", 1)[1].split()[1].split("<")[0]


@pytest.mark.parametrize("fmt,batch,fn", [(None, 1, "op_gemv_direct"), ("int4", 1, "op_gemv_qdirect"),
                                          ("int8", 1, "op_gemv_qdirect"), (None, 16, "op_gemv_mma")])
def test_a_down_projection_wider_than_the_work_area_compiles(fmt, batch, fn):
    """At batch 1 its x runs into the staging area (smem.GEMV_X_MAX); the batched GEMV takes x in
    windows. Both refused K > 16384 before."""
    from amk.backends.cuda.smem import GEMV_X_MAX, XS_MAX
    assert XS_MAX < WIDE_FFN.ffn < GEMV_X_MAX
    m = random_model(WIDE_FFN, device="cpu" if fmt else "meta")
    if fmt is not None:
        m.quantize(fmt)
    low = m.lower(backend="cuda", batch=batch)
    assert _k_variant(low, WIDE_FFN.ffn) == fn
    assert_cubin(low)


def test_a_k_that_fills_the_work_area_takes_the_direct_gemv_too():
    """K = XS_MAX exactly: x fills the work area and the sums run past it, as for a larger K
    (one bound, GEMV_X_MAX); with the work area's bound this tile fell to the generic op_gemv."""
    from amk.backends.cuda.smem import XS_MAX
    low = random_model(replace(WIDE_FFN, ffn=XS_MAX), device="meta").lower(backend="cuda")
    assert _k_variant(low, XS_MAX) == "op_gemv_direct"


# Llama-3-70B's FFN width: the down projection's K (28672) is past smem.GEMV_X_MAX
WIDER_FFN = replace(WIDE_FFN, ffn=28672, qkv_bias=False, arch="llama")


@pytest.mark.parametrize("fmt", [None, "int4"])
def test_a_down_projection_past_the_staging_area_takes_the_tensor_core_gemv_at_batch_1(fmt):
    """op_gemv_direct and op_gemv stage all of x; op_gemv_mma takes it in windows, with the
    residual add (EPI 1). bf16 weights were refused here before."""
    from amk.backends.cuda.smem import GEMV_X_MAX
    assert WIDER_FFN.ffn > GEMV_X_MAX
    m = random_model(WIDER_FFN, device="cpu" if fmt else "meta")
    if fmt is not None:
        m.quantize(fmt)
    low = m.lower(backend="cuda", batch=1)
    lines = low.stages["cuda_folded"].split("\n")
    steps = [lines[i - 1] for i, ln in enumerate(lines) if f" K={WIDER_FFN.ffn} " in ln]
    assert steps and all("op_gemv_mma<" in s for s in steps)
    # its template's EPI (after TY, TS, TZ, QMODE, NMAT): 1, the residual add folded in
    assert all(s.split("<", 1)[1].split(", ")[5] == "1" for s in steps)
    assert_cubin(low)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_k_past_the_staging_area_without_bf16_x_is_refused_by_name(dtype):
    """The tensor-core GEMV takes bf16 x only: a float32 / float16 model this wide still fails,
    naming the task, the bound and why."""
    from amk.errors import CompileError
    low = random_model(replace(WIDER_FFN, dtype=dtype), device="meta").lower(backend="cuda")
    with pytest.raises(CompileError, match=r"task \d+ \(add .*K=28672 exceeds the 22272 elements of x a "
                                           r"GEMV at M=1 .*cannot run it .*here x is F"):
        low.compile_cuda(arch="sm_90a")


def test_tiny_qwen3_compiles_for_sm90a():
    transformers = pytest.importorskip("transformers")
    from amk.models import from_hf
    cfg = transformers.Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=32, max_position_embeddings=64)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    assert_cubin(from_hf(hf, max_seq=32).lower(backend="cuda"))


@settings(max_examples=8, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=decode_steps())
def test_random_property_programs_compile_for_sm90a(case):
    step = amk.jit(case.fn, donate=case.donate, backend="cuda")
    assert_cubin(step.lower(*case.args))


def test_a_warm_compile_reuses_the_lowered_program_from_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("AMK_CACHE_DIR", str(tmp_path))
    import amk.backends.cuda.lower as cuda_lower
    m = random_model(TINY_LLAMA)
    cold = amk.jit(m.fn, donate=("kv",), backend="cuda").lower(*m.example_args())
    cubin = cold.compile_cuda()

    def refuse(*a, **k):
        raise AssertionError("lower_program ran again on a warm compile")

    monkeypatch.setattr(cuda_lower, "lower_program", refuse)
    warm = amk.jit(m.fn, donate=("kv",), backend="cuda").lower(*m.example_args())
    assert warm.timings["cache_hit"] and warm.program is not cold.program
    assert warm.compile_cuda() == cubin
