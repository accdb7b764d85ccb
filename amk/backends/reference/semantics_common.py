"""Small helpers shared by the reference semantics modules."""
from __future__ import annotations

from contextlib import contextmanager

import torch

from amk.errors import ValidationError


@contextmanager
def flush_subnormals():
    """Flush float subnormals to zero on the CPU while the reference computes. A softmax over a
    peaked attention row yields subnormal tails (exp(-100)); x86 handles each one in microcode,
    which made a SmolLM2 step ~30x slower (3.6 s instead of 0.12 s). Values below 1.2e-38 are
    invisible next to a softmax normaliser >= 1, so results are unchanged in practice."""
    supported = torch.set_flush_denormal(True)
    try:
        yield
    finally:
        if supported:                  # back to the default (there is no getter to restore)
            torch.set_flush_denormal(False)


def f32(t: torch.Tensor) -> torch.Tensor:
    """fp32 view of ``t`` (no copy when it already is fp32): every op computes in fp32."""
    return t if t.dtype == torch.float32 else t.to(torch.float32)


def column_range(params, out: torch.Tensor) -> tuple[int, int]:
    """The output columns ``[n_off, n_off+N_tile)`` a column-tiled op writes (all by default)."""
    cols = out.shape[-1] if out.dim() else 1
    n_off = int(params.get("n_off", 0))
    n_tile = params.get("N_tile")
    hi = cols if n_tile is None else n_off + int(n_tile)
    if not 0 <= n_off <= hi <= cols:
        raise ValidationError(f"column tile [{n_off}, {hi}) is outside the output's {cols} columns")
    return n_off, hi


def tile_view(x: torch.Tensor, out: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Input ``x`` as an elementwise op writing ``out[..., lo:hi]`` reads it: an input with the
    output's numel is viewed in the output's shape; a same-width input is cut to the columns;
    anything else (a broadcast operand) is used as is."""
    if x.numel() == out.numel() and x.shape != out.shape:
        x = x.reshape(out.shape)
    if x.dim() and (lo, hi) != (0, out.shape[-1]) and x.shape[-1] == out.shape[-1]:
        x = x[..., lo:hi]
    return x


def host_int(t: torch.Tensor, ctx) -> int:
    """The integer in scalar tensor ``t`` (the decode position). The VM reads runtime scalars
    once per run into ``ctx.host_ints`` so a CUDA run does not sync the device per task."""
    cached = getattr(ctx, "host_ints", None)
    if cached:
        v = cached.get(t.data_ptr())
        if v is not None:
            return v
    return int(t.reshape(-1)[0])
