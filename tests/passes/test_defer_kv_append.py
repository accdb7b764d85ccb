"""defer_kv_append: the attention reads the step's new K/V rows (NEW_KV) and the cache appends
run after it. Same results bit for bit (reference VM, every order), the attention no longer
depends on the appends, and the pass leaves alone what it cannot prove safe."""
import pytest
import torch

from pass_helpers import OPTS, bindings, golden, llama_program, run, run_passes

from small_programs import TWO_SMS, attention_program

from amk.testing import cuda_examples as examples
from amk.backends.reference.semantics_attention import attention_tile
from amk.passes.defer_kv_append import defer_kv_append
from amk.program.deps import dependencies
from amk.program.ir import BufferKind as BK, DType, InstructionKind as K
from amk.program.regions import NEW_KV
from amk.program.validate import validate

DEFER = OPTS.with_(defer_kv_append=True)
GOLDEN = """
tasks:
  t0 ATTENTION_TILE in=(b0,b4,b5,b3,b1,b2) out=(b6) waits=() -> c0 {"head_dim": 4, "n_heads": 2, "n_kv_heads": 1, "scale": 0.5, "kv_start": 0, "kv_len": 8, "flags": 4} # attention @ small_programs.py:N
  t1 KV_APPEND in=(b1,b3) out=(b4) waits=(c0>=1) -> c1 {} # kv_update @ small_programs.py:N
  t2 KV_APPEND in=(b2,b3) out=(b5) waits=(c0>=1) -> c2 {} # kv_update @ small_programs.py:N
"""


def test_defer_kv_append_golden_text():
    # the attention reads the new rows (flags 4 = NEW_KV, inputs + new.k, new.v) at once; the
    # appends wait for it, since it reads the rows they overwrite
    golden(defer_kv_append(attention_program(), TWO_SMS.with_(defer_kv_append=True)),
           GOLDEN, start="tasks:")


@pytest.fixture(scope="module")
def both():
    prog = llama_program()
    return run_passes(prog, OPTS), run_passes(prog, DEFER)


def test_the_attention_reads_the_new_rows_and_the_appends_follow_it(both):
    _, deferred = both
    p = deferred["defer_kv_append"]
    assert validate(p).ok
    ops = [t.op for t in p.tasks]
    attn = [i for i, op in enumerate(ops) if op is K.ATTENTION_TILE]
    appends = [i for i, op in enumerate(ops) if op is K.KV_APPEND]
    assert len(attn) == 2 and len(appends) == 4                  # two layers, k and v each
    for layer, a in enumerate(attn):
        t = p.tasks[a]
        assert int(t.params["flags"]) & NEW_KV and len(t.inputs) == 6
        mine = appends[2 * layer:2 * layer + 2]
        assert all(a < i for i in mine)
        assert {p.tasks[i].inputs[0] for i in mine} == set(t.inputs[4:6])
        deps = dependencies(p)
        assert not set(mine) & set(deps[a])                      # no longer waits for them
        assert all(a in deps[i] for i in mine)                   # they wait for it (WAR)


@pytest.mark.parametrize("pos", [0, 5, 7, 15])
def test_every_deferred_stage_computes_what_the_plain_one_does(both, pos):
    plain, deferred = both
    b = bindings(plain["lower"], pos=pos)
    for name in ("defer_kv_append", "split_kv", "fuse", "place"):
        want = run(plain[name], b)
        assert validate(deferred[name]).ok, name
        for order, seed in (("program", 0), ("random", 1), ("random", 2)):
            got = run(deferred[name], b, order=order, seed=seed)
            for g, w in zip(got, want):                          # outputs and both caches
                assert torch.equal(g, w), (name, order)


