"""`from_pretrained(path)`: a Model straight from a checkpoint folder (config.json and
safetensors files, sharded or not), with no transformers model in memory.

The weights are memory-mapped (amk/models/safetensors_mmap.py) and exposed to the same
loaders `from_hf` uses through `CheckpointModule`, a stand-in that answers the attribute paths
those loaders read (`model.layers.3.self_attn.q_proj.weight`). transformers is used for the
config and, when the folder has one, the tokenizer; the rope frequencies come from the
family's own rotary-embedding class (built from the config alone: no weights).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from amk.errors import TraceError
from amk.models.safetensors_mmap import read_checkpoint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# checkpoints saved from the base model, without the *ForCausalLM prefix
BASE_PREFIX = {"gpt2": "transformer."}


class CheckpointModule:
    """Nested attributes over a flat {dotted name: tensor} dict; digits index like a ModuleList."""

    def __init__(self, tensors: dict[str, torch.Tensor], prefix: str = "",
                 prefixes: frozenset[str] | None = None):
        self._tensors, self._prefix = tensors, prefix
        # every "a.b." that starts a name, once for the whole tree (a scan of every name per
        # lookup was 0.3 s of a SmolLM2 load)
        self._prefixes = prefixes if prefixes is not None else frozenset(
            k[:i + 1] for k in tensors for i, c in enumerate(k) if c == ".")

    def _child(self, name: str):
        key = self._prefix + name
        if key in self._tensors:
            return self._tensors[key]
        sub = key + "."
        if sub in self._prefixes:
            return CheckpointModule(self._tensors, sub, self._prefixes)
        return None

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        extra = self.__dict__.get("extra", {})
        if self._prefix + name in extra:
            return extra[self._prefix + name]
        child = self._child(name)
        if child is None:
            raise AttributeError(f"{self._prefix}{name}")
        return child

    def __getitem__(self, i: int):
        child = self._child(str(i))
        if child is None:
            raise IndexError(f"{self._prefix}{i}")
        return child

    def __len__(self) -> int:
        n = len(self._prefix)
        return len({k[n:].split(".")[0] for k in self._tensors if k.startswith(self._prefix)})


class CheckpointModel(CheckpointModule):
    """What from_hf reads from a transformers *ForCausalLM: .config, .parameters(), the weights
    by path, and model.rotary_emb."""

    def __init__(self, config, tensors: dict[str, torch.Tensor], rotary=None):
        super().__init__(tensors)
        self.__dict__["config"] = config
        self.__dict__["extra"] = {}
        rotary = _rotary_module(config) if rotary is None else rotary
        if rotary is not None:
            self.__dict__["extra"]["model"] = _With(self._child("model"), rotary_emb=rotary)

    def parameters(self):
        return iter(self._tensors.values())


class _With:
    """A CheckpointModule with extra attributes (model.rotary_emb next to model.layers)."""

    def __init__(self, base, **extra):
        self._base, self._extra = base, extra

    def __getattr__(self, name):
        if name in self._extra:
            return self._extra[name]
        return getattr(self._base, name)


def _rotary_module(config):
    """transformers' own rotary embedding for this config (no weights), or None (GPT-2)."""
    import transformers
    mapping = transformers.AutoModelForCausalLM._model_mapping
    try:
        cls = mapping[type(config)]
    except KeyError:
        raise TraceError(f"from_pretrained: transformers has no causal LM for model_type "
                         f"{config.model_type!r}") from None
    module = sys.modules[cls.__module__]
    rot = [getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding")
           and isinstance(getattr(module, n), type)]
    if not rot:
        return None
    return rot[0](config=config)


def _checkpoint_dtype(tensors: dict[str, torch.Tensor], config) -> torch.dtype:
    floats = [t.dtype for t in tensors.values() if t.is_floating_point()]
    return floats[0] if floats else getattr(config, "torch_dtype", None) or torch.float32


def from_pretrained(path: str | Path, max_seq: int | None = None, dtype: torch.dtype | None = None,
                    tokenizer=None):
    """A Model from a folder with config.json and *.safetensors (a save_pretrained output or a
    downloaded hub snapshot). dtype defaults to the checkpoint's; the folder's tokenizer is
    loaded when present (pass tokenizer= to override)."""
    from transformers import AutoConfig
    from amk.models.hf import from_hf
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise TraceError(f"from_pretrained: {folder} has no config.json (a checkpoint folder holds "
                         f"config.json and *.safetensors)")
    config = AutoConfig.from_pretrained(str(folder))
    config = getattr(config, "text_config", None) if config.model_type == "gemma3" else config
    tensors = read_checkpoint(folder)
    prefix = BASE_PREFIX.get(config.model_type)
    if prefix and not any(k.startswith(prefix) for k in tensors):
        tensors = {prefix + k: v for k, v in tensors.items()}
    if tokenizer is None and any((folder / f).is_file() for f in TOKENIZER_FILES):
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = CheckpointModel(config, tensors)
    return from_hf(model, max_seq=max_seq, dtype=dtype or _checkpoint_dtype(tensors, config),
                   tokenizer=tokenizer)
