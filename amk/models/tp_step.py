"""One tensor-parallel rank's decode step of the Llama family, written only with `amk.ops`.

Megatron-style: the rank's params hold its column slices of q/k/v and gate/up (whole heads,
whole kv heads, a slice of the intermediate), its row slices of o and down, and its vocab
slice of the LM head (amk/models/shard.py cuts them). Attention and the SwiGLU run on the
rank's heads alone; o and down give partial sums that one all-reduce each turns into the full
residual update, and their biases are added once, after it. The LM head gives this rank's
logits slice; the greedy token is a MAXLOC all-reduce over the slices (ops.argmax with a
group). The residual stream, norms and embedding are replicated: every rank holds them whole.
"""
from __future__ import annotations

from amk import ops
from amk.models.llama import DecoderConfig, attention_block, mlp_block
from amk.ops.group import RankGroup


def _without(p: dict, key: str) -> dict:
    return {k: v for k, v in p.items() if k != key}


def tp_decode_step(cfg: DecoderConfig, group: RankGroup, params: dict, token, pos, kv: list):
    """cfg is the rank's config (its heads, kv heads, ffn and vocab slice). Returns (the global
    greedy token int32 [B], this rank's logits slice [B, V/world], the rank's new kv)."""
    inv_freq = params["inv_freq"]
    x = ops.embed(params["embed"], token)
    new_kv = []
    for p, cache in zip(params["layers"], kv):
        a, cache = attention_block(cfg, _without(p, "bo"), x, pos, inv_freq, cache)
        a = ops.allreduce(a, group)
        if "bo" in p:
            a = ops.add(a, p["bo"])
        x = ops.add(x, a)
        m = ops.allreduce(mlp_block(cfg, _without(p, "b_down"), x), group)
        if "b_down" in p:
            m = ops.add(m, p["b_down"])
        x = ops.add(x, m)
        new_kv.append(cache)
    x = ops.rmsnorm(x, params["norm"], cfg.rms_eps)
    logits = ops.linear(x, params["lm_head"])
    return ops.argmax(logits, group), logits, new_kv


def make_tp_decode_step(cfg: DecoderConfig, group: RankGroup):
    """`tp_decode_step` with the rank's config and group bound: fn(params, token, pos, kv)."""

    def tp_step(params, token, pos, kv):
        return tp_decode_step(cfg, group, params, token, pos, kv)

    tp_step.__qualname__ = f"{cfg.arch}_tp{group.world}_rank{group.rank}_decode_step"
    tp_step.__name__ = tp_step.__qualname__
    return tp_step
