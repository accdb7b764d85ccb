"""The decode step of every family beyond the Llama shape, written only with `amk.ops`.

`FamilyConfig` extends the Llama `DecoderConfig` with what Gemma 2 / 3, Phi-3, GPT-2, OLMo 2
and sliding-window Mistral / Qwen need; with every extra at its default it is the Llama step.
Each extra is one switch below, and each family's loader (amk/models/gemma.py, gpt2.py, ...)
only sets switches and names weights:

    norm          "rms" (x * rsqrt(mean x^2 + eps) * w) or "layer" (LayerNorm, GPT-2)
    pre_norms     norm before attention and MLP (all but OLMo 2)
    post_norms    norm of the attention / MLP output before its residual add (Gemma 2/3, OLMo 2)
    mlp           "swiglu" silu(gate)*up | "geglu_tanh" gelu_tanh(gate)*up (Gemma) |
                  "gelu_tanh" / "gelu" on one up projection (GPT-2)
    embed_scale   the embedding times this (Gemma: sqrt(hidden) rounded to the weights' dtype)
    learned_pos   add params["wpe"][pos] to the embedding (GPT-2), and no rope
    windows       per layer: a sliding window (rows) or None = full causal attention
    layer_rope    per layer: the params key of its rope frequencies (Gemma 3: local / global)
    attn_softcap, final_softcap   Gemma 2's soft-capping of attention scores and of the logits

q_norm / k_norm (when present in a layer) are RMSNorms with a weight of head_dim (per head:
Qwen3, Gemma 3) or of the whole projection (OLMo 2): ops.rmsnorm views x as rows of the
weight's size, so both are one op. Gemma's (1 + w) norms are folded into the weights at load.
"""
from __future__ import annotations

from dataclasses import dataclass

from amk import ops
from amk.models.llama import DecoderConfig, last_row


@dataclass(frozen=True)
class FamilyConfig(DecoderConfig):
    norm: str = "rms"
    pre_norms: bool = True
    post_norms: bool = False
    mlp: str = "swiglu"
    embed_scale: float | None = None
    learned_pos: bool = False
    windows: tuple = ()
    layer_rope: tuple = ()
    attn_softcap: float | None = None
    final_softcap: float | None = None
    lm_head_bias: bool = False

    def window(self, i: int):
        return self.windows[i] if self.windows else None

    def rope_key(self, i: int) -> str:
        return self.layer_rope[i] if self.layer_rope else "inv_freq"


def _norm(cfg: FamilyConfig, x, p: dict, name: str):
    if cfg.norm == "layer":
        return ops.layernorm(x, p[name], p.get(name + "_b"), cfg.rms_eps)
    return ops.rmsnorm(x, p[name], cfg.rms_eps)


def attention_block(cfg: FamilyConfig, i: int, p: dict, params: dict, h, pos, cache: dict):
    q = ops.linear(h, p["wq"], p.get("bq"))
    k = ops.linear(h, p["wk"], p.get("bk"))
    v = ops.linear(h, p["wv"], p.get("bv"))
    if "q_norm" in p:
        q = ops.rmsnorm(q, p["q_norm"], cfg.rms_eps)
        k = ops.rmsnorm(k, p["k_norm"], cfg.rms_eps)
    if not cfg.learned_pos:
        inv_freq = params[cfg.rope_key(i)]
        q = ops.rope(q, pos, cfg.head_dim, inv_freq=inv_freq)
        k = ops.rope(k, pos, cfg.head_dim, inv_freq=inv_freq)
    k_cache = ops.kv_update(cache["k"], k, pos)
    v_cache = ops.kv_update(cache["v"], v, pos)
    a = ops.attention(q, k_cache, v_cache, pos, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                      scale=cfg.attn_scale, window=cfg.window(i), softcap=cfg.attn_softcap)
    return ops.linear(a, p["wo"], p.get("bo")), {"k": k_cache, "v": v_cache}


def mlp_block(cfg: FamilyConfig, p: dict, h):
    if cfg.mlp == "swiglu":
        act = ops.silu_mul(ops.linear(h, p["w_gate"], p.get("b_gate")),
                           ops.linear(h, p["w_up"], p.get("b_up")))
    elif cfg.mlp == "geglu_tanh":
        act = ops.mul(ops.gelu(ops.linear(h, p["w_gate"], p.get("b_gate")), approximate="tanh"),
                      ops.linear(h, p["w_up"], p.get("b_up")))
    else:
        approx = "tanh" if cfg.mlp == "gelu_tanh" else "none"
        act = ops.gelu(ops.linear(h, p["w_up"], p.get("b_up")), approximate=approx)
    return ops.linear(act, p["w_down"], p.get("b_down"))


def decode_step(cfg: FamilyConfig, params: dict, token, pos, kv: list, last_only: bool = False):
    """One decode position for every sequence: (next ids int32 [B], logits [B, V], new kv).
    last_only: the final norm and LM head on the last row only (logits [1, V]): a prompt chunk."""
    x = ops.embed(params["embed"], token)
    if cfg.embed_scale is not None:
        x = ops.mul(x, cfg.embed_scale)
    if cfg.learned_pos:
        x = ops.add(x, ops.embed(params["wpe"], pos))      # [1, H] broadcast over the batch
    new_kv = []
    for i, (p, cache) in enumerate(zip(params["layers"], kv)):
        h = _norm(cfg, x, p, "attn_norm") if cfg.pre_norms else x
        a, cache = attention_block(cfg, i, p, params, h, pos, cache)
        if cfg.post_norms:
            a = _norm(cfg, a, p, "attn_post_norm")
        x = ops.add(x, a)
        h = _norm(cfg, x, p, "mlp_norm") if cfg.pre_norms else x
        m = mlp_block(cfg, p, h)
        if cfg.post_norms:
            m = _norm(cfg, m, p, "mlp_post_norm")
        x = ops.add(x, m)
        new_kv.append(cache)
    if last_only:
        x = last_row(x)
    x = _norm(cfg, x, params, "norm")
    logits = ops.linear(x, params["lm_head"], params.get("lm_head_b"))
    if cfg.final_softcap is not None:
        logits = ops.softcap(logits, cfg.final_softcap)
    return ops.argmax(logits), logits, new_kv


def make_decode_step(cfg: FamilyConfig, last_only: bool = False):
    def family_decode_step(params, token, pos, kv):
        return decode_step(cfg, params, token, pos, kv, last_only)

    family_decode_step.__qualname__ = f"{cfg.arch}_{'prefill' if last_only else 'decode'}_step"
    return family_decode_step
