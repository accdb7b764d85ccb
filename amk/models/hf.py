"""Build an AMK `Model` from a transformers Llama / Mistral / Qwen2 / Qwen3 causal LM.

Weights are shared with the HF module (no copy) when the requested dtype matches. Rope
frequencies are read from the HF rotary-embedding module itself, so every rope-scaling type
transformers implements (llama3, linear, yarn, ...) comes out right without re-deriving it here.
"""
from __future__ import annotations

import torch

from amk.errors import TraceError
from amk.models.llama import DecoderConfig
from amk.models.model import Model

SUPPORTED = {"llama", "mistral", "qwen2", "qwen3"}
# rope types whose frequencies change with the sequence length at run time
LENGTH_DEPENDENT_ROPE = {"dynamic", "longrope"}


def _rope_info(hf_config) -> tuple[str, float, dict]:
    rp = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    theta = rp.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return rope_type, float(theta), rp


def config_from_hf(hf_config, max_seq: int | None = None, dtype: torch.dtype | None = None) -> DecoderConfig:
    """Translate a transformers config; TraceError for anything this decode step cannot express."""
    arch = getattr(hf_config, "model_type", type(hf_config).__name__)
    if arch not in SUPPORTED:
        raise TraceError(f"from_hf: model_type {arch!r} is not supported; AMK covers "
                         f"{sorted(SUPPORTED | {'gemma2', 'gemma3_text', 'phi3', 'gpt2', 'olmo2'})}")
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise TraceError(f"from_hf: {arch} with hidden_act={act!r}; only SwiGLU (silu) MLPs are supported")
    n_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_heads
    max_pos = getattr(hf_config, "max_position_embeddings", 2048)
    max_seq = int(max_seq or min(max_pos, 4096))
    rope_type, theta, rp = _rope_info(hf_config)
    orig_max = rp.get("original_max_position_embeddings", max_pos)
    if rope_type in LENGTH_DEPENDENT_ROPE and max_seq > orig_max:
        raise TraceError(f"from_hf: rope_type {rope_type!r} changes its frequencies past "
                         f"{orig_max} positions, which a fixed inv_freq cannot express; "
                         f"pass max_seq <= {orig_max}")
    _check_sliding_window(hf_config, arch, max_seq)
    attn_bias = bool(getattr(hf_config, "attention_bias", False))
    return DecoderConfig(
        vocab=hf_config.vocab_size, hidden=hf_config.hidden_size,
        n_layers=hf_config.num_hidden_layers, n_heads=n_heads,
        n_kv_heads=getattr(hf_config, "num_key_value_heads", None) or n_heads,
        head_dim=head_dim, ffn=hf_config.intermediate_size,
        rms_eps=float(hf_config.rms_norm_eps), rope_theta=theta, rope_source=f"hf:{rope_type}",
        tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=attn_bias or arch == "qwen2",
        o_bias=attn_bias and arch in ("llama", "mistral"),
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        qk_norm=arch == "qwen3", max_seq=max_seq,
        dtype=dtype or getattr(hf_config, "torch_dtype", None) or torch.float32, arch=arch)


def _check_sliding_window(hf_config, arch: str, max_seq: int) -> None:
    """A sliding window narrower than the cache would change which rows attention sees."""
    window = getattr(hf_config, "sliding_window", None)
    if not window or window >= max_seq:
        return
    if arch in ("qwen2", "qwen3"):
        layer_types = getattr(hf_config, "layer_types", None) or []
        uses = ("sliding_attention" in layer_types if layer_types   # layer_types decides when given
                else getattr(hf_config, "use_sliding_window", False))
        if not uses:
            return
    raise TraceError(f"from_hf: {arch} uses a sliding window of {window} tokens but max_seq={max_seq}; "
                     f"AMK's attention is full-causal: pass max_seq <= {window}")


def _rotary(hf_model):
    for path in ("model.rotary_emb", "rotary_emb"):
        mod = hf_model
        for name in path.split("."):
            mod = getattr(mod, name, None)
        if mod is not None and hasattr(mod, "inv_freq"):
            return mod
    raise TraceError(f"from_hf: {type(hf_model).__name__} has no rotary embedding module "
                     "(model.rotary_emb.inv_freq); cannot derive rope frequencies")


def _weight(module_path: str, mod, name: str, dtype: torch.dtype, required: bool = True):
    t = getattr(mod, name, None) if mod is not None else None
    if t is None:
        if required:
            raise TraceError(f"from_hf: missing weight {module_path}.{name}; the checkpoint does not "
                             "match its config (was it loaded completely?)")
        return None
    t = t.detach()
    if t.is_meta:
        raise TraceError(f"from_hf: weight {module_path}.{name} is on the meta device; "
                         "load the real weights before calling from_hf")
    return t if t.dtype == dtype else t.to(dtype)


