"""Tensor-parallel sharding of a Llama-family Model: `Model.shard(n)` -> ShardedModel.

Megatron-style over n ranks (amk/models/tp_step.py is the rank's step):
  column-parallel (a slice of the output features): wq/bq by q heads, wk/wv/bk/bv by kv heads,
      w_gate/w_up/b_gate/b_up by intermediate columns;
  row-parallel (a slice of the input features, partial sums all-reduced): wo by q heads, w_down
      by intermediate columns; their biases bo / b_down stay whole (added after the reduce);
  vocab-parallel: the LM head by vocab rows (the greedy token is a MAXLOC all-reduce);
  replicated: the embedding, every norm, inv_freq.
Rank r gets q heads [r*nh/n, (r+1)*nh/n) and kv heads [r*nkv/n, (r+1)*nkv/n): with GQA those
q heads read exactly those kv heads, so a rank's KV cache holds only its kv heads.

The ranks run on the reference backend's rank simulator (amk/backends/reference/ranks.py):
each rank's step is its own amk.jit'ed program, the n programs run together on one device.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from amk import pytree
from amk.errors import TraceError
from amk.models.llama import DecoderConfig
from amk.ops.group import RankGroup
from amk.quant import QuantizedWeight

COLUMN = {"wq": "q", "bq": "q", "wk": "kv", "bk": "kv", "wv": "kv", "bv": "kv",
          "w_gate": "ffn", "b_gate": "ffn", "w_up": "ffn", "b_up": "ffn"}
ROW = {"wo": "q", "w_down": "ffn"}
REPLICATED = {"attn_norm", "mlp_norm", "q_norm", "k_norm", "bo", "b_down"}


def check_shardable(cfg: DecoderConfig, n: int) -> None:
    """A clear error unless n ranks can each take whole heads, whole kv heads and equal slices
    of the intermediate and the vocab."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise TraceError(f"Model.shard: n must be a positive int (the number of ranks), got {n!r}")
    if type(cfg) is not DecoderConfig:
        raise TraceError(f"Model.shard: {cfg.arch} uses the {type(cfg).__name__} step; tensor "
                         f"parallelism covers the Llama-family step (DecoderConfig) only")
    sizes = {"n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads, "ffn (intermediate)": cfg.ffn,
             "vocab": cfg.vocab}
    bad = [f"{k}={v}" for k, v in sizes.items() if v % n]
    if bad:
        ok = [d for d in range(1, cfg.n_kv_heads + 1) if all(v % d == 0 for v in sizes.values())]
        raise TraceError(f"Model.shard({n}): {n} ranks do not divide {', '.join(bad)}; each rank "
                         f"needs whole heads and kv heads and an equal slice of the intermediate "
                         f"and the vocab. Rank counts that divide them all: {ok}")


