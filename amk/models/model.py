"""`Model`: a decoder config + its weights + the jitted decode step, and a greedy generate loop.

The prompt goes through the same one-token decode step as generation (no separate prefill), so
one compiled program serves the whole run; the KV cache is donated and updated in place.
"""
from __future__ import annotations

from typing import Callable

import torch

from amk.errors import TraceError
from amk.models.llama import DecoderConfig, make_decode_step


def _step_for(config: DecoderConfig):
    from amk.models.decoder import FamilyConfig, make_decode_step as make_family_step
    return make_family_step(config) if isinstance(config, FamilyConfig) else make_decode_step(config)


class Model:
    def __init__(self, config: DecoderConfig, params: dict, tokenizer=None, hf_config=None):
        self.config = config
        self.params = params
        self.tokenizer = tokenizer
        self.hf_config = hf_config
        self.fn = _step_for(config)
        self._steps: dict = {}

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
        if backend not in self._steps:
            import amk
            kw = {"donate": ("kv",)}
            if backend is not None:
                kw["backend"] = backend
            self._steps[backend] = amk.jit(self.fn, **kw)
        return self._steps[backend]

    @property
    def step(self):
        return self.jit(None)

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

    def example_args(self, batch: int = 1):
        token = torch.zeros(batch, dtype=torch.int32, device=self.device)
        pos = torch.zeros(1, dtype=torch.int32, device=self.device)
        return self.params, token, pos, self.new_kv(batch)

    def lower(self, backend: str | None = None, batch: int = 1):
        """The staged object (.graph, .stages, .program) of this model's decode step."""
        return self.jit(backend).lower(*self.example_args(batch))

    def _prompt_ids(self, input_ids) -> torch.Tensor:
        if isinstance(input_ids, str):
            if self.tokenizer is None:
                raise TraceError("generate: got a string prompt but this Model has no tokenizer; "
                                 "pass token ids")
            input_ids = self.tokenizer(input_ids).input_ids
        ids = torch.as_tensor(input_ids, dtype=torch.int32)
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2 or ids.shape[1] == 0:
            raise TraceError(f"generate: input_ids must be [T] or [B, T] with T >= 1, got {tuple(ids.shape)}")
        bad = (ids < 0) | (ids >= self.config.vocab)
        if bool(bad.any()):
            raise TraceError(f"generate: argument 'input_ids' holds token id {int(ids[bad][0])}, "
                             f"outside the model's vocabulary [0, {self.config.vocab}) "
                             f"(amk.ops.embed's 'ids')")
        return ids

    def generate(self, input_ids, max_new_tokens: int = 32, backend: str | None = None,
                 on_token: Callable | None = None, eos_token_id: int | None = None,
                 return_logits: bool = False):
        """Greedy decoding. input_ids: [T] / [B, T] ids (all B prompts of one length) or a string.

        Returns the new token ids: a list[int] for one sequence, list[list[int]] for a batch; with
        return_logits=True also the logits of every generated position ([B, V] per step).
        on_token(step, ids, logits) is called after each new token (ids int32 [B]).
        Stops early when every sequence has produced eos_token_id.
        """
        ids = self._prompt_ids(input_ids)
        batch, t_prompt = ids.shape
        if max_new_tokens < 0:
            raise TraceError(f"generate: max_new_tokens must be >= 0, got {max_new_tokens}")
        # the last new token is sampled, never fed back: positions 0 .. T + new - 2 are cached
        if t_prompt + max_new_tokens - 1 > self.config.max_seq:
            raise TraceError(f"generate: prompt {t_prompt} + {max_new_tokens} new tokens needs "
                             f"{t_prompt + max_new_tokens - 1} cache rows, more than max_seq "
                             f"{self.config.max_seq}; build the model with a larger max_seq")
        step = self.jit(backend)
        kv = self.new_kv(batch)
        ids = ids.t().contiguous().to(self.device)  # [T, B]: each position's tokens contiguous
        pos = torch.zeros(1, dtype=torch.int32, device=self.device)
        out: list[torch.Tensor] = []
        all_logits: list[torch.Tensor] = []
        done = torch.zeros(batch, dtype=torch.bool)
        token = ids[0]
        for p in range(t_prompt + max_new_tokens - 1):
            pos.fill_(p)
            next_ids, logits, kv = step(self.params, token, pos, kv)
            if p + 1 < t_prompt:  # still reading the prompt
                token = ids[p + 1]
                continue
            next_ids = next_ids.to(torch.int32).reshape(batch)
            out.append(next_ids.cpu())
            if return_logits:
                all_logits.append(logits.detach().reshape(batch, -1).float().cpu().clone())
            if on_token is not None:
                on_token(len(out) - 1, next_ids, logits)
            if eos_token_id is not None:
                done |= out[-1] == eos_token_id
                if bool(done.all()):
                    break
            token = next_ids
        new = torch.stack(out, dim=1).tolist() if out else [[] for _ in range(batch)]
        result = new[0] if batch == 1 else new
        return (result, all_logits) if return_logits else result

    def decode(self, ids) -> str:
        if self.tokenizer is None:
            raise TraceError("decode: this Model has no tokenizer")
        return self.tokenizer.decode(ids, skip_special_tokens=True)
