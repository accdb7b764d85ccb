"""Gemma 2 and Gemma 3 (text) for amk/models/decoder.py.

Gemma 2: GeGLU (tanh gelu) MLP, (1 + w) RMSNorms before and after attention and MLP, the
embedding times sqrt(hidden) (rounded to the weights' dtype, as transformers does), attention
scale query_pre_attn_scalar**-0.5, attention and final logit soft-capping, sliding-window
layers as config.layer_types says. Gemma 3 adds per-head (1 + w) q/k norms and two rope
bases (local for sliding layers, global for full ones), read from transformers' rotary module.

(1 + w) is folded into the norm weights once, in float32: transformers computes
`norm(x.float()) * (1.0 + w.float())`, so an f32 weight of 1 + w gives the same bits.
"""
from __future__ import annotations

import torch

from amk.errors import TraceError
from amk.models.decoder import FamilyConfig
from amk.models.families import Weights, layer_windows, max_seq_for

GELU_TANH = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")


def _plus_one(w: torch.Tensor) -> torch.Tensor:
    return 1.0 + w.float()


def _inv_freqs(hf_model, arch: str) -> tuple[dict, float]:
    rot = getattr(hf_model.model, "rotary_emb", None)
    if rot is None:
        raise TraceError(f"from_hf({arch}): no model.rotary_emb; cannot derive rope frequencies")
    if arch == "gemma3_text":
        out, scales = {}, set()
        for key, layer_type in (("inv_freq", "full_attention"), ("inv_freq_local", "sliding_attention")):
            f = getattr(rot, f"{layer_type}_inv_freq", None)
            if f is not None:
                out[key] = f.detach().float()
                scales.add(float(getattr(rot, f"{layer_type}_attention_scaling", 1.0)))
        if len(scales) > 1:
            raise TraceError(f"from_hf({arch}): local and global rope have different attention "
                             f"scalings {sorted(scales)}; one softmax scale cannot express both")
        return out, scales.pop() if scales else 1.0
    return {"inv_freq": rot.inv_freq.detach().float()}, float(getattr(rot, "attention_scaling", 1.0))


def from_hf_gemma(hf_model, max_seq: int | None, dtype: torch.dtype):
    c = hf_model.config
    arch = c.model_type
    act = getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", None)
    if act not in GELU_TANH:
        raise TraceError(f"from_hf({arch}): hidden_activation={act!r}; only the tanh GELU "
                         f"({', '.join(GELU_TANH)}) is supported")
    max_seq = max_seq_for(c, max_seq)
    n = c.num_hidden_layers
    inv, scaling = _inv_freqs(hf_model, arch)
    types = list(getattr(c, "layer_types", None) or ["full_attention"] * n)
    layer_rope = tuple("inv_freq_local" if t == "sliding_attention" and "inv_freq_local" in inv
                       else "inv_freq" for t in types[:n])
    scale = float(c.query_pre_attn_scalar) ** -0.5 * scaling * scaling
    cfg = FamilyConfig(
        vocab=c.vocab_size, hidden=c.hidden_size, n_layers=n, n_heads=c.num_attention_heads,
        n_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, ffn=c.intermediate_size,
        rms_eps=float(c.rms_norm_eps), rope_source=f"hf:{arch}", attn_scale=scale,
        tie_embeddings=bool(getattr(c, "tie_word_embeddings", True)),
        qkv_bias=bool(getattr(c, "attention_bias", False)), o_bias=bool(getattr(c, "attention_bias", False)),
        qk_norm=arch == "gemma3_text", max_seq=max_seq, dtype=dtype, arch=arch,
        post_norms=True, mlp="geglu_tanh",
        embed_scale=float(torch.tensor(c.hidden_size ** 0.5, dtype=dtype)),
        windows=layer_windows(c, n, max_seq), layer_rope=layer_rope,
        attn_softcap=getattr(c, "attn_logit_softcapping", None),
        final_softcap=getattr(c, "final_logit_softcapping", None))
    w = Weights(hf_model, dtype)
    f32 = torch.float32
    layers = []
    for i in range(n):
        lp = f"model.layers.{i}"
        a, m = f"{lp}.self_attn", f"{lp}.mlp"
        layer = {
            "attn_norm": _plus_one(w(f"{lp}.input_layernorm", dtype=f32)),
            "wq": w(f"{a}.q_proj"), "wk": w(f"{a}.k_proj"), "wv": w(f"{a}.v_proj"), "wo": w(f"{a}.o_proj"),
            "attn_post_norm": _plus_one(w(f"{lp}.post_attention_layernorm", dtype=f32)),
            "mlp_norm": _plus_one(w(f"{lp}.pre_feedforward_layernorm", dtype=f32)),
            "mlp_post_norm": _plus_one(w(f"{lp}.post_feedforward_layernorm", dtype=f32)),
            "w_gate": w(f"{m}.gate_proj"), "w_up": w(f"{m}.up_proj"), "w_down": w(f"{m}.down_proj"),
        }
        if cfg.qkv_bias:
            layer.update(bq=w(f"{a}.q_proj", "bias"), bk=w(f"{a}.k_proj", "bias"),
                         bv=w(f"{a}.v_proj", "bias"), bo=w(f"{a}.o_proj", "bias"))
        if cfg.qk_norm:
            layer.update(q_norm=_plus_one(w(f"{a}.q_norm", dtype=f32)),
                         k_norm=_plus_one(w(f"{a}.k_norm", dtype=f32)))
        layers.append(layer)
    embed = w("model.embed_tokens")
    lm_head = embed if cfg.tie_embeddings else w("lm_head")
    params = {"embed": embed, "layers": layers, "norm": _plus_one(w("model.norm", dtype=f32)),
              "lm_head": lm_head, **inv}
    return cfg, params
