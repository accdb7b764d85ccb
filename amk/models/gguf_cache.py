"""The GGUF load, cached: transformers parses and dequantizes a GGUF file in 15-25 s, every
run. The first load saves what it produced (config.json, the tokenizer, the dequantized
weights as one safetensors file) in a folder under AMK_CACHE_DIR/gguf/, keyed by the file's
absolute path, size, mtime and the dtype; later loads memory-map that folder
(`from_pretrained`) in well under a second. The folder is written under a temporary name and
renamed into place, so a reader never sees half of one; a failed write only costs the cache.

A warm load imports no transformers (seconds of imports alone): the folder also keeps AMK's
DecoderConfig (amk_config.json) and the rope frequencies (tensor "amk.inv_freq"), and the
tokenizer is read by the `tokenizers` library (amk/models/light_tokenizer.py).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import torch

from amk import knobs

DONE = "amk-complete"          # written last: a folder without it is ignored
CONFIG = "amk_config.json"
INV_FREQ = "amk.inv_freq"


def _key(path: str | Path, dtype: torch.dtype) -> str:
    p = Path(path).resolve()
    st = p.stat()
    text = f"{p}|{st.st_size}|{st.st_mtime_ns}|{dtype}"
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def folder_for(path: str | Path, dtype: torch.dtype) -> Path:
    return knobs.cache_dir() / "gguf" / f"{Path(path).stem}-{_key(path, dtype)}"


def cached_folder(path: str | Path, dtype: torch.dtype) -> Path | None:
    """The complete cache folder for this GGUF file and dtype, or None."""
    try:
        folder = folder_for(path, dtype)
    except OSError:
        return None
    return folder if (folder / DONE).is_file() and (folder / CONFIG).is_file() else None


def load_folder(folder: Path, max_seq: int, dtype: torch.dtype):
    """The Model of a complete cache folder, without transformers."""
    import dataclasses
    import json
    from amk.models.checkpoint import CheckpointModel
    from amk.models.hf import params_from_hf
    from amk.models.light_tokenizer import LightTokenizer
    from amk.models.llama import DecoderConfig
    from amk.models.model import Model
    from amk.models.safetensors_mmap import read_checkpoint
    fields = json.loads((folder / CONFIG).read_text())
    fields["dtype"] = getattr(torch, fields["dtype"].replace("torch.", ""))
    cfg = dataclasses.replace(DecoderConfig(**fields), max_seq=max_seq, dtype=dtype)
    tensors = read_checkpoint(folder)
    inv = tensors.pop(INV_FREQ)
    model = CheckpointModel(None, tensors, rotary=type("Rotary", (), {"inv_freq": inv})())
    tok = LightTokenizer(folder) if LightTokenizer.available(folder) else None
    return Model(cfg, params_from_hf(model, cfg), tokenizer=tok)


def save_folder(path: str | Path, dtype: torch.dtype, hf_model, tokenizer, config=None) -> Path | None:
    """Write the cache folder (best effort: None when the disk refuses)."""
    from safetensors.torch import save_file
    folder = folder_for(path, dtype)
    tmp = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
        hf_model.config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
        if getattr(hf_model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)          # one tensor, saved once
        if config is not None:                         # AMK's own config: a warm load needs no transformers
            import dataclasses
            import json
            from amk.models.hf import _rotary
            fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
            fields["dtype"] = str(fields["dtype"])
            (tmp / CONFIG).write_text(json.dumps(fields, indent=1))
            state[INV_FREQ] = _rotary(hf_model).inv_freq.detach().float().contiguous()
        save_file(state, str(tmp / "model.safetensors"))
        (tmp / DONE).write_text(str(Path(path).resolve()))
        if folder.exists():
            shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
        return folder
    except OSError:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        return None
