"""Phi-3 for amk/models/decoder.py: the Llama step with fused projections.

qkv_proj [(n_heads + 2 n_kv) * head_dim, H] and gate_up_proj [2 * ffn, H] are cut by rows into
q / k / v and gate / up at load (views, no copy): a row block of x @ W.T is exactly those dot
products, and AMK's tiler then runs q, k, v as one stage and fuses gate with up as it does for
Llama. Rope frequencies come from transformers' rotary module (su / longrope scaled too, for a
cache within their original length); a sliding_window narrower than the cache is honoured.
"""
from __future__ import annotations

import dataclasses

import torch

from amk.errors import TraceError
from amk.models.families import Weights, layer_windows, llama_like_config


def from_hf_phi3(hf_model, max_seq: int | None, dtype: torch.dtype):
    from amk.models.hf import LENGTH_DEPENDENT_ROPE, _rope_info, _rotary
    c = hf_model.config
    cfg = llama_like_config(hf_model, "phi3", max_seq, dtype)
    cfg = dataclasses.replace(cfg, windows=layer_windows(c, cfg.n_layers, cfg.max_seq))
    rope_type, _, rp = _rope_info(c)
    orig = getattr(c, "original_max_position_embeddings", None) or c.max_position_embeddings
    if rope_type in LENGTH_DEPENDENT_ROPE and cfg.max_seq > orig:
        raise TraceError(f"from_hf(phi3): rope_type {rope_type!r} changes its frequencies past "
                         f"{orig} positions; pass max_seq <= {orig}")
    if float(rp.get("partial_rotary_factor", 1.0)) != 1.0:
        raise TraceError("from_hf(phi3): partial_rotary_factor != 1 is not supported")
    nh, nkv, hd, rot = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, _rotary(hf_model)
    w = Weights(hf_model, dtype)
    q_rows, kv_rows, ffn = nh * hd, nkv * hd, c.intermediate_size
    layers = []
    for i in range(c.num_hidden_layers):
        lp = f"model.layers.{i}"
        qkv = w(f"{lp}.self_attn.qkv_proj")
        gate_up = w(f"{lp}.mlp.gate_up_proj")
        layers.append({
            "attn_norm": w(f"{lp}.input_layernorm"),
            "wq": qkv[:q_rows], "wk": qkv[q_rows:q_rows + kv_rows], "wv": qkv[q_rows + kv_rows:],
            "wo": w(f"{lp}.self_attn.o_proj"), "mlp_norm": w(f"{lp}.post_attention_layernorm"),
            "w_gate": gate_up[:ffn], "w_up": gate_up[ffn:], "w_down": w(f"{lp}.mlp.down_proj"),
        })
    embed = w("model.embed_tokens")
    params = {"embed": embed, "layers": layers, "norm": w("model.norm"),
              "lm_head": embed if cfg.tie_embeddings else w("lm_head"),
              "inv_freq": rot.inv_freq.detach().float()}
    return cfg, params
