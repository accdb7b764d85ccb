"""Weight-only quantized linear weights in the seed's storage layout, and a quantizer.

  * bits=8: q is int8 [N, K], real = (q - zero) * scale
  * bits=4: q is uint8 [N, K//2]; byte b holds column 2b in the low nibble and 2b+1 in the high
    nibble, each stored as q+8 (q in [-8, 7])
  * scales: [N, ceil(K/group)] float; column k uses group k // group
  * zeros: None (symmetric) or integer-valued floats shaped like scales
  * fp8 (fmt="fp8"): q is float8_e4m3fn [N, K], real = q * scale; scales per group (group = K:
    per output channel), no zeros
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from amk import pytree


@dataclass
class QuantizedWeight:
    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None
    bits: int = 8
    group: int = 128

    @property
    def fmt(self) -> str:
        """"int8", "int4" or "fp8" (an fp8 weight is 8 bits of float8_e4m3fn)."""
        return "fp8" if self.q.dtype == torch.float8_e4m3fn else f"int{self.bits}"

    @property
    def shape(self) -> tuple[int, int]:
        n = self.q.shape[0]
        k = self.q.shape[1] * (2 if self.bits == 4 else 1)
        return (n, k)


pytree.register_static_fields(QuantizedWeight, ("bits", "group"))


FORMATS = ("int8", "int4", "fp8")
FP8_MAX = 448.0                # the largest float8_e4m3fn


def quantize(w: torch.Tensor, bits: int = 8, group: int = 128, symmetric: bool = True,
             fmt: str | None = None) -> QuantizedWeight:
    """Group-wise weight-only quantization of a [N, K] weight (round to nearest). fmt "int8",
    "int4" or "fp8" names the format (default: int of `bits` bits); fp8 is symmetric E4M3 with
    a scale per group (group >= K: one per output channel)."""
    fmt = fmt or f"int{bits}"
    if fmt not in FORMATS:
        raise ValueError(f"quantize: format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt == "fp8":
        return _quantize_fp8(w, group)
    bits = int(fmt[3:])
    n, k = w.shape
    if bits == 4 and k % 2:
        raise ValueError(f"quantize: int4 needs an even K, got {k}")
    wf = w.float()
    ng = (k + group - 1) // group
    pad = ng * group - k
    wg = torch.nn.functional.pad(wf, (0, pad)).view(n, ng, group)
    qmax, qmin = (7, -8) if bits == 4 else (127, -128)
    if symmetric:
        scale = wg.abs().amax(-1).clamp_min(1e-8) / qmax
        zeros = None
        q = torch.round(wg / scale[..., None]).clamp(qmin, qmax)
    else:
        lo, hi = wg.amin(-1), wg.amax(-1)
        scale = ((hi - lo) / (qmax - qmin)).clamp_min(1e-8)
        zeros = torch.round(qmin - lo / scale)          # real = (q - zero) * scale
        q = torch.round(wg / scale[..., None] + zeros[..., None]).clamp(qmin, qmax)
    q = q.view(n, ng * group)[:, :k]
    if bits == 8:
        qs = q.to(torch.int8)
    else:
        u = (q + 8).to(torch.uint8)
        qs = (u[:, 0::2] | (u[:, 1::2] << 4)).to(torch.uint8)
    dt = w.dtype if w.dtype.is_floating_point else torch.float32
    return QuantizedWeight(qs.contiguous(), scale.to(dt).contiguous(),
                           None if zeros is None else zeros.to(dt).contiguous(), bits, group)


def _quantize_fp8(w: torch.Tensor, group: int) -> QuantizedWeight:
    n, k = w.shape
    group = min(group, k)
    ng = (k + group - 1) // group
    wg = torch.nn.functional.pad(w.float(), (0, ng * group - k)).view(n, ng, group)
    scale = wg.abs().amax(-1).clamp_min(1e-8) / FP8_MAX
    q = (wg / scale[..., None]).view(n, ng * group)[:, :k].to(torch.float8_e4m3fn)
    dt = w.dtype if w.dtype.is_floating_point else torch.float32
    return QuantizedWeight(q.contiguous(), scale.to(dt).contiguous(), None, 8, group)


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """The exact fp32 [N, K] weight the quantized GEMV multiplies by (seed numerics)."""
    n, k = qw.shape
    if qw.bits == 4:
        p = qw.q.to(torch.int32)
        q = torch.stack([p & 0xF, (p >> 4) & 0xF], -1).view(n, -1)[:, :k].float() - 8.0
    else:
        q = qw.q[:, :k].float()
    idx = torch.arange(k) // qw.group
    s = qw.scales.float()[:, idx]
    if qw.zeros is not None:
        q = q - qw.zeros.float()[:, idx]
    return q * s
