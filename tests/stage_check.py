"""Shared check: every pipeline stage of a model's decode step, run on the reference VM, gives
bit-identical outputs to direct graph interpretation (f32 models, where tiling and fusion keep
each column's accumulation order)."""
import torch

import amk
from amk import pytree
from amk.backends.reference.interp import interpret
from amk.backends.reference.vm import ReferenceVM

I32 = torch.int32


def model_bindings(args):
    out = {}
    for name, val in zip(("params", "token", "pos", "kv"), args):
        leaves, paths, _ = pytree.flatten(val, name)
        out.update(zip(paths, leaves))
    return out


def args_with_history(m, pos=3, token=5):
    """The model's example args with random history in the cache and a non-zero position."""
    params, _, _, kv = m.example_args()
    g = torch.Generator().manual_seed(pos)
    for layer in kv:
        layer["k"].copy_(torch.randn(layer["k"].shape, generator=g))
        layer["v"].copy_(torch.randn(layer["v"].shape, generator=g))
    return params, torch.tensor([token], dtype=I32), torch.tensor([pos], dtype=I32), kv


def clone_args(args):
    params, token, pos, kv = args
    return params, token.clone(), pos.clone(), [{k: v.clone() for k, v in l.items()} for l in kv]


def assert_every_stage_matches_graph(m, low=None):
    low = low or m.lower(backend="reference")
    base = args_with_history(m)
    want = interpret(low.graph, model_bindings(clone_args(base)))
    for name, prog in low.programs.items():
        assert amk.validate(prog).ok, name
        got = ReferenceVM(prog).run(model_bindings(clone_args(base)))
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert torch.equal(g.view(w.shape), w), f"stage {name} differs from the graph"
    return low