def params_from_hf(hf_model, cfg: DecoderConfig) -> dict:
    """The AMK params pytree; tensors alias the HF module's parameters when dtype matches."""
    base = getattr(hf_model, "model", None)
    if base is None or not hasattr(base, "layers"):
        raise TraceError(f"from_hf: {type(hf_model).__name__} has no .model.layers; pass the "
                         "*ForCausalLM model (e.g. LlamaForCausalLM)")
    dt = cfg.dtype

    def w(path, name, required=True):
        mod = hf_model
        for part in path.split(".") if path else []:
            mod = getattr(mod, part, None) if not part.isdigit() else mod[int(part)]
        return _weight(path, mod, name, dt, required)

    layers = []
    for i in range(cfg.n_layers):
        lp = f"model.layers.{i}"
        a, m = f"{lp}.self_attn", f"{lp}.mlp"
        layer = {
            "attn_norm": w(f"{lp}.input_layernorm", "weight"),
            "wq": w(f"{a}.q_proj", "weight"), "wk": w(f"{a}.k_proj", "weight"),
            "wv": w(f"{a}.v_proj", "weight"), "wo": w(f"{a}.o_proj", "weight"),
            "mlp_norm": w(f"{lp}.post_attention_layernorm", "weight"),
            "w_gate": w(f"{m}.gate_proj", "weight"), "w_up": w(f"{m}.up_proj", "weight"),
            "w_down": w(f"{m}.down_proj", "weight"),
        }
        if cfg.qkv_bias:
            layer.update(bq=w(f"{a}.q_proj", "bias"), bk=w(f"{a}.k_proj", "bias"), bv=w(f"{a}.v_proj", "bias"))
        if cfg.o_bias:
            layer["bo"] = w(f"{a}.o_proj", "bias")
        if cfg.mlp_bias:
            layer.update(b_gate=w(f"{m}.gate_proj", "bias"), b_up=w(f"{m}.up_proj", "bias"),
                         b_down=w(f"{m}.down_proj", "bias"))
        if cfg.qk_norm:
            layer.update(q_norm=w(f"{a}.q_norm", "weight"), k_norm=w(f"{a}.k_norm", "weight"))
        layers.append(layer)
    embed = w("model.embed_tokens", "weight")
    lm_head = embed if cfg.tie_embeddings else w("lm_head", "weight")
    return {"embed": embed, "layers": layers, "norm": w("model.norm", "weight"),
            "lm_head": lm_head, "inv_freq": _rotary(hf_model).inv_freq.detach().float()}


def from_hf(hf_model, max_seq: int | None = None, dtype: torch.dtype | None = None,
            tokenizer=None) -> Model:
    """An AMK Model running `hf_model`'s decode step; dtype defaults to the HF weights' dtype."""
    hf_config = getattr(hf_model, "config", None)
    if hf_config is None:
        raise TraceError(f"from_hf: {type(hf_model).__name__} has no .config; pass a transformers "
                         "*ForCausalLM model")
    dtype = dtype or next(hf_model.parameters()).dtype
    from amk.models.families import check_dtype, from_hf_family
    check_dtype(dtype, "from_hf")
    family = from_hf_family(hf_model, max_seq, dtype, tokenizer)   # Gemma, Phi-3, GPT-2, OLMo 2, windows
    if family is not None:
        return family
    cfg = config_from_hf(hf_config, max_seq=max_seq, dtype=dtype)
    rotary = _rotary(hf_model)
    scaling = float(getattr(rotary, "attention_scaling", 1.0))
    if scaling != 1.0:
        # HF multiplies cos and sin by `scaling` (yarn's mscale): q and k both grow by it, so the
        # attention logits grow by scaling**2. Folding that into the softmax scale is exact.
        import dataclasses
        cfg = dataclasses.replace(cfg, attn_scale=scaling * scaling / cfg.head_dim ** 0.5)
    params = params_from_hf(hf_model, cfg)
    if params["inv_freq"].shape != (cfg.head_dim // 2,):
        raise TraceError(f"from_hf: rotary inv_freq has shape {tuple(params['inv_freq'].shape)}, "
                         f"expected ({cfg.head_dim // 2},) for head_dim {cfg.head_dim}; partial "
                         "rotary embeddings are not supported")
    return Model(cfg, params, tokenizer=tokenizer, hf_config=hf_config)
