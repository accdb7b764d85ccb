"""The whole pipeline on the tiny Llama decode program: every stage validates, and the reference
VM computes what the previous stage computed: bit-identical except split-KV (an online-softmax
merge changes rounding), in program, random and queue orders. Each pass's own tests (golden
texts included) are in test_<pass>.py."""
import pytest

from pass_helpers import bindings, close, llama_program, run, run_passes, same

from amk.program.deps import dependencies
from amk.program.ir import InstructionKind as K
from amk.program.validate import validate
from amk.passes.sync import direct_dependencies, reduced_dependencies


@pytest.mark.parametrize("name", ["tile", "split_kv", "fuse", "plan_memory",
                                  "allocate_counters", "place"])
def test_every_stage_validates_and_has_deps_equal_to_program_deps(stages, name):
    p = stages[name]
    res = validate(p)
    assert res.ok, res.report()
    assert [t.id for t in p.tasks] == list(range(len(p.tasks)))
    assert direct_dependencies(p) == dependencies(p)
    # the reduction keeps a subset, and drops only edges implied through another kept edge
    full, red = dependencies(p), reduced_dependencies(p)
    for t, (d, r) in enumerate(zip(full, red)):
        assert r <= set(d)


@pytest.mark.parametrize("name,order", [("tile", "random"), ("fuse", "random"),
                                        ("plan_memory", "random"),
                                        ("allocate_counters", "random"), ("place", "queues")])
def test_stage_computes_what_lowering_computed(stages, reference, name, order):
    b, ref = reference
    before = {"tile": "lower", "fuse": "split_kv", "plan_memory": "fuse",
              "allocate_counters": "plan_memory", "place": "allocate_counters"}[name]
    prev = run(stages[before], b)
    for seed in (0, 1):
        same(run(stages[name], b, order=order, seed=seed), prev)   # bit-identical to its input
    close(run(stages[name], b), ref)


def test_batch_two_pipeline_is_exact_to_split_stage():
    p = llama_program(batch=2)
    st = run_passes(p)
    assert any(t.op is K.GEMM_TILE for t in st["tile"].tasks)
    b = bindings(p)
    ref = run(st["split_kv"], b)
    for name in ("fuse", "plan_memory", "allocate_counters"):
        assert validate(st[name]).ok
        same(run(st[name], b, order="random"), ref)
    same(run(st["place"], b, order="queues"), ref)
    close(ref, run(p, b))


def test_stats_line(stages):
    from amk.passes.stats import program_stats, stats_line
    s = program_stats(stages["place"])
    assert s["tasks"] == len(stages["place"].tasks) and s["balance"] is not None
    assert s["activation_bytes"] < program_stats(stages["fuse"])["activation_bytes"]
    line = stats_line(stages["place"])
    assert f"tasks={s['tasks']}" in line and "balance=" in line
