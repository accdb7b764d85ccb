"""Model shapes used by tests and benchmarks, and random weights for them.

`random_model(cfg, device="meta")` builds weights without memory: enough for tracing and the
pass pipeline, which never look at data.
"""
from __future__ import annotations

import dataclasses
from dataclasses import replace

import torch

from amk.models.llama import DecoderConfig

LLAMA_3_2_1B = DecoderConfig(
    vocab=128256, hidden=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64, ffn=8192,
    rms_eps=1e-5, rope_theta=500000.0, tie_embeddings=True, max_seq=4096,
    dtype=torch.bfloat16, arch="llama")

# The shapes of Qwen3-0.6B (head_dim 128, qk-norm, 28 layers of hidden 1024) and Llama-3-8B
# (hidden 4096, 32 layers, an untied LM head): other corners than the 1B for the benchmarks.
QWEN3_0_6B = DecoderConfig(
    vocab=151936, hidden=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn=3072,
    rms_eps=1e-6, rope_theta=1000000.0, tie_embeddings=True, qk_norm=True, max_seq=4096,
    dtype=torch.bfloat16, arch="qwen3")

LLAMA_3_8B = DecoderConfig(
    vocab=128256, hidden=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, ffn=14336,
    rms_eps=1e-5, rope_theta=500000.0, tie_embeddings=False, max_seq=4096,
    dtype=torch.bfloat16, arch="llama")

TINY_LLAMA = DecoderConfig(
    vocab=96, hidden=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn=128,
    max_seq=64, dtype=torch.float32)

PRESETS = {"llama-3.2-1b": LLAMA_3_2_1B, "qwen3-0.6b": QWEN3_0_6B, "llama-3-8b": LLAMA_3_8B,
           "tiny-llama": TINY_LLAMA}


def with_overrides(cfg: DecoderConfig, items: list[str]) -> DecoderConfig:
    """cfg with `field=value` items applied (ints, floats, booleans true/false): the shapes that
    are not presets, e.g. ["hidden=1536", "n_heads=12", "ffn=6144"]."""
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    changes = {}
    for item in items:
        name, eq, text = item.partition("=")
        if not eq or name not in fields or name in ("dtype", "rope_source", "arch"):
            settable = ", ".join(n for n in fields if n not in ("dtype", "rope_source", "arch"))
            raise ValueError(f"shape override {item!r}: expected FIELD=VALUE with FIELD one of {settable}")
        old = getattr(cfg, name)
        try:
            if isinstance(old, bool):
                if text.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(text)
                changes[name] = text.lower() in ("true", "1")
            else:
                changes[name] = (float if isinstance(old, float) or old is None else int)(text)
        except ValueError:
            raise ValueError(f"shape override {item!r}: {name} takes a {type(old).__name__}") from None
    out = replace(cfg, **changes)
    if out.n_heads % out.n_kv_heads or min(out.hidden, out.n_layers, out.n_heads, out.head_dim, out.ffn, out.vocab) < 1:
        raise ValueError(f"shape overrides {items}: heads {out.n_heads} must be a positive multiple of "
                         f"kv heads {out.n_kv_heads}, and every size at least 1")
    return out


def random_params(cfg: DecoderConfig, device="cpu", seed: int = 0) -> dict:
    """Random weights in the layout of amk/models/llama.py, scaled so activations stay O(1)."""
    dev = torch.device(device)
    gen = None if dev.type == "meta" else torch.Generator(device=dev).manual_seed(seed)
    dt = cfg.dtype

    def rnd(*shape, scale=None):
        if dev.type == "meta":
            return torch.empty(shape, dtype=dt, device=dev)
        s = scale if scale is not None else shape[-1] ** -0.5
        return (torch.randn(shape, generator=gen, device=dev, dtype=torch.float32) * s).to(dt)

    def ones(n):
        return torch.ones(n, dtype=dt, device=dev) if dev.type != "meta" else torch.empty(n, dtype=dt, device=dev)

    H, D = cfg.hidden, cfg.head_dim
    layers = []
    for _ in range(cfg.n_layers):
        layers.append({
            "attn_norm": ones(H), "wq": rnd(cfg.n_heads * D, H), "wk": rnd(cfg.n_kv_heads * D, H),
            "wv": rnd(cfg.n_kv_heads * D, H), "wo": rnd(H, cfg.n_heads * D), "mlp_norm": ones(H),
            "w_gate": rnd(cfg.ffn, H), "w_up": rnd(cfg.ffn, H), "w_down": rnd(H, cfg.ffn)})
        if cfg.qk_norm:
            layers[-1].update(q_norm=ones(D), k_norm=ones(D))
        if cfg.qkv_bias:
            layers[-1].update(bq=rnd(cfg.n_heads * D, scale=0.1), bk=rnd(cfg.n_kv_heads * D, scale=0.1),
                              bv=rnd(cfg.n_kv_heads * D, scale=0.1))
    embed = rnd(cfg.vocab, H, scale=1.0)
    inv = cfg.default_inv_freq().to(dev) if dev.type != "meta" else torch.empty(D // 2, device=dev)
    return {"embed": embed, "layers": layers, "norm": ones(H),
            "lm_head": embed if cfg.tie_embeddings else rnd(cfg.vocab, H), "inv_freq": inv}


def random_model(cfg: DecoderConfig, device="cpu", seed: int = 0, max_seq: int | None = None):
    from amk.models.model import Model
    if max_seq is not None:
        cfg = replace(cfg, max_seq=max_seq)
    return Model(cfg, random_params(cfg, device, seed))
