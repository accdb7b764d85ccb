"""from_hf for the families beyond the Llama shape (amk/models/decoder.py's FamilyConfig):
Gemma 2 / 3, Phi-3, GPT-2, OLMo 2, and Llama-family models with sliding windows.

Each family's module turns a transformers model into (FamilyConfig, params); this module
holds what they share: finding weights by module path, the rope frequencies, per-layer
sliding windows, and the Model they become.
"""
from __future__ import annotations

import dataclasses

import torch

from amk.errors import TraceError
from amk.models.decoder import FamilyConfig
from amk.models.model import Model

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Weights:
    """Weights of a transformers model by dotted module path, cast to one dtype (aliases when
    the dtype already matches)."""

    def __init__(self, hf_model, dtype: torch.dtype):
        self.hf_model, self.dtype = hf_model, dtype

    def module(self, path: str):
        mod = self.hf_model
        for part in path.split(".") if path else []:
            mod = mod[int(part)] if part.isdigit() else getattr(mod, part, None)
            if mod is None:
                return None
        return mod

    def __call__(self, path: str, name: str = "weight", required: bool = True, dtype=None):
        from amk.models.hf import _weight
        return _weight(path, self.module(path), name, dtype or self.dtype, required)


def check_dtype(dtype: torch.dtype, where: str) -> None:
    if dtype not in FLOAT_DTYPES:
        raise TraceError(f"{where}: weights of dtype {dtype} are not supported; AMK runs "
                         f"float32 / float16 / bfloat16: pass dtype=torch.float32")


def layer_windows(hf_config, n_layers: int, max_seq: int) -> tuple:
    """Per layer: its sliding window in rows, or None (full attention). layer_types names the
    sliding layers where the config has it (Gemma, Qwen2 with use_sliding_window); otherwise a
    sliding_window applies to every layer (Mistral, Phi-3). A window >= max_seq is a no-op."""
    window = getattr(hf_config, "sliding_window", None)
    if not window:
        return ()
    types = getattr(hf_config, "layer_types", None)
    if types:
        wins = tuple(int(window) if t == "sliding_attention" else None for t in types[:n_layers])
    else:
        wins = (int(window),) * n_layers
    wins = tuple(w if w is not None and w < max_seq else None for w in wins)
    return wins if any(w is not None for w in wins) else ()


def max_seq_for(hf_config, max_seq: int | None, positions_attr: str = "max_position_embeddings") -> int:
    limit = int(getattr(hf_config, positions_attr, 2048) or 2048)
    if max_seq is None:
        return min(limit, 4096)
    if int(max_seq) < 1:
        raise TraceError(f"from_hf: max_seq must be >= 1, got {max_seq}")
    return int(max_seq)


def llama_like_config(hf_model, arch: str, max_seq: int | None, dtype: torch.dtype, **extra) -> FamilyConfig:
    """The FamilyConfig fields every Llama-shaped family shares (Phi-3, OLMo 2): silu MLP,
    RMSNorm, heads, rope from transformers' rotary module (its attention scaling folded into
    the softmax scale, as hf.from_hf does); `extra` sets the family's switches."""
    from amk.models.hf import _rope_info, _rotary
    c = hf_model.config
    if c.hidden_act != "silu":
        raise TraceError(f"from_hf({arch}): hidden_act={c.hidden_act!r}; only silu is supported")
    nh = c.num_attention_heads
    hd = getattr(c, "head_dim", None) or c.hidden_size // nh
    scaling = float(getattr(_rotary(hf_model), "attention_scaling", 1.0))
    return FamilyConfig(
        vocab=c.vocab_size, hidden=c.hidden_size, n_layers=c.num_hidden_layers, n_heads=nh,
        n_kv_heads=c.num_key_value_heads or nh, head_dim=hd, ffn=c.intermediate_size,
        rms_eps=float(c.rms_norm_eps), rope_source=f"hf:{_rope_info(c)[0]}",
        attn_scale=None if scaling == 1.0 else scaling * scaling / hd ** 0.5,
        tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        max_seq=max_seq_for(c, max_seq), dtype=dtype, arch=arch, **extra)


def llama_family_with_windows(hf_model, max_seq: int | None, dtype, tokenizer) -> Model:
    """Mistral / Qwen2 / Qwen3 / Llama whose sliding window is narrower than the cache: the
    Llama step's weights and config, plus per-layer windows."""
    from amk.models.hf import _rotary, config_from_hf, params_from_hf
    hf_config = hf_model.config
    max_seq = max_seq_for(hf_config, max_seq)
    windows = layer_windows(hf_config, hf_config.num_hidden_layers, max_seq)
    saved = hf_config.sliding_window
    try:          # config_from_hf refuses windows: it checks against the Llama step
        hf_config.sliding_window = None
        base = config_from_hf(hf_config, max_seq=max_seq, dtype=dtype)
    finally:
        hf_config.sliding_window = saved
    cfg = FamilyConfig(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                       windows=windows)
    scaling = float(getattr(_rotary(hf_model), "attention_scaling", 1.0))
    if scaling != 1.0:
        cfg = dataclasses.replace(cfg, attn_scale=scaling * scaling / cfg.head_dim ** 0.5)
    return Model(cfg, params_from_hf(hf_model, cfg), tokenizer=tokenizer, hf_config=hf_config)


def loaders():
    from amk.models import gemma, gpt2, olmo2, phi3
    return {"gemma2": gemma.from_hf_gemma, "gemma3_text": gemma.from_hf_gemma,
            "gpt2": gpt2.from_hf_gpt2, "phi3": phi3.from_hf_phi3, "olmo2": olmo2.from_hf_olmo2}


def from_hf_family(hf_model, max_seq: int | None, dtype: torch.dtype, tokenizer) -> Model | None:
    """The Model for hf_model if a family here covers it, else None (the Llama path does)."""
    hf_config = hf_model.config
    arch = getattr(hf_config, "model_type", "")
    load = loaders().get(arch)
    if load is not None:
        check_dtype(dtype, f"from_hf({arch})")
        cfg, params = load(hf_model, max_seq, dtype)
        return Model(cfg, params, tokenizer=tokenizer, hf_config=hf_config)
    if arch in ("llama", "mistral", "qwen2", "qwen3"):
        n = hf_config.num_hidden_layers
        if layer_windows(hf_config, n, max_seq_for(hf_config, max_seq)):
            check_dtype(dtype, f"from_hf({arch})")
            return llama_family_with_windows(hf_model, max_seq, dtype, tokenizer)
    return None
