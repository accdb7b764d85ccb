"""The tensor-core attention (op_attention_mma) on the GPU against the reference semantics: every
case of amk.testing.attention_mma_examples (head dims 64 and 128, GQA 1 to 16, windows of
several chunks, pieces, NEW_KV, a soft-cap, an empty window, a task over some sequences), outputs
poisoned with NaN first: rows the task does not own stay NaN, the others match."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cuda.bindings")

from amk.testing import attention_mma_examples  # noqa: E402
from amk.testing.cuda_check import run_cases  # noqa: E402

CASES = attention_mma_examples.cases()


@pytest.fixture(scope="module")
def runs():
    return run_cases(CASES, seed=5)


@pytest.mark.parametrize("case", [c.name for c in CASES])
def test_mma_attention_matches_reference(runs, case):
    prog, ref, got = runs
    (t,) = [t for t in prog.tasks if t.name == case]
    o = t.outputs[0]
    want, have = ref[o].float(), got[o].float().cpu()
    assert torch.equal(want.isnan(), have.isnan()), f"{case}: written where it should not be, or not written"
    assert torch.equal(want.isneginf(), have.isneginf()), f"{case}: an empty window's m differs"
    ok = want.isfinite()
    w, h = want[ok], have[ok]
    rel = ((h - w).norm() / w.norm()).item()
    # f32 outputs: the mma's sums of exact bf16 products, P to ~2^-16; bf16: its rounding
    assert rel < (2e-3 if prog.buffers[o].dtype.name == "F32" else 1e-2), f"{case}: relative error {rel:.2e}"
