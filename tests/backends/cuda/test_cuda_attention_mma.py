"""The tensor-core attention (op_attention_mma, templates/attention_mma.cuh) on the CPU: which
attentions take it (a batch's bf16 q, K and V of head dim 64 or 128), that a batched step's
folds (q and new-k rope) still reach it, and that its cases compile for sm_90a (the GPU test
against the reference is tests/gpu/test_attention_mma_gpu.py)."""
from dataclasses import replace

import pytest
import torch

pytest.importorskip("cuda.bindings")

from amk.program.ir import DType as D  # noqa: E402
from amk.backends.cuda import compile_source, render  # noqa: E402
from amk.backends.cuda.lower import lower_program  # noqa: E402
from amk.models.presets import LLAMA_3_2_1B, QWEN3_0_6B, random_model  # noqa: E402
from amk.testing import attention_mma_examples  # noqa: E402
from amk.testing.attention_mma_examples import _case  # noqa: E402
from amk.testing.cuda_examples import combined_program  # noqa: E402


def _fn(case) -> str:
    (v,) = lower_program(case.program).variants
    return v.fn


@pytest.mark.parametrize("case", attention_mma_examples.cases(), ids=lambda c: c.name)
def test_every_case_takes_op_attention_mma(case):
    assert _fn(case) == "op_attention_mma"


def test_what_stays_on_the_cuda_core_attention():
    """Batch 1, head dims the mma path does not take (32, 256), and f32 caches: op_attention_smem."""
    assert _fn(_case("b1", 1, 64, 4, 2, 64, [40])) == "op_attention_smem"
    assert _fn(_case("hd32", 2, 64, 4, 2, 32, [40])) == "op_attention_smem"
    assert _fn(_case("hd256", 2, 64, 4, 2, 256, [40])) == "op_attention_smem"
    c = _case("f32_cache", 2, 64, 4, 2, 64, [40])
    bufs = tuple(replace(b, dtype=D.F32) if b.name in ("k", "v") else b for b in c.program.buffers)
    assert _fn(replace(c, program=c.program.with_(buffers=bufs))) == "op_attention_smem"


@pytest.mark.parametrize("cfg", [LLAMA_3_2_1B, QWEN3_0_6B], ids=["llama-3.2-1b", "qwen3-0.6b"])
def test_a_batched_step_attends_on_tensor_cores_with_its_ropes_folded(cfg):
    m = random_model(replace(cfg, max_seq=1088, n_layers=1), device="meta")
    low = m.lower(backend="cuda", batch=16)
    folded = str(low.stages["cuda_folded"]).splitlines()
    at = [i for i, ln in enumerate(folded) if "op_attention_mma<" in ln]
    assert at and not any("op_attention_smem<" in ln for ln in folded)
    assert all("Q_ROPE=1" in folded[i + 1] and "K_ROPE=1" in folded[i + 1] for i in at)


def test_the_cases_compile_for_sm90a():
    res = compile_source(render(combined_program(attention_mma_examples.cases())), "sm_90a")
    assert res.cubin[:4] == b"\x7fELF"