def rank_config(cfg: DecoderConfig, n: int) -> DecoderConfig:
    """The config one rank's step sees: its heads, kv heads, intermediate and vocab slice."""
    check_shardable(cfg, n)
    return dataclasses.replace(cfg, n_heads=cfg.n_heads // n, n_kv_heads=cfg.n_kv_heads // n,
                               ffn=cfg.ffn // n, vocab=cfg.vocab // n)


def shard_params(params: dict, cfg: DecoderConfig, rank: int, n: int) -> dict:
    """Rank `rank`'s weights: row slices are views (no copy), column slices contiguous copies,
    replicated tensors the model's own."""
    check_shardable(cfg, n)
    width = {"q": cfg.n_heads // n * cfg.head_dim, "kv": cfg.n_kv_heads // n * cfg.head_dim,
             "ffn": cfg.ffn // n}

    def cut(path: str, t, part: str, dim: int):
        if isinstance(t, QuantizedWeight):
            raise TraceError(f"Model.shard: {path} is quantized; shard the float model, then "
                             f"quantize (quantized tensor parallelism is not supported yet)")
        w = width[part]
        return t.narrow(dim, rank * w, w).contiguous()

    layers = []
    for i, p in enumerate(params["layers"]):
        out = {}
        for k, t in p.items():
            path = f"params['layers'][{i}]['{k}']"
            if k in COLUMN:
                out[k] = cut(path, t, COLUMN[k], 0)
            elif k in ROW:
                out[k] = cut(path, t, ROW[k], 1)
            elif k in REPLICATED:
                out[k] = t
            else:
                raise TraceError(f"Model.shard: no sharding rule for {path}; known layer weights: "
                                 f"{sorted({*COLUMN, *ROW, *REPLICATED})}")
        layers.append(out)
    head = params["lm_head"]
    if isinstance(head, QuantizedWeight):
        raise TraceError("Model.shard: params['lm_head'] is quantized; shard the float model")
    v = cfg.vocab // n
    return {"embed": params["embed"], "norm": params["norm"], "inv_freq": params["inv_freq"],
            "lm_head": head.narrow(0, rank * v, v), "layers": layers}


class ShardedModel:
    """n rank-models of one Model, run together on the reference backend's rank simulator.

    step(token, pos, kv) -> (token, logits [B, V], kv): one decode step of every rank; the
    logits are the ranks' slices side by side, kv one list of per-layer caches per rank.
    order "random" (seeded) interleaves the ranks' tasks and collectives at random."""

    def __init__(self, model, n: int, order: str = "program", seed: int = 0):
        import amk
        from amk.models.tp_step import make_tp_decode_step
        self.model, self.world = model, n
        self.config = rank_config(model.config, n)
        self.params = [shard_params(model.params, model.config, r, n) for r in range(n)]
        self.fns: list[Callable] = [make_tp_decode_step(self.config, RankGroup(r, n))
                                    for r in range(n)]
        self.steps = [amk.jit(f, backend="reference", donate=("kv",)) for f in self.fns]
        self.order, self.seed = order, seed
        self.n_steps = 0

    def __repr__(self) -> str:
        c = self.config
        return (f"ShardedModel({self.world} ranks of {self.model!r}; per rank: heads "
                f"{c.n_heads}/{c.n_kv_heads}, ffn {c.ffn}, vocab {c.vocab})")

    def new_kv(self, batch: int = 1) -> list[list]:
        """Zeroed caches per rank, each holding only that rank's kv heads."""
        c, dev = self.config, self.model.device
        shape = (c.max_seq, c.n_kv_heads, c.head_dim)
        if batch != 1:
            shape = (batch, *shape)
        return [[{"k": torch.zeros(shape, dtype=c.dtype, device=dev),
                  "v": torch.zeros(shape, dtype=c.dtype, device=dev)} for _ in range(c.n_layers)]
                for _ in range(self.world)]

    def lower(self, rank: int = 0, batch: int = 1):
        """The staged object (.graph, .stages, .program) of rank `rank`'s step."""
        token = torch.zeros(batch, dtype=torch.int32, device=self.model.device)
        pos = torch.zeros(1, dtype=torch.int32, device=self.model.device)
        return self.steps[rank].lower(self.params[rank], token, pos, self.new_kv(batch)[rank])

    def step(self, token: torch.Tensor, pos: torch.Tensor, kv: list[list]):
        from amk.backends.reference.ranks import run_ranks
        if len(kv) != self.world:
            raise TraceError(f"ShardedModel.step: kv must hold one cache list per rank "
                             f"({self.world}), got {len(kv)}; use ShardedModel.new_kv()")
        lows, exes, binds = [], [], []
        for r, jitted in enumerate(self.steps):
            args = (self.params[r], token, pos, kv[r])
            lows.append(jitted.lower(*args))
            exe, b = jitted.executable(*args)
            exes.append(exe)
            binds.append(b)
        seed = self.seed + self.n_steps
        outs = run_ranks(exes, binds, self.order, seed)
        self.n_steps += 1
        results = []
        for low, out in zip(lows, outs):
            out = [o if tuple(o.shape) == v.aval.shape else o.view(v.aval.shape)
                   for o, v in zip(out, low.graph.outputs)]
            results.append(pytree.unflatten(low.out_treedef, out))
        logits = torch.cat([res[1] for res in results], dim=-1)
        return results[0][0], logits, [res[2] for res in results]

    def generate(self, input_ids, max_new_tokens: int = 32, return_logits: bool = False):
        """Greedy decode of one prompt (ids [T]), fed one position per step: the new token ids
        (and with return_logits the [1, V] logits of every generated position)."""
        ids = torch.as_tensor(input_ids, dtype=torch.int32).reshape(-1)
        c, dev = self.model.config, self.model.device
        if ids.numel() == 0 or ids.numel() + max_new_tokens > c.max_seq:
            raise TraceError(f"ShardedModel.generate: the prompt ({ids.numel()} tokens) and "
                             f"{max_new_tokens} new ones must fit max_seq={c.max_seq}, prompt >= 1")
        if bool(((ids < 0) | (ids >= c.vocab)).any()):
            raise TraceError(f"ShardedModel.generate: input_ids must lie in [0, {c.vocab})")
        kv = self.new_kv()
        new, logits_seen = [], []
        token = ids[:1].to(dev)
        for p in range(ids.numel() + max_new_tokens - 1):
            pos = torch.tensor([p], dtype=torch.int32, device=dev)
            nxt, logits, kv = self.step(token, pos, kv)
            if p + 1 < ids.numel():
                token = ids[p + 1:p + 2].to(dev)
                continue
            new.append(int(nxt[0]))
            logits_seen.append(logits)
            token = nxt
        return (new, logits_seen) if return_logits else new
