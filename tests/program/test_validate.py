"""validate(): hand-built programs that must pass, and one mutation per rule that must fail
with a message naming the offending task."""
import pytest

from amk.program.ir import (Buffer, BufferKind, Counter, DType, InstructionKind as K, Program,
                            Task, Wait)
from amk.program.recipe import parse_recipe
from amk.program.validate import ValidationIssue, ValidationResult, validate

ACT, IN, OUT, W, KV = (BufferKind.ACTIVATION, BufferKind.IO_INPUT, BufferKind.IO_OUTPUT,
                       BufferKind.WEIGHT, BufferKind.KV_CACHE)


class Builder:
    """Small helper to write programs by hand: every task gets its own counter unless told."""

    def __init__(self, name="test"):
        self.name = name
        self.buffers, self.counters, self.tasks = [], [], []

    def buf(self, name, shape, kind=ACT, dtype=DType.F32):
        self.buffers.append(Buffer(len(self.buffers), name, kind, dtype, tuple(shape)))
        return len(self.buffers) - 1

    def counter(self, init=0):
        self.counters.append(Counter(len(self.counters), init))
        return len(self.counters) - 1

    def task(self, op, ins, outs, params=None, waits=(), counter=None, name=""):
        c = self.counter() if counter is None else counter
        params = dict(params or {})
        if "recipe" in params:          # the typed form, as passes/fuse.py builds it
            params["recipe"] = parse_recipe(params["recipe"])
        self.tasks.append(Task(len(self.tasks), op, tuple(ins), tuple(outs), params,
                               tuple(Wait(*w) for w in waits), c, name))
        return len(self.tasks) - 1

    def build(self, queues=()):
        return Program(tuple(self.buffers), tuple(self.counters), tuple(self.tasks),
                       tuple(tuple(q) for q in queues), self.name)


def chain():
    """x -> COPY -> a -> GELU -> b -> COPY -> out."""
    p = Builder("chain")
    x, a, b, out = p.buf("x", (1, 8), IN), p.buf("a", (1, 8)), p.buf("b", (1, 8)), p.buf("out", (1, 8), OUT)
    t0 = p.task(K.COPY, [x], [a], name="copy_in")
    t1 = p.task(K.GELU, [a], [b], waits=[(t0, 1)], name="gelu")
    p.task(K.COPY, [b], [out], waits=[(t1, 1)], name="copy_out")
    return p


def diamond():
    """a = copy(x); b = gelu(a); c = a*2; out = b + c."""
    p = Builder("diamond")
    x, a, b, c, out = (p.buf("x", (1, 8), IN), p.buf("a", (1, 8)), p.buf("b", (1, 8)),
                       p.buf("c", (1, 8)), p.buf("out", (1, 8), OUT))
    t0 = p.task(K.COPY, [x], [a])
    t1 = p.task(K.GELU, [a], [b], waits=[(0, 1)])
    t2 = p.task(K.MUL, [a], [c], {"scale": 2.0}, waits=[(0, 1)])
    p.task(K.ADD, [b, c], [out], waits=[(t1, 1), (t2, 1)])
    assert t0 == 0
    return p


def tiled():
    """Two GEMV tiles share counter 0 (threshold 2); two ADD tiles each read the whole y
    column range they need; argmax waits for both ADD tiles on one shared counter."""
    p = Builder("tiled")
    x, w = p.buf("x", (1, 16), IN), p.buf("w", (32, 16), W)
    y, r, z = p.buf("y", (1, 32)), p.buf("r", (1, 32), IN), p.buf("z", (1, 32))
    ids = p.buf("ids", (1,), OUT, DType.I32)
    cy, cz = p.counter(), p.counter()
    for i in range(2):
        p.task(K.GEMV_TILE, [x, w], [y], {"n_off": 16 * i, "N_tile": 16, "K": 16}, counter=cy,
               name=f"wq[{i}/2]")
    for i in range(2):
        p.task(K.ADD, [y, r], [z], {"n_off": 16 * i, "N_tile": 16}, waits=[(cy, 2)], counter=cz,
               name=f"add[{i}/2]")
    p.task(K.SAMPLE_ARGMAX, [z], [ids], waits=[(cz, 2)], name="argmax")
    return p


