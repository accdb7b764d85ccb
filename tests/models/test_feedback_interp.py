"""The device loop's feedback kernel (amk/models/feedback.py) on the CPU under the Triton
interpreter: the token lands in the token input and the slot, pos advances (one position or
one a sequence), and the EOS flags only ever turn on. On a GPU, tests/gpu/test_generate_gpu.py
checks the loop's tokens against the per-step path."""
import importlib
import os
import sys

import pytest
import torch

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CUDA present: tests/gpu covers the feedback kernel", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"          # before triton decorates the kernel
pytest.importorskip("triton")
if "amk.models.feedback" in sys.modules:      # imported earlier without the interpreter
    importlib.reload(sys.modules["amk.models.feedback"])
from amk.models.feedback import feedback  # noqa: E402


def _i32(*v):
    return torch.tensor(v, dtype=torch.int32)


@pytest.mark.parametrize("npos", [1, 3])
def test_feedback_writes_the_token_advances_pos_and_sets_eos_flags(npos):
    tok, token_in = _i32(5, 7, 9), _i32(0, 0, 0)
    pos = _i32(4, 10, 2)[:npos].clone()
    slot, done = torch.full((2, 3), -1, dtype=torch.int32), _i32(0, 0, 1)
    feedback(tok, token_in, pos, slot, done, eos=7)
    assert token_in.tolist() == [5, 7, 9] and pos.tolist() == [5, 11, 3][:npos]
    assert slot.tolist() == [[5, 7, 9], [0, 1, 1]] and done.tolist() == [0, 1, 1]
    feedback(_i32(1, 2, 3), token_in, pos, slot, done, eos=None)   # no EOS: flags untouched
    assert token_in.tolist() == [1, 2, 3] and pos.tolist() == [6, 12, 4][:npos]
    assert slot.tolist() == [[1, 2, 3], [0, 1, 1]] and done.tolist() == [0, 1, 1]
