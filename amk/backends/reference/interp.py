"""Direct graph interpretation: evaluate the traced equations one by one with the reference
semantics, no program, no counters. The baseline every compiled stage must reproduce."""
from __future__ import annotations

from typing import Mapping

import torch

from amk.graph import Graph
from amk.passes.lower import LOWERING, operand_order
from amk.program.ir import InstructionKind as K


def interpret(graph: Graph, bindings: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    from amk.backends.reference.semantics_common import flush_subnormals
    with flush_subnormals():       # the same arithmetic as the VM
        return _interpret(graph, bindings)


def _interpret(graph: Graph, bindings: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    from amk.backends.reference.semantics import RefCtx, semantics_for
    env: dict[int, torch.Tensor] = {v.id: bindings[p] for v, p in zip(graph.inputs, graph.input_paths)}
    ctx = RefCtx()
    for e in graph.eqns:
        out = e.outputs[0]
        if e.prim == "reshape":
            env[out.id] = env[e.inputs[0].id].reshape(out.aval.shape)
            continue
        if e.prim == "kv_update":
            cache, new, pos = (env[v.id] for v in e.inputs)
            semantics_for(K.KV_APPEND)([new, pos], [cache], {}, ctx)   # in place, like a donated cache
            env[out.id] = cache
            continue
        op, params = LOWERING[e.prim](e, list(e.inputs))
        ins = [env[v.id] for v in operand_order(e)]
        dev = ins[0].device
        y = torch.empty(out.aval.shape, dtype=out.aval.dtype.torch, device=dev)
        semantics_for(op)(ins, [y], params, ctx)
        env[out.id] = y
    return [env[v.id] for v in graph.outputs]
