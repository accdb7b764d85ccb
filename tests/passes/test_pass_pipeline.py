"""Each pass on the tiny Llama decode program: golden text (FileCheck style), validate accepts it,
and the reference VM computes what the previous stage computed: bit-identical except split-KV
(an online-softmax merge changes rounding), in program, random and queue orders."""
import pytest
import torch

from pass_helpers import OPTS, SMALL, bindings, check_lines, llama_program, run, run_passes, text

from amk.passes.options import PassOptions
from amk.program.deps import dependencies
from amk.program.ir import BufferKind, InstructionKind as K
from amk.program.regions import task_regions
from amk.program.validate import validate
from amk.passes.sync import direct_dependencies, reduced_dependencies


@pytest.fixture(scope="module")
def stages():
    return run_passes(llama_program())


@pytest.fixture(scope="module")
def reference(stages):
    b = bindings(stages["lower"])
    return b, run(stages["lower"], b)


def same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y), (x - y).abs().max() if x.is_floating_point() else (x, y)


def close(a, b):
    for x, y in zip(a, b):
        if x.is_floating_point():
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(x, y)


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


def test_split_kv_matches_unsplit_attention_closely(stages, reference):
    b, ref = reference
    close(run(stages["split_kv"], b, order="random"), ref)
    for pos in (0, 7, 15):                 # empty shards (pos=0), shard edges, a full cache
        bb = bindings(stages["lower"], pos=pos)
        close(run(stages["split_kv"], bb), run(stages["lower"], bb))


def test_tile_text(stages):
    t = text(stages["tile"])
    # wq [32,32] in two 16-column tiles sharing one counter; the rmsnorm before them waits once
    check_lines(t, [r"RMSNORM .* -> c(\d+)",
                    r'GEMV_TILE in=\(b\d+,b5\) .*waits=\(c\d+>=1\) -> c(\d+) .*"n_off": 0, "N_tile": 16',
                    r'GEMV_TILE in=\(b\d+,b5\) .*"n_off": 16, "N_tile": 16',
                    r'ROPE .*waits=\(c\d+>=2\).*"n_off": 0, "N_tile": 16',   # rope per kv group
                    r'ROPE .*"n_off": 16, "N_tile": 16',
                    r"SILU_MUL .*waits=\(c\d+>=4,c\d+>=4\).*\"n_off\": 48"])
    lo = stages["lower"]
    assert len(stages["tile"].tasks) > len(lo.tasks)


def test_tile_width_from_options():
    p = llama_program()
    wide = run_passes(p, PassOptions(target=SMALL, tile_n=64), upto="tile")["tile"]
    gate = [t for t in wide.tasks if t.op is K.GEMV_TILE and "w_gate" in t.name]
    assert [t.params["N_tile"] for t in gate] == [64, 64]          # 64 wide: one tile per layer
    narrow = run_passes(p, PassOptions(target=SMALL, tile_n=16), upto="tile")["tile"]
    gate = [t for t in narrow.tasks if t.op is K.GEMV_TILE and "layers.0.w_gate" in t.name]
    assert [(t.params["n_off"], t.params["N_tile"]) for t in gate] == [(0, 16), (16, 16),
                                                                         (32, 16), (48, 16)]


def test_split_kv_text(stages):
    t = text(stages["split_kv"])
    check_lines(t, [r"b\d+ v\d+\.part0 activation f32\[1,40\]",          # 4 heads x (8+2)
                    # every shard spans the cache; kv_shard picks its piece of the live window
                    r'ATTENTION_TILE .*"kv_start": 0, "kv_len": 16, "flags": 2, "h_off": 0, "h_count": 2, "kv_shard": 0, "kv_shards": 3',
                    r'ATTENTION_TILE .*"kv_start": 0, "kv_len": 16, "flags": 2, "h_off": 0, "h_count": 2, "kv_shard": 2, "kv_shards": 3',
                    r'ATTENTION_TILE .*"kv_start": 0, "kv_len": 16, "flags": 2, "h_off": 2, "h_count": 2, "kv_shard": 2, "kv_shards": 3',
                    r'ATTENTION_COMBINE in=\(b\d+,b\d+,b\d+\) .*"h_off": 0, "h_count": 2',
                    r'ATTENTION_COMBINE .*"h_off": 2, "h_count": 2'])


def test_split_kv_one_shard_keeps_exact_per_group_tasks():
    p = llama_program()
    one = run_passes(p, PassOptions(target=SMALL, attn_splits=1), upto="split_kv")["split_kv"]
    att = [t for t in one.tasks if t.op is K.ATTENTION_TILE]
    assert len(att) == 4 and all(t.params["flags"] == 0 for t in att)
    assert not any(t.op is K.ATTENTION_COMBINE for t in one.tasks)
    b = bindings(p)
    same(run(one, b, order="random"), run(p, b))


