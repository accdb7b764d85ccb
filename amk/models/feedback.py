"""The device loop's token feedback as one kernel: after a decode step, the sampled token goes
into the program's token input and the step's slot, pos advances by one, and (with an EOS id)
the done flags and their slot are updated. As separate torch ops that was three to five small
kernels between two megakernel launches in every captured step (generate at 1.050-1.059x the
kernel's step, NOTES v22); one Triton launch does it all (capturable in a CUDA graph)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


# The slot of step k moves by 8 B a sequence with k, and eos may be 1 or a multiple of 16:
# Triton would compile a variant per alignment or value, one of them inside the graph capture
# (only step 0 runs eagerly before it); one variant for all.
@triton.jit(do_not_specialize=["slot", "eos"])
def _feedback(tok, token_in, pos, slot, done, eos, B, NPOS, HAS_EOS: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.arange(0, BLOCK)
    m = b < B
    t = tl.load(tok + b, mask=m)
    tl.store(token_in + b, t, mask=m)
    tl.store(slot + b, t, mask=m)                     # slot [2, B]: token, done
    if HAS_EOS:
        d = tl.load(done + b, mask=m) | (t == eos).to(tl.int32)
        tl.store(done + b, d, mask=m)
        tl.store(slot + B + b, d, mask=m)
    pm = b < NPOS
    tl.store(pos + b, tl.load(pos + b, mask=pm) + 1, mask=pm)


def feedback(tok: torch.Tensor, token_in: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor,
             done: torch.Tensor, eos: int | None) -> None:
    """tok int32 [B] -> token_in (int32 [B]) and slot[0]; pos (int32 [1] or [B]) += 1; with
    eos: done (int32 [B]) |= tok == eos, and slot[1] = done. slot: int32 [2, B], contiguous."""
    B = tok.numel()
    _feedback[(1,)](tok, token_in, pos, slot, done, -1 if eos is None else int(eos), B,
                    pos.numel(), HAS_EOS=eos is not None,
                    BLOCK=triton.next_power_of_2(max(B, pos.numel())))
