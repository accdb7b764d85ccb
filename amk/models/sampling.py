"""Choosing the next token from logits: greedy (the default, exact argmax) or seeded sampling.

Sampling runs with torch ops where the logits are (on the GPU for a GPU model). The draw is
counter-based: a token's Gumbel noise is an integer hash of (seed, draw number, row, token id),
with the draw number a device tensor that each draw increments in place. So no host state
changes between draws: the same ops run eagerly or replayed from a CUDA graph (the cuda
backend's device loop) and give the same tokens, and a seed repeats them on any backend. The
filters are the usual ones, in transformers' order: temperature, then top-k, then top-p (the
smallest set of most likely tokens whose probability reaches top_p; the most likely token
always stays).
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, replace

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


_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32): in 16-bit halves, so int64 never overflows."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32) of int64 values in [0, 2**32), elementwise."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mix32_int(x: int) -> int:
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


class Sampler:
    """next(logits [B, V], greedy_ids [B]) -> int32 [B]; one per generate call. Sampled draws
    are Gumbel-max over the filtered logits with counter-based noise (see the module doc)."""

    def __init__(self, opts: SamplingOptions, device: torch.device):
        self.opts = opts
        self.device = torch.device(device)
        seed = secrets.randbits(64) if opts.seed is None else opts.seed
        self.key = _mix32_int(seed ^ (seed >> 32) ^ 0x5EED)
        self.draws = torch.zeros(1, dtype=torch.int64, device=self.device)  # incremented in place
        self._base: dict[tuple, torch.Tensor] = {}     # per logits shape: the hash of (key, index)

    @property
    def filters(self) -> SamplingOptions:
        """The options but the seed: what decides which ops a draw runs."""
        return replace(self.opts, seed=None)

    def follow(self, other: "Sampler") -> None:
        """Take other's seed and draw count, in this sampler's own tensors (a captured CUDA
        graph baked their addresses: amk/models/device_loop.py)."""
        if other.filters != self.filters:
            raise TraceError(f"Sampler.follow: filters {other.filters} differ from {self.filters}")
        self.opts, self.key = other.opts, other.key
        self.draws.copy_(other.draws)
        for shape, base in self._base.items():
            base.copy_(self._hashes(shape))

    def _hashes(self, shape: tuple[int, int]) -> torch.Tensor:
        idx = torch.arange(shape[0] * shape[1], dtype=torch.int64, device=self.device)
        return mix32(idx.reshape(shape) ^ self.key)

    def noise(self, shape: tuple[int, int]) -> torch.Tensor:
        """fp32 Gumbel noise [B, V] of the next draw (advances the draw counter on the device)."""
        base = self._base.get(shape)
        if base is None:
            base = self._base[shape] = self._hashes(shape)
        h = mix32((base + self.draws * _GOLDEN) & _M32)
        self.draws += 1
        u = ((h >> 8).float() + 0.5) * 2.0 ** -24          # uniform in (0, 1), never 0 or 1
        return -torch.log(-torch.log(u))

    def next(self, logits: torch.Tensor, greedy_ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.opts.greedy:
            if greedy_ids is not None:               # the program's own argmax: exact
                return greedy_ids.reshape(-1).to(torch.int32)
            return torch.argmax(logits.float(), dim=-1).reshape(-1).to(torch.int32)
        x = filter_logits(logits.reshape(-1, logits.shape[-1]), self.opts)
        return torch.argmax(x + self.noise(tuple(x.shape)), dim=-1).to(torch.int32)
