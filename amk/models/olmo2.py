"""OLMo 2 for amk/models/decoder.py: no norms before attention and MLP, RMSNorms of their
outputs before the residual adds (post_attention_layernorm, post_feedforward_layernorm), and
q / k RMSNorms over the whole projection (weights of n_heads*head_dim and n_kv*head_dim:
ops.rmsnorm then views each row whole) before rope."""
from __future__ import annotations

import torch

from amk.models.families import Weights, llama_like_config


def from_hf_olmo2(hf_model, max_seq: int | None, dtype: torch.dtype):
    from amk.models.hf import _rotary
    c = hf_model.config
    bias = bool(getattr(c, "attention_bias", False))
    cfg = llama_like_config(hf_model, "olmo2", max_seq, dtype, qkv_bias=bias, o_bias=bias,
                            qk_norm=True, pre_norms=False, post_norms=True)
    rot = _rotary(hf_model)
    w = Weights(hf_model, dtype)
    layers = []
    for i in range(c.num_hidden_layers):
        lp = f"model.layers.{i}"
        a, m = f"{lp}.self_attn", f"{lp}.mlp"
        layer = {
            "wq": w(f"{a}.q_proj"), "wk": w(f"{a}.k_proj"), "wv": w(f"{a}.v_proj"), "wo": w(f"{a}.o_proj"),
            "q_norm": w(f"{a}.q_norm"), "k_norm": w(f"{a}.k_norm"),
            "attn_post_norm": w(f"{lp}.post_attention_layernorm"),
            "w_gate": w(f"{m}.gate_proj"), "w_up": w(f"{m}.up_proj"), "w_down": w(f"{m}.down_proj"),
            "mlp_post_norm": w(f"{lp}.post_feedforward_layernorm"),
        }
        if cfg.qkv_bias:
            layer.update(bq=w(f"{a}.q_proj", "bias"), bk=w(f"{a}.k_proj", "bias"),
                         bv=w(f"{a}.v_proj", "bias"), bo=w(f"{a}.o_proj", "bias"))
        layers.append(layer)
    embed = w("model.embed_tokens")
    params = {"embed": embed, "layers": layers, "norm": w("model.norm"),
              "lm_head": embed if cfg.tie_embeddings else w("lm_head"),
              "inv_freq": rot.inv_freq.detach().float()}
    return cfg, params
