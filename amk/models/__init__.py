"""Real models on AMK: the decode steps, transformers / safetensors-folder / GGUF loaders."""
from amk.models.llama import DecoderConfig, decode_step, make_decode_step
from amk.models.model import Model
from amk.models.hf import from_hf
from amk.models.gguf import load, load_gguf
from amk.models.checkpoint import from_pretrained

__all__ = ["DecoderConfig", "decode_step", "make_decode_step", "Model", "from_hf", "from_pretrained",
           "load", "load_gguf"]
