"""Choosing the next token from logits: greedy (the default, exact argmax) or seeded sampling.

Sampling runs with torch ops where the logits are (on the GPU for a GPU model) and draws from a
torch.Generator seeded once per generate call, so a seed repeats its tokens. The filters are the
usual ones, in transformers' order: temperature, then top-k, then top-p (the smallest set of
most likely tokens whose probability reaches top_p; the most likely token always stays).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from amk.errors import TraceError


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 0.0        # 0 = greedy
    top_k: int | None = None        # None / 0 = no top-k filter
    top_p: float | None = None      # None / 1.0 = no top-p filter
    seed: int | None = None         # None = a fresh random seed

    def __post_init__(self):
        t, k, p = self.temperature, self.top_k, self.top_p
        if not isinstance(t, (int, float)) or t < 0 or t != t:
            raise TraceError(f"generate: temperature must be a number >= 0 (0 = greedy), got {t!r}")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise TraceError(f"generate: top_k must be a non-negative integer (0 = off), got {k!r}")
        if p is not None and (not isinstance(p, (int, float)) or not 0 < p <= 1):
            raise TraceError(f"generate: top_p must be in (0, 1], got {p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise TraceError(f"generate: seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(logits: torch.Tensor, opts: SamplingOptions) -> torch.Tensor:
    """fp32 logits [B, V] / temperature with the tokens top-k / top-p drop set to -inf."""
    x = logits.float() / opts.temperature
    if opts.top_k:
        k = min(opts.top_k, x.shape[-1])
        kth = torch.topk(x, k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if opts.top_p is not None and opts.top_p < 1:
        srt, idx = torch.sort(x, dim=-1, descending=True)
        before = torch.softmax(srt, dim=-1).cumsum(dim=-1) - torch.softmax(srt, dim=-1)
        drop = before >= opts.top_p                  # the mass before it already reaches top_p
        x = x.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    return x


class Sampler:
    """next(logits [B, V], greedy_ids [B]) -> int32 [B]; one generator per generate call."""

    def __init__(self, opts: SamplingOptions, device: torch.device):
        self.opts = opts
        self.generator = None
        if not opts.greedy:
            self.generator = torch.Generator(device=device)
            if opts.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(opts.seed)

    def next(self, logits: torch.Tensor, greedy_ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.opts.greedy:
            if greedy_ids is not None:               # the program's own argmax: exact
                return greedy_ids.reshape(-1).to(torch.int32)
            return torch.argmax(logits.float(), dim=-1).reshape(-1).to(torch.int32)
        probs = torch.softmax(filter_logits(logits.reshape(-1, logits.shape[-1]), self.opts), -1)
        return torch.multinomial(probs, 1, generator=self.generator).reshape(-1).to(torch.int32)