def attention():
    """One decode attention: append k/v at the runtime pos, two split-KV shards per head group
    (2 head groups), then a combine per head group, into a flat output."""
    p = Builder("attention")
    hd, nh, nkv = 4, 4, 2
    pos = p.buf("pos", (1,), IN, DType.I32)
    q, k, v = p.buf("q", (1, nh * hd), IN), p.buf("k", (1, nkv * hd), IN), p.buf("v", (1, nkv * hd), IN)
    kc, vc = p.buf("k_cache", (16, nkv, hd), KV), p.buf("v_cache", (16, nkv, hd), KV)
    parts = [p.buf(f"part{s}", (1, nh * (hd + 2))) for s in range(2)]
    out = p.buf("attn", (1, nh * hd), OUT)
    ka = p.task(K.KV_APPEND, [k, pos], [kc], name="k_append")
    va = p.task(K.KV_APPEND, [v, pos], [vc], name="v_append")
    base = {"head_dim": hd, "n_heads": nh, "n_kv_heads": nkv, "scale": 0.5}
    cpart = [p.counter() for _ in range(2)]
    for g in range(2):
        for s in range(2):
            p.task(K.ATTENTION_TILE, [q, kc, vc, pos], [parts[s]],
                   {**base, "kv_start": 8 * s, "kv_len": 8, "flags": 2, "h_off": 2 * g, "h_count": 2},
                   waits=[(ka, 1), (va, 1)], counter=cpart[g], name=f"attn[g{g} s{s}]")
    cout = p.counter()
    for g in range(2):
        p.task(K.ATTENTION_COMBINE, parts, [out],
               {"head_dim": hd, "n_heads": nh, "h_off": 2 * g, "h_count": 2},
               waits=[(cpart[g], 2)], counter=cout, name=f"combine[g{g}]")
    return p


def fused():
    """A FUSED gemv tile + residual add, two tiles."""
    p = Builder("fused")
    x, w, r = p.buf("x", (1, 16), IN), p.buf("w", (32, 16), W), p.buf("r", (1, 32), IN)
    y = p.buf("y", (1, 32), OUT)
    c = p.counter()
    for i in range(2):
        tile = {"n_off": 16 * i, "N_tile": 16}
        recipe = {"steps": [
            {"op": int(K.GEMV_TILE), "args": [{"in": 0}, {"in": 1}], "out": 0,
             "params": {**tile, "K": 16}, "out_shape": [1, 32], "out_dtype": "float32"},
            {"op": int(K.ADD), "args": [{"s": 0}, {"in": 2}], "out": "final", "params": tile}]}
        p.task(K.FUSED, [x, w, r], [y], {"recipe": recipe}, counter=c, name=f"wo+res[{i}/2]")
    return p


VALID = {"chain": chain, "diamond": diamond, "tiled": tiled, "attention": attention}


def errors_of(prog, kind=None):
    res = validate(prog)
    assert isinstance(res, ValidationResult)
    return [e for e in res.errors if kind is None or e.kind == kind]


@pytest.mark.parametrize("make", list(VALID.values()), ids=list(VALID))
def test_valid_programs_pass(make):
    res = validate(make().build())
    assert res.ok, res.report()
    assert "valid" in res.report()


def test_fused_program_passes():
    pytest.importorskip("amk.backends.reference.semantics")
    res = validate(fused().build())
    assert res.ok, res.report()


def _replace_task(p, i, **kw):
    p.tasks[i] = p.tasks[i].with_(**kw)


def test_removed_waits_is_a_coverage_error():
    p = chain()
    _replace_task(p, 1, waits=())
    errs = errors_of(p.build())
    assert [(e.kind, e.task) for e in errs] == [("coverage", 1)]
    assert "t1 GELU (gelu)" in errs[0].message and "t0 COPY" in errs[0].message


def test_threshold_below_incrementers_guarantees_nothing():
    p = tiled()
    _replace_task(p, 2, waits=(Wait(0, 1),))        # add[0] waits for "one of" the gemv tiles
    errs = errors_of(p.build())
    assert errs and {e.task for e in errs} == {2}
    assert errs[0].kind == "coverage" and "t2 ADD" in errs[0].message and "b2 'y'" in errs[0].message


def test_tiles_with_the_same_waits_are_each_checked():
    """Tiles sharing their waits share their ancestors (validate checks each pair of
    ancestors and group once): each tile that is not ordered is still reported."""
    p = tiled()
    one_of = (Wait(0, 1),)
    _replace_task(p, 2, waits=one_of)
    _replace_task(p, 3, waits=one_of)
    assert sorted({e.task for e in errors_of(p.build(), "coverage")}) == [2, 3]
    _replace_task(p, 2, waits=(Wait(0, 2),))
    assert {e.task for e in errors_of(p.build())} == {3}


