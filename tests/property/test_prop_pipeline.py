"""Properties of the pass pipeline over random decode steps and random pass options:
every stage validates, computes what the graph computes, does not depend on the interleaving,
and prints as text that parses back to the same program."""
from __future__ import annotations

import torch
from hypothesis import given, note
from hypothesis import strategies as st

from amk.passes import pipeline
from amk.program.text import parse_program, program_to_json, program_from_json, program_to_text
from amk.testing import (BLOCKS, decode_steps, fusable_chains, interpret_case, outputs_differ,
                         pass_options, run_vm, trace_case)

import prop_support as ps

steps = decode_steps(kinds=BLOCKS)          # donated and non-donated caches alike


@given(case=steps, opts=pass_options())
def test_every_stage_validates_and_matches_the_graph(case, opts):
    ps.note_case(case, opts)
    graph = trace_case(case)
    note(f"graph:\n{graph}")
    stages = pipeline.run_pipeline(graph, opts)
    assert list(stages) == [name for name, _ in pipeline.PIPELINE][:len(stages)]
    ps.size_event(stages["lower"])
    want = interpret_case(graph, case)
    exact = case.plan.dims.dtype == torch.float32
    results = ps.check_stages(case, stages, want, exact)
    # the plain lowering is the graph's own semantics, op for op: bitwise in every dtype
    diff = outputs_differ(results["lower"], want, exact=True)
    assert diff is None, f"lowering differs from direct graph interpretation: {diff}"


@given(case=fusable_chains(), opts=pass_options())
def test_fusable_chains_match_the_graph(case, opts):
    ps.note_case(case, opts)
    graph = trace_case(case)
    stages = pipeline.run_pipeline(graph, opts)
    ps.check_stages(case, stages, interpret_case(graph, case),
                    case.plan.dims.dtype == torch.float32)


@given(case=steps, opts=pass_options(), data=st.data(),
       seeds=st.tuples(st.integers(0, 2 ** 31), st.integers(0, 2 ** 31)))
def test_any_two_interleavings_agree_bitwise(case, opts, data, seeds):
    ps.note_case(case, opts)
    stages, _ = ps.final_stage(case, opts)
    final = next(reversed(stages))
    some = data.draw(st.sampled_from(list(stages)), label="stage")   # and always the final one
    for name, prog in stages.items():
        if name not in (some, final):
            continue
        ps.note_program(name, prog)
        base = run_vm(prog, case, order="program")
        for s in seeds:
            diff = outputs_differ(run_vm(prog, case, order="random", seed=s), base, exact=True)
            assert diff is None, f"stage '{name}', random order seed {s}: {diff}"
        if prog.queues:
            diff = outputs_differ(run_vm(prog, case, order="queues"), base, exact=True)
            assert diff is None, f"stage '{name}', per-SM queue order: {diff}"


@given(case=steps, opts=pass_options())
def test_text_and_json_round_trip(case, opts):
    ps.note_case(case, opts)
    stages, _ = ps.final_stage(case, opts)
    for name, prog in stages.items():
        text = program_to_text(prog)
        note(f"--- {name} ---\n{text}")
        back = parse_program(text)
        assert back == prog, f"stage '{name}': parse_program(program_to_text(p)) != p"
        assert program_to_text(back) == text
        assert program_from_json(program_to_json(prog)) == prog, f"stage '{name}': JSON round trip"
