"""Bugs the property suite found, each kept as its minimal example (all fixed): a non-donated
kv_update (copy, then append in place), a linear after a reshape, and a program output column
that no task writes (now a validation error)."""
from __future__ import annotations

import torch

import amk
from amk.passes.lower import lower
from amk.program.ir import InstructionKind as K
from amk.testing import interpret_case, outputs_differ, run_vm, trace_case
from amk.testing.strategies import Block, Dims, LinearSpec, Plan, build_case


def tiny(blocks, donate=("kv",), batch=1):
    d = Dims(batch=batch, dtype=torch.float32, hidden=8, head_dim=4, n_kv_heads=1, n_heads=1,
             ffn=16, vocab=16, max_seq=4, pos=1, cache_4d=False)
    return build_case(Plan(d, embed=False, layers=(tuple(blocks),), tied_layers=False,
                           tail="none", seed=0), donate)


def lowered_validates_and_matches(case):
    graph = trace_case(case)
    prog = lower(graph)
    res = amk.validate(prog)
    assert res.ok, res.report()
    assert outputs_differ(run_vm(prog, case), interpret_case(graph, case), exact=True) is None


def test_non_donated_kv_update_lowers_to_a_valid_program():
    lowered_validates_and_matches(tiny([Block("attention", (LinearSpec(),) * 4)], donate=()))


def test_a_linear_after_a_reshape_lowers_to_a_valid_program():
    lowered_validates_and_matches(tiny([Block("reshape_norm"), Block("linear", (LinearSpec(),))]))


def test_validate_rejects_a_program_output_column_nobody_writes():
    prog = lower(trace_case(tiny([Block("linear", (LinearSpec(),))])))
    (t,) = [t for t in prog.tasks if t.op is K.GEMV_TILE]
    short = t.with_(params={**t.params, "N_tile": t.params["N_tile"] - 1})
    prog = prog.with_(tasks=tuple(short if u.id == t.id else u for u in prog.tasks))
    assert not amk.validate(prog).ok, "column 7 of the program output is never written"