def test_threshold_above_reachable():
    p = tiled()
    _replace_task(p, 4, waits=(Wait(1, 3),))
    errs = errors_of(p.build(), "threshold")
    assert len(errs) == 1 and errs[0].task == 4 and errs[0].counter == 1
    assert "never reached" in errs[0].message


def test_threshold_zero_and_init_that_breaks_step_two():
    p = chain()
    _replace_task(p, 1, waits=(Wait(0, 1), Wait(2, 0)))
    p.counters[2] = Counter(2, init=1)
    p.task(K.NOP, [], [], waits=[(2, 2)])               # 1 incrementer + init 1: only step 1
    errs = errors_of(p.build(), "threshold")
    assert sorted(e.task for e in errs) == [1, 3]
    assert any(">= 1" in e.message for e in errs) and any("step 2" in e.message for e in errs)


def test_two_concurrent_writers_of_one_region():
    p = diamond()
    _replace_task(p, 2, outputs=(2,))                    # c = a*2 now writes b, like gelu does
    errs = errors_of(p.build(), "race")
    assert errs and errs[0].task == 2 and "WAW" in errs[0].message and "t1 GELU" in errs[0].message


def test_war_race_on_reused_activation():
    """`a` is reused for the third task's result, but that task does not wait for the reader."""
    p = Builder("reuse")
    x, a, b = p.buf("x", (1, 8), IN), p.buf("a", (1, 8)), p.buf("b", (1, 8), OUT)
    t0 = p.task(K.COPY, [x], [a])
    p.task(K.GELU, [a], [b], waits=[(t0, 1)])
    p.task(K.MUL, [x], [a], {"scale": 3.0}, waits=[(t0, 1)])          # should also wait on t1
    errs = errors_of(p.build())
    assert [(e.kind, e.task) for e in errs] == [("race", 2)]
    assert "WAR" in errs[0].message and "t1 GELU" in errs[0].message
    p.tasks[2] = p.tasks[2].with_(waits=(Wait(1, 1),))
    assert validate(p.build()).ok


def test_attention_reading_cache_without_waiting_for_append_is_a_race():
    p = attention()
    _replace_task(p, 2, waits=(Wait(0, 1),))             # forgot the v_append
    errs = errors_of(p.build())
    assert [(e.kind, e.task, e.buffer) for e in errs] == [("race", 2, 5)]


def test_wait_cycle_names_its_tasks():
    p = chain()
    _replace_task(p, 0, waits=(Wait(2, 1),))             # copy_in waits for copy_out
    errs = errors_of(p.build(), "cycle")
    assert len(errs) == 1
    assert "t0 -> t1 -> t2 -> t0" in errs[0].message


def test_write_to_weight():
    p = tiled()
    _replace_task(p, 0, outputs=(1,), params={"n_off": 0, "N_tile": 16, "K": 16})
    errs = errors_of(p.build(), "readonly")
    assert errs and errs[0].task == 0 and "WEIGHT" in errs[0].message


@pytest.mark.parametrize("params,needle", [
    ({"n_off": 0, "N_tile": 16, "K": 8}, "K=8"),
    ({"n_off": 24, "N_tile": 16, "K": 16}, "exceeds 32"),
    ({"n_off": 0, "N_tile": 16}, "needs int param 'K'"),
    ({"n_off": 0, "N_tile": 16, "K": 16, "qdtype": 6, "group": 4}, "quantized"),
])
def test_bad_gemv_params(params, needle):
    p = tiled()
    _replace_task(p, 1, params=params)
    errs = errors_of(p.build(), "opcode")
    assert errs and all(e.task == 1 for e in errs)
    assert any(needle in e.message for e in errs), [e.message for e in errs]


def test_quantized_gemv_shapes_and_dtypes():
    p = Builder("q")
    x, y = p.buf("x", (1, 16), IN), p.buf("y", (1, 8), OUT)
    qw = p.buf("qw", (8, 8), W, DType.U8)
    sc = p.buf("scales", (8, 2), W, DType.F16)
    p.task(K.GEMV_TILE, [x, qw, sc], [y], {"n_off": 0, "N_tile": 8, "K": 16, "qdtype": 7, "group": 8})
    assert validate(p.build()).ok
    _replace_task(p, 0, params={"n_off": 0, "N_tile": 8, "K": 16, "qdtype": 6, "group": 8})
    msgs = [e.message for e in errors_of(p.build(), "opcode")]
    assert any("dtype u8, needs i8" in m for m in msgs) and any("needs 16" in m for m in msgs)


