"""The Llama-3.2-1B-shaped decode step (random bf16 weights) as an amk.jit cuda step, for the
benchmark tools that run one step of it (profile_decode, ncu_step)."""
from __future__ import annotations

from dataclasses import replace

import torch

import amk
from amk.models.model import Model
from amk.models.presets import LLAMA_3_2_1B, random_params


def cuda_step(context: int, layers: int | None = None):
    """(step, args, cfg): args = (params, token, pos, kv) with pos = context - 1."""
    cfg = LLAMA_3_2_1B if layers is None else replace(LLAMA_3_2_1B, n_layers=layers)
    cfg = replace(cfg, max_seq=context + 64)
    params = random_params(cfg, device="cuda", seed=0)
    m = Model(cfg, params)
    token = torch.tensor([17], dtype=torch.int32, device="cuda")
    pos = torch.tensor([context - 1], dtype=torch.int32, device="cuda")
    step = amk.jit(m.fn, backend="cuda", donate=("kv",))
    return step, (params, token, pos, m.new_kv()), cfg
