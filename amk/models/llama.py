"""The Llama-family decode step, written only with `amk.ops`.

One function covers Llama 2/3.x, SmolLM2, Mistral, Qwen2 and Qwen3: they differ only in which
optional weights exist (q/k/v bias, per-head q/k RMSNorm) and in the rope frequencies, which
arrive as a tensor (`params["inv_freq"]`) so every rope-scaling scheme is just data.

params (a plain dict pytree):
    {"embed": [V,H], "norm": [H], "lm_head": [V,H] (the embed tensor itself when tied),
     "inv_freq": f32 [head_dim//2],
     "layers": [{"attn_norm", "wq", "wk", "wv", "wo", "bq"?, "bk"?, "bv"?, "bo"?,
                 "q_norm"? [head_dim], "k_norm"? [head_dim],
                 "mlp_norm", "w_gate", "w_up", "w_down", "b_gate"?, "b_up"?, "b_down"?}, ...]}
kv: one {"k": cache, "v": cache} per layer, cache [max_seq, n_kv, head_dim] (batch 1) or
    [B, max_seq, n_kv, head_dim].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from amk import ops


@dataclass(frozen=True)
class DecoderConfig:
    vocab: int
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0     # used only to build inv_freq when the source gives none
    rope_source: str = "theta"      # where params["inv_freq"] came from (e.g. "hf:llama3")
    attn_scale: float | None = None  # None = head_dim**-0.5 (yarn folds its mscale in here)
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    max_seq: int = 2048
    dtype: torch.dtype = torch.float32
    arch: str = "llama"

    def default_inv_freq(self) -> torch.Tensor:
        """Plain (unscaled) rope frequencies: theta ** (-2i / head_dim)."""
        i = torch.arange(0, self.head_dim, 2, dtype=torch.float32)
        return 1.0 / (self.rope_theta ** (i / self.head_dim))


def attention_block(cfg: DecoderConfig, p: dict, x, pos, inv_freq, cache: dict):
    """Pre-norm self-attention for one decode position; returns (attention output, new cache)."""
    h = ops.rmsnorm(x, p["attn_norm"], cfg.rms_eps)
    q = ops.linear(h, p["wq"], p.get("bq"))
    k = ops.linear(h, p["wk"], p.get("bk"))
    v = ops.linear(h, p["wv"], p.get("bv"))
    if cfg.qk_norm:  # Qwen3: RMSNorm over each head's head_dim, before rope
        q = ops.rmsnorm(q, p["q_norm"], cfg.rms_eps)
        k = ops.rmsnorm(k, p["k_norm"], cfg.rms_eps)
    q = ops.rope(q, pos, cfg.head_dim, inv_freq=inv_freq)
    k = ops.rope(k, pos, cfg.head_dim, inv_freq=inv_freq)
    k_cache = ops.kv_update(cache["k"], k, pos)
    v_cache = ops.kv_update(cache["v"], v, pos)
    a = ops.attention(q, k_cache, v_cache, pos, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                      scale=cfg.attn_scale)
    return ops.linear(a, p["wo"], p.get("bo")), {"k": k_cache, "v": v_cache}


def mlp_block(cfg: DecoderConfig, p: dict, x):
    """Pre-norm SwiGLU MLP."""
    h = ops.rmsnorm(x, p["mlp_norm"], cfg.rms_eps)
    gate = ops.linear(h, p["w_gate"], p.get("b_gate"))
    up = ops.linear(h, p["w_up"], p.get("b_up"))
    return ops.linear(ops.silu_mul(gate, up), p["w_down"], p.get("b_down"))


def last_row(x):
    """Row T-1 of x [T, H] as [1, H]: a reshape to one row and a column slice (two COPYs, of
    T*H and H elements: far less than the final norm and LM head on every row). A prompt chunk
    needs only its last row's logits (amk/models/prefill.py)."""
    rows, width = x.shape[0], x.shape[1]
    return ops.slice(ops.reshape(x, (1, rows * width)), (rows - 1) * width, rows * width)


def decode_step(cfg: DecoderConfig, params: dict, token, pos, kv: list, last_only: bool = False):
    """One decode position for every sequence of the batch.

    token int32 [B], pos int32 [1]. Returns (next token ids int32 [B], logits [B, V], new kv).
    last_only: the final norm and LM head on the last row only (logits [1, V]): a prompt chunk.
    """
    inv_freq = params["inv_freq"]
    x = ops.embed(params["embed"], token)
    new_kv = []
    for p, cache in zip(params["layers"], kv):
        a, cache = attention_block(cfg, p, x, pos, inv_freq, cache)
        x = ops.add(x, a)
        x = ops.add(x, mlp_block(cfg, p, x))
        new_kv.append(cache)
    if last_only:
        x = last_row(x)
    x = ops.rmsnorm(x, params["norm"], cfg.rms_eps)
    logits = ops.linear(x, params["lm_head"])
    return ops.argmax(logits), logits, new_kv


def make_decode_step(cfg: DecoderConfig, last_only: bool = False):
    """`decode_step` with the config bound: the `fn(params, token, pos, kv)` that amk.jit takes.
    last_only: the prompt-chunk step (logits of the chunk's last row only)."""

    def llama_decode_step(params, token, pos, kv):
        return decode_step(cfg, params, token, pos, kv, last_only)

    llama_decode_step.__qualname__ = f"{cfg.arch}_{'prefill' if last_only else 'decode'}_step"
    return llama_decode_step
