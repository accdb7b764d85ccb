"""OLMo 2 for amk/models/decoder.py: no norms before attention and MLP, RMSNorms of their
outputs before the residual adds (post_attention_layernorm, post_feedforward_layernorm), and
q / k RMSNorms over the whole projection (weights of n_heads*head_dim and n_kv*head_dim:
ops.rmsnorm then views each row whole) before rope."""
from __future__ import annotations

import torch

from amk.errors import TraceError
from amk.models.decoder import FamilyConfig
from amk.models.families import Weights, max_seq_for


def from_hf_olmo2(hf_model, max_seq: int | None, dtype: torch.dtype):
    from amk.models.hf import _rope_info, _rotary
    c = hf_model.config
    if c.hidden_act != "silu":
        raise TraceError(f"from_hf(olmo2): hidden_act={c.hidden_act!r}; only silu is supported")
    max_seq = max_seq_for(c, max_seq)
    rope_type, _, _ = _rope_info(c)
    nh = c.num_attention_heads
    nkv = c.num_key_value_heads or nh
    hd = getattr(c, "head_dim", None) or c.hidden_size // nh
    rot = _rotary(hf_model)
    scaling = float(getattr(rot, "attention_scaling", 1.0))
    cfg = FamilyConfig(
        vocab=c.vocab_size, hidden=c.hidden_size, n_layers=c.num_hidden_layers, n_heads=nh,
        n_kv_heads=nkv, head_dim=hd, ffn=c.intermediate_size, rms_eps=float(c.rms_norm_eps),
        rope_source=f"hf:{rope_type}",
        attn_scale=None if scaling == 1.0 else scaling * scaling / hd ** 0.5,
        tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        qkv_bias=bool(getattr(c, "attention_bias", False)), o_bias=bool(getattr(c, "attention_bias", False)),
        qk_norm=True, max_seq=max_seq, dtype=dtype, arch="olmo2", pre_norms=False, post_norms=True)
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
