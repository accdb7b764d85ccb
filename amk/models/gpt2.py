"""GPT-2 for amk/models/decoder.py: LayerNorm (with biases), learned positions instead of rope,
biases on every projection, a one-matrix GELU MLP (gelu_new is the tanh form), tied LM head.

GPT-2's Conv1D stores weights [in, out] (y = x @ W + b): they are transposed once at load into
nn.Linear's [out, in] (a copy: AMK's buffers are dense), and the fused c_attn is cut into q, k
and v by rows, so q/k/v run as three GEMVs of one stage (exact: a row block of x @ W.T is the
same dot products).
"""
from __future__ import annotations

import torch

from amk.errors import TraceError
from amk.models.decoder import FamilyConfig
from amk.models.families import Weights, max_seq_for

ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
       "gelu": "gelu"}


def _linear(w: torch.Tensor) -> torch.Tensor:
    return w.t().contiguous()


def from_hf_gpt2(hf_model, max_seq: int | None, dtype: torch.dtype):
    c = hf_model.config
    act = c.activation_function
    if act not in ACT:
        raise TraceError(f"from_hf(gpt2): activation_function={act!r}; supported: {sorted(ACT)}")
    if getattr(c, "scale_attn_by_inverse_layer_idx", False):
        raise TraceError("from_hf(gpt2): scale_attn_by_inverse_layer_idx=True is not supported")
    max_seq = max_seq_for(c, max_seq, "n_positions")
    if max_seq > c.n_positions:
        raise TraceError(f"from_hf(gpt2): max_seq={max_seq} exceeds its {c.n_positions} learned "
                         f"positions; pass max_seq <= {c.n_positions}")
    H, nh = c.n_embd, c.n_head
    hd = H // nh
    cfg = FamilyConfig(
        vocab=c.vocab_size, hidden=H, n_layers=c.n_layer, n_heads=nh, n_kv_heads=nh, head_dim=hd,
        ffn=c.n_inner or 4 * H, rms_eps=float(c.layer_norm_epsilon), rope_source="none",
        attn_scale=None if getattr(c, "scale_attn_weights", True) else 1.0,
        tie_embeddings=True, qkv_bias=True, o_bias=True, mlp_bias=True, max_seq=max_seq,
        dtype=dtype, arch="gpt2", norm="layer", mlp=ACT[act], learned_pos=True)
    w = Weights(hf_model, dtype)
    layers = []
    for i in range(c.n_layer):
        lp = f"transformer.h.{i}"
        qkv, qkv_b = _linear(w(f"{lp}.attn.c_attn")), w(f"{lp}.attn.c_attn", "bias")
        layers.append({
            "attn_norm": w(f"{lp}.ln_1"), "attn_norm_b": w(f"{lp}.ln_1", "bias"),
            "wq": qkv[:H], "wk": qkv[H:2 * H], "wv": qkv[2 * H:],
            "bq": qkv_b[:H], "bk": qkv_b[H:2 * H], "bv": qkv_b[2 * H:],
            "wo": _linear(w(f"{lp}.attn.c_proj")), "bo": w(f"{lp}.attn.c_proj", "bias"),
            "mlp_norm": w(f"{lp}.ln_2"), "mlp_norm_b": w(f"{lp}.ln_2", "bias"),
            "w_up": _linear(w(f"{lp}.mlp.c_fc")), "b_up": w(f"{lp}.mlp.c_fc", "bias"),
            "w_down": _linear(w(f"{lp}.mlp.c_proj")), "b_down": w(f"{lp}.mlp.c_proj", "bias"),
        })
    embed = w("transformer.wte")
    params = {"embed": embed, "wpe": w("transformer.wpe")[:max_seq], "layers": layers,
              "norm": w("transformer.ln_f"), "norm_b": w("transformer.ln_f", "bias"),
              "lm_head": embed}
    return cfg, params
