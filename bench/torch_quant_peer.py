"""A weight-only quantized peer for `bench/decode.py --quant`: the same plain-PyTorch decode step
(torch_llama.py) with every linear and the LM head on torch's own weight-only kernels:
- int8: per-output-channel scales, `torch._weight_int8pack_mm` (bf16 activations);
- int4: groups of 128 with a scale and a zero each, tinygemm's `torch._weight_int4pack_mm`
  (CUDA; the `_for_cpu` pair on the CPU), the layout torchao's int4 weight-only uses.
fp8 has no weight-only kernel in torch (`torch._scaled_mm` quantizes the activations too), so
`peer_params` refuses it and the bench says so. Quantized here from the bf16 weights with torch's
own layouts, not AMK's: the peer is a speed reference, checked by its logits' distance from the
bf16 step."""
from __future__ import annotations

import torch

LINEARS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
INT4_GROUP, INT4_INNER_K_TILES = 128, 8


def int8_weight(w: torch.Tensor) -> tuple:
    scale = w.float().abs().amax(1).clamp(min=1e-8) / 127.0                  # [N]
    q = torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return ("int8", q, scale.to(w.dtype))


def int4_weight(w: torch.Tensor) -> tuple:
    """tinygemm's asymmetric int4: w = (q - 8) * scale + zero over groups of 128 along K."""
    n, k = w.shape
    if k % (INT4_INNER_K_TILES * 16) or n % 8:
        raise ValueError(f"int4 peer: weight {tuple(w.shape)} needs K % 128 == 0 and N % 8 == 0")
    g = w.float().view(n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-6)
    zero = lo + 8 * scale                                                    # the value of q = 8
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
    sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [K/g, N, 2]
    if w.is_cuda:
        packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8),
                                                   INT4_INNER_K_TILES)
    else:
        packed = torch._convert_weight_to_int4pack_for_cpu(q, INT4_INNER_K_TILES)
    return ("int4", packed, sz)


def quant_linear(x: torch.Tensor, w, b=None) -> torch.Tensor:
    """F.linear over a bf16 tensor or one of the tuples above; x [..., K]."""
    if isinstance(w, torch.Tensor):
        return torch.nn.functional.linear(x, w, b)
    kind, q, s = w
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    if kind == "int8":
        y = torch._weight_int8pack_mm(x2, q, s)
    elif x2.is_cuda:
        y = torch._weight_int4pack_mm(x2, q, INT4_GROUP, s)
    else:
        y = torch._weight_int4pack_mm_for_cpu(x2, q, INT4_GROUP, s)
    y = y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)
    return y if b is None else y + b


def peer_params(params: dict, fmt: str) -> dict:
    """A copy of params whose linears and LM head are torch-quantized (norms, embedding and
    biases stay as they are)."""
    make = {"int8": int8_weight, "int4": int4_weight}.get(fmt)
    if make is None:
        raise ValueError(f"no weight-only {fmt} kernel in torch (torch._scaled_mm quantizes the "
                         "activations too)")
    layers = [{k: (make(v) if k in LINEARS else v) for k, v in layer.items()}
              for layer in params["layers"]]
    return {**params, "layers": layers, "lm_head": make(params["lm_head"])}
