"""What a cross-rank collective computes (amk/program/collectives.py), given every rank's
input and output: the rank simulator (ranks.py) calls it once all ranks have arrived; the
single-device VM only for a world of one.

Every rank gets the same bits: the reduction runs once, in rank order, and is copied out."""
from __future__ import annotations

import torch

from amk.backends.reference.semantics_common import f32
from amk.program.collectives import MAXLOC, SUM


def reduce_ranks(reduce: str, xs: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
    """xs[r] / outs[r]: rank r's input and output. Reads every input before writing any output
    (a rank's output may share memory with its input)."""
    if reduce == SUM:
        shape = outs[0].shape
        acc = f32(xs[0]).reshape(shape).clone()
        for x in xs[1:]:
            acc += f32(x).reshape(shape)
        for o in outs:
            o.copy_(acc.to(o.dtype))
    elif reduce == MAXLOC:
        ids = _maxloc(xs)
        for o in outs:
            o.reshape(-1).copy_(ids.to(o.dtype))
    else:
        raise ValueError(f"unknown collective reduction {reduce!r}")


def _maxloc(xs: list[torch.Tensor]) -> torch.Tensor:
    """Global argmax over the ranks' column slices (rank r holds columns [r*N, (r+1)*N)):
    each rank's (max, first index of it), then the max over ranks, the first rank on ties, so
    the lowest global index wins as in torch.argmax. NaN counts as the max (as in argmax)."""
    best_v = best_i = None
    for r, x in enumerate(xs):
        rows = f32(x.reshape(-1, x.shape[-1]))
        i = torch.argmax(rows, dim=-1)
        v = rows.gather(1, i[:, None])[:, 0]
        i = i + r * rows.shape[1]
        if best_v is None:
            best_v, best_i = v, i
            continue
        take = (v > best_v) | (v.isnan() & ~best_v.isnan())
        best_v, best_i = torch.where(take, v, best_v), torch.where(take, i, best_i)
    return best_i
