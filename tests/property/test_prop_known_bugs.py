"""Bugs the property suite found in code it does not own, each as its minimal example.

Each test asserts the correct behaviour and is xfail(strict=True): when the bug is fixed the
test passes, strict xfail turns that into a failure, and whoever fixed it deletes the marker (and,
for the first two, the exclusion in test_prop_pipeline.py / the donate=True there)."""
from __future__ import annotations

import pytest
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


@pytest.mark.xfail(strict=True, reason=(
    "lower.py: a NON-donated kv_update lowers to COPY(cache -> IO_OUTPUT v) then KV_APPEND(-> v); "
    "validate rejects it: KV_APPEND's output must be KV_CACHE, and KV_APPEND does not wait on "
    "the COPY (lower's _Builder.task only waits on writers of the inputs, never on the previous "
    "writer of an output: WAW race)"))
def test_non_donated_kv_update_lowers_to_a_valid_program():
    lowered_validates_and_matches(tiny([Block("attention", (LinearSpec(),) * 4)], donate=()))


@pytest.mark.xfail(strict=True, reason=(
    "lower.py/validate.py: reshape is free (the output shares the input's buffer, keeping the "
    "first producer's shape), so x[1,8] -> reshape [2,4] -> rmsnorm -> reshape [1,8] -> linear "
    "gives a GEMV whose x buffer is [2,4]; validate: 'x b4 has 4 columns, K=8'"))
def test_a_linear_after_a_reshape_lowers_to_a_valid_program():
    lowered_validates_and_matches(tiny([Block("reshape_norm"), Block("linear", (LinearSpec(),))]))


@pytest.mark.xfail(strict=True, reason=(
    "validate.py: coverage is checked only for regions some task READS; a program output "
    "(IO_OUTPUT) column that no task writes is accepted, and every backend returns garbage "
    "(the VM: zeros) there. E.g. a GEMV tiled [0,4) + [5,8) of an 8-column output validates"))
def test_validate_rejects_a_program_output_column_nobody_writes():
    prog = lower(trace_case(tiny([Block("linear", (LinearSpec(),))])))
    (t,) = [t for t in prog.tasks if t.op is K.GEMV_TILE]
    short = t.with_(params={**t.params, "N_tile": t.params["N_tile"] - 1})
    prog = prog.with_(tasks=tuple(short if u.id == t.id else u for u in prog.tasks))
    assert not amk.validate(prog).ok, "column 7 of the program output is never written"
