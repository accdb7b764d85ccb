"""A preset shape's decode step (random bf16 weights) as an amk.jit cuda step, for the benchmark
tools that run one step of it (profile_decode, ncu_step)."""
from __future__ import annotations

from dataclasses import replace

import torch

import amk
from amk.models.model import Model
from amk.models.presets import PRESETS, random_params


def cuda_step(context: int, layers: int | None = None, model: str = "llama-3.2-1b",
              max_seq: int = 8192, batch: int = 1, quant: str | None = None):
    """(step, args, cfg): args = (params, token, pos, kv) with pos = context - 1, a cache of
    max_seq rows (what a user allocates), `batch` sequences (one token and cache each); quant:
    every linear and the LM head weight-only quantized to that format (Model.quantize)."""
    if not 1 <= context <= max_seq:
        raise ValueError(f"context {context} must be in 1..max_seq {max_seq}")
    cfg = replace(PRESETS[model], max_seq=max_seq)
    cfg = cfg if layers is None else replace(cfg, n_layers=layers)
    params = random_params(cfg, device="cuda", seed=0)
    m = Model(cfg, params)
    if quant:
        m.quantize(quant)            # in place: params holds the quantized weights now
    token = torch.full((batch,), 17, dtype=torch.int32, device="cuda")
    pos = torch.tensor([context - 1], dtype=torch.int32, device="cuda")
    step = amk.jit(m.fn, backend="cuda", donate=("kv",))
    return step, (params, token, pos, m.new_kv(batch)), cfg