def test_bad_attention_params():
    p = attention()
    params = dict(p.tasks[2].params, h_off=1, h_count=2)      # splits a kv group of 2 q heads
    _replace_task(p, 2, params=params)
    errs = errors_of(p.build(), "opcode")
    assert errs and errs[0].task == 2 and "kv group" in errs[0].message
    p = attention()
    _replace_task(p, 2, params=dict(p.tasks[2].params, n_kv_heads=3))
    assert any("not a multiple" in e.message for e in errors_of(p.build(), "opcode"))


def test_arity():
    p = chain()
    _replace_task(p, 1, inputs=(1, 1))
    errs = errors_of(p.build(), "opcode")
    assert errs and errs[0].task == 1 and "takes 1 inputs, got 2" in errs[0].message


def test_a_malformed_recipe_shared_by_tasks_is_reported_on_each():
    """check_opcode's messages are memoised per FUSED recipe object and operand counts: every
    task holding the recipe is still reported, and a task with other counts is checked anew."""
    pytest.importorskip("amk.backends.reference.semantics")
    p = fused()
    bad = {"steps": [{"op": int(K.ADD), "args": [{"s": 5}, {"in": 9}], "out": "final"}]}
    for i in range(2):
        _replace_task(p, i, params={"recipe": bad})
    errs = errors_of(p.build(), "opcode")
    assert {e.task for e in errs if "malformed recipe" in e.message} == {0, 1}
    p = fused()
    recipe = p.tasks[0].params["recipe"]
    _replace_task(p, 1, params={"recipe": recipe}, inputs=p.tasks[1].inputs[:2])
    errs = errors_of(p.build(), "opcode")
    assert {e.task for e in errs if "malformed recipe" in e.message} == {1}


def test_malformed_recipe():
    pytest.importorskip("amk.backends.reference.semantics")
    p = fused()
    bad = {"steps": [{"op": int(K.ADD), "args": [{"s": 5}, {"in": 9}], "out": "final"}]}
    _replace_task(p, 1, params={"recipe": bad})
    errs = errors_of(p.build(), "opcode")
    assert errs and all(e.task == 1 for e in errs) and "malformed recipe" in errs[0].message


def test_queue_not_topologically_consistent():
    prog = chain().build()
    assert validate(prog.with_(queues=((0, 1), (2,)))).ok
    errs = errors_of(prog.with_(queues=((1, 0), (2,))), "queue")
    assert len(errs) == 1 and "t0 -> t1 -> t0" in errs[0].message
    errs = errors_of(prog.with_(queues=((0, 1), (1, 2))), "queue")
    assert any("listed twice" in e.message for e in errs)
    errs = errors_of(prog.with_(queues=((0, 1),)), "queue")
    assert any("in no queue" in e.message for e in errs)


def test_queues_deadlock_across_sms():
    """SM0 runs t1 then t2, SM1 runs t3 then t0 in a diamond: t1 needs t0, queued behind t3,
    which needs t1 and t2."""
    prog = diamond().build()
    errs = errors_of(prog.with_(queues=((1, 2), (3, 0))), "queue")
    assert len(errs) == 1 and "t0" in errs[0].message and "t3" in errs[0].message


def test_ids_must_be_dense():
    p = chain()
    p.tasks[1] = p.tasks[1].with_(id=5, inputs=(1, 99))
    errs = errors_of(p.build())
    assert {e.kind for e in errs} == {"ids"}
    assert any("has id 5" in e.message for e in errs)
    assert any("buffer 99" in e.message for e in errs)


def test_program_order_must_be_legal():
    p = chain()
    p.tasks[0], p.tasks[1] = p.tasks[1].with_(id=0), p.tasks[0].with_(id=1)   # gelu first
    errs = errors_of(p.build())
    assert [(e.kind, e.task) for e in errs] == [("order", 0)]


def test_uninitialized_read():
    p = chain()
    _replace_task(p, 0, outputs=(2,))                     # nobody writes a now
    errs = errors_of(p.build(), "coverage")
    assert any(e.task == 1 and "no earlier task writes" in e.message for e in errs)