def test_fuse_text_and_dropped_buffers(stages):
    f = stages["fuse"]
    t = text(f)
    check_lines(t, [r"FUSED .*# rope.*\[tile 0/2\] \+rmsnorm\+gemv_tile",  # norm -> q tile -> rope
                    r"FUSED .*kv_update.*\+rmsnorm\+gemv_tile\+rope",  # k: one tile + rope + append
                    r"FUSED .*# add .*\[tile 0/2\] \+gemv_tile",         # o tile + residual
                    r"FUSED .*# silu_mul .*\[tile 3/4\]",                # norm + gate + up + silu
                    r"FUSED .*# add .*\+gemv_tile",                      # down tile + residual
                    r"FUSED .*lm_head.*\+rmsnorm", r"SAMPLE_ARGMAX"])
    assert not any(t.op in (K.RMSNORM, K.GEMV_TILE, K.SILU_MUL, K.ADD, K.ROPE) for t in f.tasks)
    # every buffer is used, ids are dense, intermediates kept their dtypes in the recipes
    used = {b for t in f.tasks for b in t.inputs + t.outputs} | set(f.outputs)
    assert [b.id for b in f.buffers] == list(range(len(f.buffers)))
    assert all(b.id in used for b in f.buffers if b.kind is BufferKind.ACTIVATION)
    silu = next(t for t in f.tasks if "silu_mul" in t.name)
    steps = silu.params["recipe"]["steps"]
    assert [K(s["op"]) for s in steps] == [K.RMSNORM, K.GEMV_TILE, K.GEMV_TILE, K.SILU_MUL]
    assert steps[0]["out_dtype"] == "float32" and steps[0]["out_shape"] == [1, 32]


def test_fused_regions_kept_by_fuse_equal_task_regions(stages):
    from amk.passes.sync import regions_of
    f = stages["fuse"]
    for t in f.tasks:
        assert regions_of(t, f.buffers) == task_regions(t, f.buffers)


def test_fuse_off_and_rule_subset():
    p = run_passes(llama_program(), OPTS, upto="split_kv")["split_kv"]
    from amk.passes.fuse import fuse
    assert fuse(p, OPTS.with_(fuse=False)) is p
    only_norm = fuse(p, OPTS.with_(fuse_rules=(("RMSNORM", "GEMV_TILE"),)))
    ops = {t.op for t in only_norm.tasks}
    assert K.RMSNORM not in ops and K.ADD in ops and K.SILU_MUL in ops and K.FUSED in ops
    b = bindings(p)
    same(run(only_norm, b, order="random"), run(p, b))


def test_plan_memory_reuses_activations(stages):
    before, after = stages["fuse"], stages["plan_memory"]
    acts = lambda p: [b for b in p.buffers if b.kind is BufferKind.ACTIVATION]  # noqa: E731
    assert len(acts(after)) < len(acts(before))
    assert sum(b.nbytes for b in acts(after)) < sum(b.nbytes for b in acts(before))
    # plan_memory keeps the tasks: map each old output buffer to its new one; some new buffer
    # holds several old values (reuse), and only same-shape, same-dtype values share
    merged = {}
    for t0, t1 in zip(before.tasks, after.tasks):
        for b0, b1 in zip(t0.outputs, t1.outputs):
            merged.setdefault(b1, set()).add(b0)
    assert any(len(v) > 1 for v in merged.values())
    for b1, olds in merged.items():
        assert {(before.buffers[b].shape, before.buffers[b].dtype) for b in olds} == \
            {(after.buffers[b1].shape, after.buffers[b1].dtype)}


def test_allocate_counters_fine_grained(stages):
    p = stages["allocate_counters"]
    assert len(p.counters) < len(p.tasks)
    by_counter = {}
    for t in p.tasks:
        by_counter.setdefault(t.out_counter, []).append(t)
    for t in p.tasks:
        for w in t.waits:        # a wait is for a whole group of earlier tasks
            members = by_counter[w.counter]
            assert w.threshold == len(members) and all(m.id < t.id for m in members)
    # the attention shards of kv group g wait for the q tile of its heads only, not all of q
    shards = [t for t in p.tasks if t.op is K.ATTENTION_TILE][:6]
    for s in shards:
        waited = [m for w in s.waits for m in by_counter[w.counter]]
        q_tiles = [m for m in waited if s.inputs[0] in m.outputs]     # writers of its q
        assert len(q_tiles) == 1
        rope = q_tiles[0].params["recipe"]["steps"][-1]
        assert K(rope["op"]) is K.ROPE and rope["params"]["n_off"] == s.params["h_off"] * 8


def test_place_queues(stages):
    from amk.passes.place import placement_balance
    p = stages["place"]
    assert len(p.queues) == SMALL.num_sms
    flat = sorted(i for q in p.queues for i in q)
    assert flat == list(range(len(p.tasks)))
    assert all(list(q) == sorted(q) for q in p.queues)
    assert 1.0 <= placement_balance(p) < 1.5


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
