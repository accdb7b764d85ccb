"""The peers: the same Llama-family decode step (Llama, Qwen2 biases, Qwen3 qk-norm) in plain PyTorch (eager, and torch.compile with CUDA
graphs), over the same params dict and KV cache layout as amk/models/llama.py."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from torch_quant_peer import quant_linear as _linear   # F.linear, or a quantized peer's weights


def _rms(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def _rope(x, pos, inv_freq, hd):
    ang = pos.float() * inv_freq                       # [hd/2]
    c, s = ang.cos(), ang.sin()
    xf = x.float().view(*x.shape[:-1], -1, hd)
    x1, x2 = xf[..., : hd // 2], xf[..., hd // 2:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).view_as(x).to(x.dtype)


def _attention(q, k, v, mask):
    """q [B, nkv, rep, hd] (a kv group's heads together), k and v the caches [B, S, nkv, hd]: two
    batched matmuls over strided views of the cache (no copy of it, no repeat of the kv heads)."""
    s = torch.matmul(q, k.permute(0, 2, 3, 1)).float() * q.shape[-1] ** -0.5 + mask   # [B, nkv, rep, S]
    return torch.matmul(s.softmax(-1).to(v.dtype), v.permute(0, 2, 1, 3))           # [B, nkv, rep, hd]


def torch_decode_step(cfg, params, token, pos, kv):
    """Decode of token [B] at one position pos [1]; the KV caches [max_seq, n_kv, hd] (batch 1)
    or [B, max_seq, n_kv, hd] are updated in place at pos."""
    hd, nh, nkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    x = params["embed"][token]                        # [B, H]
    B = x.shape[0]
    p_idx = pos.long()
    seq = torch.arange(kv[0]["k"].shape[-3], device=x.device)
    mask = torch.where(seq <= p_idx, 0.0, float("-inf"))   # fp32, static shape: graph-safe
    for p, cache in zip(params["layers"], kv):
        h = _rms(x, p["attn_norm"], cfg.rms_eps)
        q, k, v = _linear(h, p["wq"], p.get("bq")), _linear(h, p["wk"], p.get("bk")), _linear(h, p["wv"], p.get("bv"))
        if cfg.qk_norm:        # Qwen3: RMSNorm over each head's head_dim, before rope
            q = _rms(q.view(-1, hd), p["q_norm"], cfg.rms_eps).view_as(q)
            k = _rms(k.view(-1, hd), p["k_norm"], cfg.rms_eps).view_as(k)
        q = _rope(q, pos, params["inv_freq"], hd)
        k = _rope(k, pos, params["inv_freq"], hd)
        ck, cv = (cache[n].view(B, -1, nkv, hd) for n in ("k", "v"))
        ck.index_copy_(1, p_idx, k.view(B, 1, nkv, hd))
        cv.index_copy_(1, p_idx, v.view(B, 1, nkv, hd))
        a = _attention(q.view(B, nkv, nh // nkv, hd), ck, cv, mask)
        x = x + _linear(a.reshape(B, nh * hd), p["wo"])
        h = _rms(x, p["mlp_norm"], cfg.rms_eps)
        x = x + _linear(F.silu(_linear(h, p["w_gate"])) * _linear(h, p["w_up"]), p["w_down"])
    logits = _linear(_rms(x, params["norm"], cfg.rms_eps), params["lm_head"])
    return logits.argmax(-1).to(torch.int32), logits
