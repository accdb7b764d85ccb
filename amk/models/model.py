"""`Model`: a decoder config + its weights + the jitted decode step, and generate.

The prompt is prefilled in chunks of T tokens by the same step function traced with T rows
(amk/models/prefill.py); generation is one decode step per token (amk/models/generate.py).
The KV cache is donated and updated in place.
"""
from __future__ import annotations

from typing import Callable

import torch

from amk.errors import TraceError
from amk.models.llama import DecoderConfig, make_decode_step


def _step_for(config: DecoderConfig, last_only: bool = False):
    from amk.models.decoder import FamilyConfig, make_decode_step as make_family_step
    make = make_family_step if isinstance(config, FamilyConfig) else make_decode_step
    return make(config, last_only)


class Model:
    def __init__(self, config: DecoderConfig, params: dict, tokenizer=None, hf_config=None):
        self.config = config
        self.params = params
        self.tokenizer = tokenizer
        self.hf_config = hf_config
        self.fn = _step_for(config)
        self.prefill_fn = _step_for(config, last_only=True)    # logits of a chunk's last row
        self._steps: dict = {}
        self._prefill_steps: dict = {}
        self._generation_kv: dict = {}      # generate's caches, kept between calls
        self._device_loops: dict = {}       # generate's captured decode loop (cuda), likewise
        self.last_stats = None          # GenerationStats of the last generate call

    def __repr__(self) -> str:
        c = self.config
        return (f"Model({c.arch}: {c.n_layers} layers, hidden {c.hidden}, heads {c.n_heads}/"
                f"{c.n_kv_heads}x{c.head_dim}, ffn {c.ffn}, vocab {c.vocab}, {c.dtype}, max_seq {c.max_seq})")

    @property
    def device(self) -> torch.device:
        return self.params["embed"].device

    def to(self, device=None, dtype: torch.dtype | None = None) -> "Model":
        """Move (and/or cast) the weights in place; tied tensors stay one tensor. inv_freq stays f32.
        Compiled steps are kept: the jit cache is keyed by signature, so a new dtype retraces."""
        import dataclasses
        seen: dict[int, torch.Tensor] = {}

        def move(t, keep_dtype=False):
            if id(t) not in seen:
                dt = None if keep_dtype or not t.is_floating_point() else dtype
                seen[id(t)] = t.to(device=device, dtype=dt)
            return seen[id(t)]

        def walk(x):
            if isinstance(x, torch.Tensor):
                return move(x)
            if isinstance(x, dict):
                return {k: move(v, True) if k.startswith("inv_freq") else walk(v) for k, v in x.items()}
            if isinstance(x, (list, tuple)):
                return type(x)(walk(v) for v in x)
            return x   # e.g. an amk.QuantizedWeight: left to its owner

        self.params = walk(self.params)
        if dtype is not None:
            self.config = dataclasses.replace(self.config, dtype=dtype)
        return self

    def jit(self, backend: str | None = None):
        """The amk.jit'ed decode step for `backend` (None = AMK's default), built once."""
        return self._jitted(self._steps, self.fn, backend)

    def prefill_jit(self, backend: str | None = None):
        """The jitted step for prompt chunks: the decode step with the final norm and LM head on
        the chunk's last row only (logits [1, V]). The CUDA megakernel runs one position per
        step, so on the cuda backend (the default on a GPU) chunks run on the triton backend."""
        from amk import knobs
        resolved = backend or knobs.backend() or ("cuda" if self.device.type == "cuda" else None)
        return self._jitted(self._prefill_steps, self.prefill_fn,
                            "triton" if resolved == "cuda" else backend)

    @staticmethod
    def _jitted(steps: dict, fn, backend: str | None):
        if backend not in steps:
            import amk
            kw = {"donate": ("kv",)}
            if backend is not None:
                kw["backend"] = backend
            steps[backend] = amk.jit(fn, **kw)
        return steps[backend]

    @property
    def step(self):
        return self.jit(None)

    def shard(self, n: int, order: str = "program", seed: int = 0):
        """Tensor parallelism over n ranks (Megatron-style, amk/models/shard.py): a ShardedModel
        whose n rank programs run together on the reference backend's rank simulator."""
        from amk.models.shard import ShardedModel
        return ShardedModel(self, n, order, seed)

    LINEAR_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")

    def quantize(self, fmt: str | None = None, bits: int = 8, group: int = 128,
                 lm_head: bool = True) -> "Model":
        """Weight-only quantization of every linear layer (and the lm_head: it then gets its own
        quantized copy, the embedding table stays float). fmt "int8", "int4" or "fp8" (E4M3,
        a scale per group); without it, the integer format of `bits` bits. Biases stay float
        and are added in the GEMV's epilogue. In place; returns self."""
        from amk.quant import FORMATS, QuantizedWeight, quantize
        fmt = fmt or f"int{bits}"
        if fmt not in FORMATS:
            raise TraceError(f"Model.quantize: format must be one of {', '.join(FORMATS)}, got {fmt!r}")
        for layer in self.params["layers"]:
            for k in self.LINEAR_WEIGHTS:
                if not isinstance(layer[k], QuantizedWeight):
                    layer[k] = quantize(layer[k], group=group, fmt=fmt)
        if lm_head and not isinstance(self.params["lm_head"], QuantizedWeight):
            self.params["lm_head"] = quantize(self.params["lm_head"], group=group, fmt=fmt)
        return self

    def new_kv(self, batch: int = 1) -> list:
        """Zeroed caches, one {"k", "v"} per layer: [max_seq, n_kv, hd] for batch 1, else [B, ...]."""
        c = self.config
        shape = (c.max_seq, c.n_kv_heads, c.head_dim) if batch == 1 else (batch, c.max_seq, c.n_kv_heads, c.head_dim)
        return [{"k": torch.zeros(shape, dtype=c.dtype, device=self.device),
                 "v": torch.zeros(shape, dtype=c.dtype, device=self.device)} for _ in range(c.n_layers)]

    def generation_kv(self, batch: int = 1) -> list:
        """The caches `generate` runs on, kept between its calls (one set at a time): the same
        addresses every call, so the prompt chunks' captured CUDA graphs (triton backend) replay
        instead of being captured again inside the first token's time (bench/NOTES.md v20).
        Not zeroed: every step writes a cache row before any step of the call reads it. Two
        generate calls at once on one Model would share them."""
        key = (batch, self.config, str(self.device))     # a new shape, dtype or device: new caches
        if key not in self._generation_kv:
            self._generation_kv = {key: self.new_kv(batch)}
        return self._generation_kv[key]

    def example_args(self, batch: int = 1):
        token = torch.zeros(batch, dtype=torch.int32, device=self.device)
        pos = torch.zeros(1, dtype=torch.int32, device=self.device)
        return self.params, token, pos, self.new_kv(batch)

    def lower(self, backend: str | None = None, batch: int = 1):
        """The staged object (.graph, .stages, .program) of this model's decode step."""
        return self.jit(backend).lower(*self.example_args(batch))

    def _prompt_ids(self, input_ids) -> list[torch.Tensor]:
        """The prompts as int32 [T_b] tensors: from a string, ids [T] or [B, T], or a list of
        prompts (strings or id lists) of any lengths."""
        if isinstance(input_ids, str):
            prompts = [self._one_prompt(input_ids)]
        elif isinstance(input_ids, (list, tuple)) and input_ids and not isinstance(input_ids[0], int):
            prompts = [self._one_prompt(p) for p in input_ids]      # strings, id lists, [T] tensors
        else:
            ids = torch.as_tensor(input_ids, dtype=torch.int32)
            if ids.dim() == 1:
                ids = ids[None]
            if ids.dim() != 2:
                raise TraceError(f"generate: input_ids must be [T], [B, T] or a list of prompts, "
                                 f"got shape {tuple(ids.shape)}")
            prompts = [self._one_prompt(row) for row in ids]
        if any(p.numel() == 0 for p in prompts):
            raise TraceError("generate: every prompt needs at least one token")
        return prompts

    def _one_prompt(self, prompt) -> torch.Tensor:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise TraceError("generate: got a string prompt but this Model has no tokenizer; "
                                 "pass token ids")
            prompt = self.tokenizer(prompt).input_ids
        ids = torch.as_tensor(prompt, dtype=torch.int32)
        if ids.dim() != 1:
            raise TraceError(f"generate: each prompt of a list must be [T] ids, got {tuple(ids.shape)}")
        bad = (ids < 0) | (ids >= self.config.vocab)
        if bool(bad.any()):
            raise TraceError(f"generate: argument 'input_ids' holds token id {int(ids[bad][0])}, "
                             f"outside the model's vocabulary [0, {self.config.vocab}) "
                             f"(amk.ops.embed's 'ids')")
        return ids

    def generate(self, input_ids, max_new_tokens: int = 32, backend: str | None = None,
                 on_token: Callable | None = None, eos_token_id: int | None = None,
                 return_logits: bool = False, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None,
                 chunk_sizes: tuple[int, ...] | None = None):
        """Decode after a chunked prefill. input_ids: a string, [T] / [B, T] ids, or a list of
        prompts (strings or id lists) of different lengths: each sequence decodes at its own
        position, its tokens those of generating it alone. Greedy (exact argmax) unless temperature > 0: then sampled with
        top_k / top_p, reproducibly for a seed (amk/models/sampling.py).

        Returns the new token ids: a list[int] for one sequence, list[list[int]] for a batch; with
        return_logits=True also the logits of every generated position ([B, V] per step).
        on_token(step, ids, logits) is called after each new token (ids int32 [B]).
        Stops early when every sequence has produced eos_token_id. What ran (prefill chunks,
        decode steps, times) is in self.last_stats afterwards.
        """
        from amk.models.generate import generate
        from amk.models.prefill import CHUNK_SIZES
        from amk.models.sampling import SamplingOptions
        sampling = SamplingOptions(temperature, top_k, top_p, seed)
        return generate(self, self._prompt_ids(input_ids), max_new_tokens, backend, on_token,
                        eos_token_id, return_logits, sampling, chunk_sizes or CHUNK_SIZES)

    def batch(self, slots: int, backend: str | None = None, temperature: float = 0.0,
              top_k: int | None = None, top_p: float | None = None, seed: int | None = None):
        """Continuous batching: `slots` sequences decoding together, each at its own position;
        add() a prompt into a free slot, step() them all, release() a finished one
        (amk/models/batch.py has an example)."""
        from amk.models.batch import Batch
        from amk.models.sampling import SamplingOptions
        return Batch(self, slots, backend, SamplingOptions(temperature, top_k, top_p, seed))

    def decode(self, ids) -> str:
        if self.tokenizer is None:
            raise TraceError("decode: this Model has no tokenizer")
        return self.tokenizer.decode(ids, skip_special_tokens=True)
