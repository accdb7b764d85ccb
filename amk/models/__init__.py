"""Real models on AMK: the Llama-family decode step, transformers and GGUF loaders."""
from amk.models.llama import DecoderConfig, decode_step, make_decode_step
from amk.models.model import Model
from amk.models.hf import from_hf
from amk.models.gguf import load, load_gguf

__all__ = ["DecoderConfig", "decode_step", "make_decode_step", "Model", "from_hf", "load", "load_gguf"]