def test_new_kv_attention_equals_append_then_attend():
    case = next(c for c in examples.cases() if c.name == "attention_new_kv_bf16")
    t = case.program.tasks[0]
    x = case.bindings()
    params = dict(t.params)
    pos = int(x["pos"])
    out_new = torch.empty(8, 66)
    attention_tile([x["q"], x["k"], x["v"], x["pos"], x["k_new"], x["v_new"]], [out_new], params, None)
    k, v = x["k"].clone(), x["v"].clone()
    k[pos], v[pos] = x["k_new"].view(2, 64).to(k.dtype), x["v_new"].view(2, 64).to(v.dtype)
    out_old = torch.empty(8, 66)
    attention_tile([x["q"], k, v, x["pos"]], [out_old], {**params, "flags": 2}, None)
    assert torch.equal(out_new, out_old)
    stale = torch.empty(8, 66)                                   # the new row does matter
    attention_tile([x["q"], x["k"], x["v"], x["pos"]], [stale], {**params, "flags": 2}, None)
    assert not torch.equal(stale, out_old)


def _appends_then_attention(reader_between: bool, seed_pos: bool = False):
    b = examples.Builder("appends")
    hd, nh, nkv, S = 8, 4, 2, 16
    q = b.buf("q", BK.IO_INPUT, DType.F32, (1, nh * hd))
    kn = b.buf("k_new", BK.IO_INPUT, DType.F32, (1, nkv * hd))
    vn = b.buf("v_new", BK.IO_INPUT, DType.F32, (1, nkv * hd))
    pos = b.buf("pos", BK.IO_INPUT, DType.I32, (1,))
    kc = b.buf("k", BK.KV_CACHE, DType.F32, (S, nkv, hd))
    vc = b.buf("v", BK.KV_CACHE, DType.F32, (S, nkv, hd))
    y = b.buf("y", BK.IO_OUTPUT, DType.F32, (1, nh * hd))
    extra = {"pos": 3} if seed_pos else {}
    ck = b.task(K.KV_APPEND, [kn, pos], [kc], extra)       # params pos: the seed's static one
    cv = b.task(K.KV_APPEND, [vn, pos], [vc], extra)
    waits = [(ck, 1), (cv, 1)]
    if reader_between:
        snap = b.buf("snap", BK.IO_OUTPUT, DType.F32, (S, nkv, hd))
        waits.append((b.task(K.COPY, [kc], [snap], {}, waits=[(ck, 1)]), 1))
    b.task(K.ATTENTION_TILE, [q, kc, vc, pos], [y], {"head_dim": hd, "n_heads": nh, "n_kv_heads": nkv},
           waits=waits)
    b.outputs = [y]
    return b.program()


@pytest.mark.parametrize("reader_between, seed_pos", [(True, False), (False, True)])
def test_a_cache_read_in_between_or_a_static_pos_leaves_the_program_alone(reader_between, seed_pos):
    prog = _appends_then_attention(reader_between, seed_pos)
    assert validate(prog).ok
    assert defer_kv_append(prog, DEFER) is prog


def test_the_plain_case_is_deferred():
    prog = _appends_then_attention(False)
    out = defer_kv_append(prog, DEFER)
    assert [t.op for t in out.tasks] == [K.ATTENTION_TILE, K.KV_APPEND, K.KV_APPEND]
    assert validate(out).ok


def test_the_patched_waits_are_the_ones_resync_computes(both):
    """The pass moves the appends and patches the waits of the edges it moved instead of
    rescanning every task's data: the result is what resync's scan gives."""
    from amk.passes.sync import resync
    _, deferred = both
    p = deferred["defer_kv_append"]
    ref = resync(p)
    assert [(t.waits, t.out_counter) for t in p.tasks] == \
        [(t.waits, t.out_counter) for t in ref.tasks]
    assert p.counters == ref.counters


def test_a_wait_the_patch_cannot_move_falls_back_to_resync():
    """A task before an append's new place that waits for the append (none in a decoder; a
    hand-written program could) makes the patch give up; the pass then resyncs."""
    from amk.passes import defer_kv_append as pass_
    from amk.program.ir import Task, Wait
    t = lambda i, c, waits=(): Task(i, K.COPY, (), (), {}, waits, c)       # noqa: E731
    tasks = [t(0, 0), t(1, 1, (Wait(0, 1),)), t(2, 2)]   # 0 an append that moves after 2
    assert pass_._patched_waits(tasks, {0: 2}, {0: [2]}, 3) is None
    assert pass_._patched_waits(tasks[:1] + [t(1, 1)] + tasks[2:], {0: 2}, {0: [2]}, 3) is not None
