"""The generate loop: prefill the prompt in chunks, then one decode step per new token.

Greedy by default (the step's own argmax: exactly transformers' greedy tokens); with a
temperature, seeded sampling (amk/models/sampling.py). What ran is recorded in
`GenerationStats` (Model.last_stats): prefill chunks and tokens, decode steps, the time to the
first token and the decode time, so a caller reports rates from what actually happened.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from amk.errors import TraceError
from amk.models.device_loop import device_loop
from amk.models.prefill import CHUNK_SIZES, prefill
from amk.models.sampling import Sampler, SamplingOptions


@dataclass
class GenerationStats:
    prompt_tokens: int = 0          # all sequences' prompts together
    batch: int = 1
    prefill_chunks: list = field(default_factory=list)   # the Chunk of every prefill program run
    decode_steps: int = 0           # decode-step program runs
    new_tokens: int = 0             # per sequence, including the one prefill produced
    first_token_s: float = 0.0      # from the call to the first new token on the host
    decode_s: float = 0.0           # from the first new token to the last
    graph_replays: int = 0          # cuda: CUDA-graph replays of sync_every steps among them

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.first_token_s if self.first_token_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_steps * self.batch / self.decode_s if self.decode_s else 0.0


def positions(lengths: list[int], device) -> torch.Tensor:
    """The decode step's pos input after prompts of these lengths: int32 [1] when they are all
    one length (every row at one position), else int32 [B], sequence b at its own position."""
    if len(set(lengths)) == 1:
        return torch.full((1,), lengths[0], dtype=torch.int32, device=device)
    return torch.tensor(lengths, dtype=torch.int32, device=device)


def kv_of_sequence(kv: list, b: int, batch: int) -> list:
    """Sequence b's single-sequence caches (views: prefill writes the batch cache in place)."""
    if batch == 1:
        return kv
    return [{k: c[b] for k, c in layer.items()} for layer in kv]


def generate(model, prompts: list[torch.Tensor], max_new_tokens: int, backend: str | None = None,
             on_token: Callable | None = None, eos_token_id: int | None = None,
             return_logits: bool = False, sampling: SamplingOptions = SamplingOptions(),
             chunk_sizes: tuple[int, ...] = CHUNK_SIZES, sync_every: int | None = None):
    """prompts: B int32 [T_b] id tensors, of any lengths. See Model.generate. sync_every: new tokens
    kept on the device between host syncs (default 1 on the CPU, 8 on a GPU): the token feeds
    the next step on the device; EOS and on_token are checked at each sync. On the cuda
    backend those steps are one CUDA-graph replay (amk/models/device_loop.py)."""
    if sync_every is None:
        sync_every = 8 if model.device.type == "cuda" else 1
    for name, v in (("max_new_tokens", max_new_tokens), ("sync_every", sync_every)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise TraceError(f"generate: {name} must be a positive integer, got {v!r}")
    batch, lengths = len(prompts), [int(p.numel()) for p in prompts]
    # the last new token is sampled, never fed back: positions 0 .. T + new - 2 are cached
    if max(lengths) + max_new_tokens - 1 > model.config.max_seq:
        raise TraceError(f"generate: prompt {max(lengths)} + {max_new_tokens} new tokens needs "
                         f"{max(lengths) + max_new_tokens - 1} cache rows, more than max_seq "
                         f"{model.config.max_seq}; build the model with a larger max_seq")
    stats = GenerationStats(prompt_tokens=sum(lengths), batch=batch)
    model.last_stats = stats
    t0 = time.perf_counter()
    sampler = Sampler(sampling, model.device)
    kv = model.generation_kv(batch)
    last = [prefill(model, prompts[b], kv_of_sequence(kv, b, batch), backend, chunk_sizes,
                    on_chunk=stats.prefill_chunks.append) for b in range(batch)]
    logits = torch.stack(last)                                   # [B, V]
    token = sampler.next(logits)
    step = model.jit(backend)
    pos = positions(lengths, model.device)
    col = _Collector(batch, max_new_tokens, eos_token_id, return_logits, on_token, stats, t0)
    if col.add(token.cpu(), token, logits):
        return col.result(step)
    keep_logits = return_logits or on_token is not None
    loop = device_loop(step, (model.params, token, pos, kv), sampler, token, sync_every,
                       eos_token_id, keep_logits, cache=model._device_loops)
    if loop is not None:      # the cuda backend: sync_every steps a CUDA graph replay

        def take(host, dev, logit_slots) -> bool:
            for k in range(host.shape[0]):
                lg = logit_slots[k] if logit_slots is not None else None
                tok = dev[k, 0].clone() if on_token is not None else None
                if col.add(host[k, 0], tok, lg, host[k, 1].bool()):
                    return True
            return False
        stats.decode_steps, stats.graph_replays = loop.run(max_new_tokens - 1, take)
        return col.result(step)
    pending = []              # (token, logits) of steps still on the device, oldest first
    while True:
        if len(pending) >= sync_every or len(col.out) + len(pending) >= max_new_tokens:
            host = torch.stack([t for t, _ in pending]).cpu()     # one sync
            if any(col.add(host[k], t, lg) for k, (t, lg) in enumerate(pending)):
                break         # steps already run past this point are dropped
            pending.clear()
        greedy_ids, logits, kv = step(model.params, token, pos, kv)
        stats.decode_steps += 1
        token = sampler.next(logits, greedy_ids)
        pending.append((token, logits))
        pos += 1                      # on the device: the next step's input, no host copy
    return col.result(step)


class _Collector:
    """The new tokens on the host, in order: EOS, on_token, the logits kept, the stats."""

    def __init__(self, batch, max_new_tokens, eos_token_id, return_logits, on_token, stats, t0):
        self.batch, self.max_new, self.eos = batch, max_new_tokens, eos_token_id
        self.return_logits, self.on_token, self.stats, self.t0 = return_logits, on_token, stats, t0
        self.out: list[torch.Tensor] = []
        self.all_logits: list[torch.Tensor] = []
        self.done = torch.zeros(batch, dtype=torch.bool)

    def add(self, host_tok, dev_tok, logits, done=None) -> bool:
        """One new token per sequence (host int32 [B]); done: the device's EOS flags after it
        (None: compared here). True once generation must stop."""
        self.out.append(host_tok.clone())
        if len(self.out) == 1:
            self.stats.first_token_s = time.perf_counter() - self.t0
        if self.return_logits:
            self.all_logits.append(logits.detach().reshape(self.batch, -1).float().cpu().clone())
        if self.on_token is not None:
            self.on_token(len(self.out) - 1, dev_tok, logits)
        if self.eos is not None:
            self.done.copy_(done if done is not None else self.done | (host_tok == self.eos))
        return len(self.out) == self.max_new or bool(self.done.all())

    def result(self, step):
        step.sync()                   # any asynchronous step's fault raises here at the latest
        s = self.stats
        s.new_tokens = len(self.out)
        s.decode_s = time.perf_counter() - self.t0 - s.first_token_s
        new = torch.stack(self.out, dim=1).tolist()
        result = new[0] if self.batch == 1 else new
        return (result, self.all_logits) if self.return_logits else result
