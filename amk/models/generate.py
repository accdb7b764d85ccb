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
    the next step on the device; EOS and on_token are checked at each sync."""
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
    kv = model.new_kv(batch)
    last = [prefill(model, prompts[b], kv_of_sequence(kv, b, batch), backend, chunk_sizes,
                    on_chunk=stats.prefill_chunks.append) for b in range(batch)]
    logits = torch.stack(last)                                   # [B, V]
    token = sampler.next(logits)
    step = model.jit(backend)
    pos = positions(lengths, model.device)
    out: list[torch.Tensor] = []
    all_logits: list[torch.Tensor] = []
    done = torch.zeros(batch, dtype=torch.bool)
    pending = [(token, logits)]       # new tokens still on the device, oldest first

    def flush() -> bool:
        """Bring the pending tokens to the host (one sync); True once generation must stop."""
        host = torch.stack([t for t, _ in pending]).cpu()
        for k, (_, lg) in enumerate(pending):
            out.append(host[k])
            if len(out) == 1:
                stats.first_token_s = time.perf_counter() - t0
            if return_logits:
                all_logits.append(lg.detach().reshape(batch, -1).float().cpu().clone())
            if on_token is not None:
                on_token(len(out) - 1, pending[k][0], lg)
            if eos_token_id is not None:
                done.copy_(done | (host[k] == eos_token_id))
            if len(out) == max_new_tokens or bool(done.all()):
                return True           # steps already run past this point are dropped
        pending.clear()
        return False

    while True:
        if not out or len(pending) >= sync_every or len(out) + len(pending) >= max_new_tokens:
            if flush():
                break
        greedy_ids, logits, kv = step(model.params, token, pos, kv)
        stats.decode_steps += 1
        token = sampler.next(logits, greedy_ids)
        pending.append((token, logits))
        pos += 1                      # on the device: the next step's input, no host copy
    step.sync()                       # any asynchronous step's fault raises here at the latest
    stats.new_tokens = len(out)
    stats.decode_s = time.perf_counter() - t0 - stats.first_token_s
    new = torch.stack(out, dim=1).tolist()
    result = new[0] if batch == 1 else new
    return (result, all_logits) if return_logits else result