def test_report_lists_every_error():
    p = tiled()
    _replace_task(p, 4, waits=(Wait(1, 3),))
    _replace_task(p, 1, outputs=(1,), params={"n_off": 0, "N_tile": 16, "K": 16})
    res = validate(p.build())
    assert len(res.errors) >= 2
    text = res.report()
    for e in res.errors:
        assert e.message in text
    assert isinstance(res.errors[0], ValidationIssue)


def big_program(layers=2500, tiles=4, width=64):
    """layers x tiles GEMV tasks ping-ponging between two reused activation buffers."""
    p = Builder("big")
    x, w = p.buf("x", (1, width), IN), p.buf("w", (width, width), W)
    h = [p.buf("h0", (1, width)), p.buf("h1", (1, width))]
    src, prev = x, None
    nt = width // tiles
    for layer in range(layers):
        c = p.counter()
        for i in range(tiles):
            p.task(K.GEMV_TILE, [src, w], [h[layer % 2]], {"n_off": i * nt, "N_tile": nt, "K": width},
                   waits=[] if prev is None else [(prev, tiles)], counter=c, name=f"l{layer}[{i}]")
        src, prev = h[layer % 2], c
    return p


def test_ten_thousand_tasks_validate():
    prog = big_program().build()
    assert len(prog.tasks) == 10_000
    res = validate(prog)
    assert res.ok, res.report()
    # one weakened wait deep inside is still found
    p = big_program()
    _replace_task(p, 5001, waits=(Wait(p.tasks[5001].waits[0].counter, 3),))
    errs = errors_of(p.build())
    assert errs and {e.task for e in errs} == {5001}


def test_forward_waits_skip_the_walk_with_the_same_report(monkeypatch):
    """Where every wait's incrementers come before the waiter (as allocate_counters builds),
    program order stands for the topological walk, of the waits and of ascending queues: the
    reports equal the walk's, valid or not; a queue that descends, or a wait on a counter with
    a later incrementer, takes the walk."""
    import amk.program.validate as V
    p = big_program(layers=50)
    _replace_task(p, 101, waits=(Wait(p.tasks[101].waits[0].counter, 3),))   # a race
    racy = p.build()
    diamond_ = diamond().build()
    programs = [big_program(layers=50).build(), racy, chain().build().with_(queues=((0, 1), (2,))),
                chain().build().with_(queues=((1, 0), (2,))), diamond_.with_(queues=((1, 2), (3, 0))),
                diamond_.with_(queues=((0, 2), (1, 3))), tiled().build()]
    assert [V._forward(q.tasks, _incrementers(q)) for q in programs[:3]] == [True] * 3
    fast = [V._validate(q).report() for q in programs]
    monkeypatch.setattr(V, "_forward", lambda tasks, incr: False)
    assert [V._validate(q).report() for q in programs] == fast
    assert "race" in fast[1] and "per-SM deadlock" in fast[3] and "per-SM deadlock" in fast[4]


def test_a_wait_on_a_counter_with_a_later_incrementer_takes_the_walk():
    """t2 waits c0 >= 1, which t0 reaches; t3, after t2, also increments c0: not forward,
    and the walk (every incrementer before the counter) reports the queue (t2, t3)."""
    import amk.program.validate as V
    p = Builder("late")
    x, a, b, y = p.buf("x", (1, 8), IN), p.buf("a", (1, 8)), p.buf("b", (1, 8)), p.buf("y", (1, 8), OUT)
    c0, c1, c2 = p.counter(), p.counter(), p.counter()
    p.task(K.COPY, [x], [a], {}, counter=c0, name="t0")
    p.task(K.COPY, [x], [b], {}, counter=c1, name="t1")
    p.task(K.GELU, [a], [y], {}, waits=[(c0, 1)], counter=c2, name="t2")
    p.task(K.COPY, [x], [b], {}, waits=[(c1, 1)], counter=c0, name="t3")
    prog = p.build()
    assert not V._forward(prog.tasks, _incrementers(prog))
    errs = errors_of(prog.with_(queues=((0, 1), (2, 3))), "queue")
    assert len(errs) == 1 and "t2" in errs[0].message and "t3" in errs[0].message


def _incrementers(prog):
    incr = [[] for _ in prog.counters]
    for t in prog.tasks:
        incr[t.out_counter].append(t.id)
    return incr
