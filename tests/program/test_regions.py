"""task_regions per opcode, overlaps, and dependencies() on hand-built programs."""
from amk.program.deps import RAW, WAR, WAW, dependencies, scan
from amk.program.ir import BufferKind, DType, InstructionKind as K
from amk.program.regions import Region, overlaps, task_regions

from test_validate import Builder, attention, big_program, fused, tiled

IN, OUT, W, KV = BufferKind.IO_INPUT, BufferKind.IO_OUTPUT, BufferKind.WEIGHT, BufferKind.KV_CACHE


def regions_of(p, i):
    prog = p.build()
    return task_regions(prog.tasks[i], prog.buffers)


def test_overlaps():
    assert overlaps(Region(1, 0, 8), Region(1, 7, 9))
    assert not overlaps(Region(1, 0, 8), Region(1, 8, 9))      # half-open: touching is disjoint
    assert not overlaps(Region(1, 0, 8), Region(2, 0, 8))
    assert overlaps(Region(3, 2, 3), Region(3, 0, 16))
    assert str(Region(3, 2, 5)) == "b3[2:5]"
    assert not overlaps(Region(1, 0, 8, 0, 1), Region(1, 0, 8, 1, 2))   # other rows
    assert overlaps(Region(1, 0, 8, 1, 2), Region(1, 4, 5))             # every row holds row 1
    assert str(Region(3, 2, 5, 1, 2)) == "b3[rows 1:2, 2:5]"


def batch_rows(seqs_of_task=((0, 1), (1, 1), (2, 1)), wait_all=True):
    """Three sequences' attention tasks, each writing its rows of y [3, 8] (2 heads of 4),
    then an o-like GEMV reading y whole."""
    p = Builder("rows")
    hd, nh = 4, 2
    q = p.buf("q", (3, nh * hd), IN)
    kc, vc = p.buf("k", (3, 16, 1, hd), KV), p.buf("v", (3, 16, 1, hd), KV)
    y, w, o = p.buf("y", (3, nh * hd)), p.buf("w", (8, nh * hd), W), p.buf("o", (3, 8), OUT)
    c = p.counter()
    for b0, n in seqs_of_task:
        p.task(K.ATTENTION_TILE, [q, kc, vc], [y], {"head_dim": hd, "n_heads": nh, "n_kv_heads": 1,
               "b_off": b0, "b_count": n}, counter=c, name=f"attn[seq {b0}]")
    waits = [(c, len(seqs_of_task))] if wait_all else []
    p.task(K.GEMV_TILE, [y, w], [o], {"K": nh * hd, "n_off": 0, "N_tile": 8}, waits=waits,
           name="o")
    return p


def test_a_batched_attention_writes_its_rows_and_only_they_order_it():
    p = batch_rows()
    assert regions_of(p, 1)[1] == [Region(3, 0, 8, 1, 2)]
    # tasks of other sequences are independent; the reader of y whole follows all three
    assert dependencies(p.build()) == [(), (), (), (0, 1, 2)]


def test_gemv_tile_reads_x_and_weights_whole_writes_its_columns():
    p = tiled()
    assert regions_of(p, 1) == ([Region(0, 0, 16), Region(1, 0, 16)], [Region(2, 16, 32)])


def test_tiled_elementwise_reads_same_width_columns_only():
    p = tiled()
    assert regions_of(p, 3) == ([Region(2, 16, 32), Region(3, 16, 32)], [Region(4, 16, 32)])
    q = Builder()
    a, s, y = q.buf("a", (2, 8)), q.buf("s", (1, 1), IN), q.buf("y", (2, 8))
    q.task(K.MUL, [a, s], [y], {"n_off": 2, "N_tile": 4})        # s is narrower: whole
    assert regions_of(q, 0) == ([Region(0, 2, 6), Region(1, 0, 1)], [Region(2, 2, 6)])
    q.task(K.ADD, [a, a], [y], {"n_off": 4})                     # N_tile defaults to the rest
    assert regions_of(q, 1) == ([Region(0, 4, 8)], [Region(2, 4, 8)])


def test_untiled_ops_touch_whole_buffers():
    q = Builder()
    x, w, y = q.buf("x", (1, 8)), q.buf("w", (8,), W), q.buf("y", (1, 8))
    q.task(K.RMSNORM, [x, w], [y], {"eps": 1e-6})
    assert regions_of(q, 0) == ([Region(0, 0, 8), Region(1, 0, 8)], [Region(2, 0, 8)])


def test_attention_tile_head_range_and_partial_rows():
    p = attention()       # hd=4, 4 q heads, partial rows of 6; tile 4 = group 1 shard 0
    reads, writes = regions_of(p, 4)
    assert reads == [Region(0, 0, 1), Region(1, 8, 16), Region(4, 0, 4), Region(5, 0, 4)]
    assert writes == [Region(6, 12, 24)]
    # the combine of head group 1 reads both partials' rows of those heads, writes its heads
    reads, writes = regions_of(p, 7)
    assert reads == [Region(6, 12, 24), Region(7, 12, 24)]
    assert writes == [Region(8, 8, 16)]


def test_attention_tile_normal_output_and_non_flat_views():
    q = Builder()
    qb = q.buf("q", (1, 16))
    kc, vc = q.buf("k", (8, 2, 4), KV), q.buf("v", (8, 2, 4), KV)
    out = q.buf("o", (1, 16))
    q2d, out2d = q.buf("q2", (4, 4)), q.buf("o2", (4, 4))
    base = {"head_dim": 4, "n_heads": 4, "n_kv_heads": 2, "h_off": 2, "h_count": 2}
    q.task(K.ATTENTION_TILE, [qb, kc, vc], [out], base)
    assert regions_of(q, 0) == ([Region(0, 8, 16), Region(1, 0, 4), Region(2, 0, 4)],
                                [Region(3, 8, 16)])
    q.task(K.ATTENTION_TILE, [q2d, kc, vc], [out2d], base)        # not flat: whole buffers
    assert regions_of(q, 1) == ([Region(1, 0, 4), Region(2, 0, 4), Region(4, 0, 4)],
                                [Region(5, 0, 4)])
    q.task(K.ATTENTION_TILE, [qb, kc, vc], [out], {"head_dim": 4, "n_heads": 4, "n_kv_heads": 2})
    assert regions_of(q, 2)[1] == [Region(3, 0, 16)]


def test_kv_append_writes_the_whole_cache():
    p = attention()
    assert regions_of(p, 0) == ([Region(0, 0, 1), Region(2, 0, 8)], [Region(4, 0, 4)])


def test_fused_is_the_union_of_external_step_regions():
    p = fused()   # x, w, r -> y; step 0 gemv tile into scratch, step 1 add(scratch, r) -> final
    assert regions_of(p, 1) == ([Region(0, 0, 16), Region(1, 0, 16), Region(2, 16, 32)],
                                [Region(3, 16, 32)])


def test_dependencies_of_tiled_program():
    assert dependencies(tiled().build()) == [(), (), (0,), (1,), (2, 3)]


def test_dependencies_raw_war_waw_on_partial_overlaps():
    q = Builder()
    x, a, b = q.buf("x", (1, 16), IN), q.buf("a", (1, 16)), q.buf("b", (1, 16))
    q.task(K.COPY, [x], [a], {"n_off": 0, "N_tile": 8})           # t0 a[0:8]
    q.task(K.COPY, [x], [a], {"n_off": 8, "N_tile": 8})           # t1 a[8:16]
    q.task(K.COPY, [a], [b], {"n_off": 4, "N_tile": 8})           # t2 reads a[4:12]
    q.task(K.COPY, [x], [a])                                      # t3 overwrites all of a
    q.task(K.COPY, [a], [b])                                      # t4 reads a, rewrites b
    prog = q.build()
    assert dependencies(prog) == [(), (), (0, 1), (0, 1, 2), (2, 3)]
    groups = [sorted((c.kind, c.buffer, c.lo, c.hi, tuple(sorted(c.earlier))) for c in found)
              for found in scan(prog.buffers, prog.tasks)]
    assert groups[2] == [(RAW, 1, 4, 12, (0, 1))]
    assert groups[3] == [(WAR, 1, 0, 16, (2,)), (WAW, 1, 0, 16, (0, 1))]   # t2 read a[4:12]
    assert groups[4] == [(RAW, 1, 0, 16, (3,)), (WAW, 2, 0, 16, (2,))]
    unwritten = []
    scan(prog.buffers, prog.tasks, unwritten=unwritten)
    assert [u for u in unwritten if u[1].buffer != 0] == []          # x is an input: never written
    unwritten = []
    scan(prog.buffers, prog.tasks[1:], unwritten=unwritten)          # without t0's a[0:8]
    assert [u for u in unwritten if u[1].buffer != 0] == [(2, Region(1, 4, 8))]
    # the (buffers, tasks) forms give the same answer
    assert dependencies(prog.buffers, prog.tasks) == dependencies((prog.buffers, prog.tasks))


def test_dependencies_in_place_and_readers_since_last_write():
    q = Builder()
    x, a = q.buf("x", (1, 4), IN), q.buf("a", (1, 4))
    q.task(K.COPY, [x], [a])                                      # t0 writes a
    q.task(K.GELU, [a], [a])                                      # t1 in place: RAW t0 only
    q.task(K.COPY, [a], [q.buf("b", (1, 4), OUT)])                # t2 RAW t1
    q.task(K.COPY, [a], [q.buf("c", (1, 4), OUT)])                # t3 RAW t1
    q.task(K.COPY, [x], [a])                                      # t4 WAR t2, t3 (not t1, t0)
    assert dependencies(q.build()) == [(), (0,), (1,), (1,), (2, 3)]


def test_dependencies_of_attention_and_big_program():
    # each combine reads only its head group's rows of the partials
    assert dependencies(attention().build()) == [(), (), (0, 1), (0, 1), (0, 1), (0, 1),
                                                 (2, 3), (4, 5)]
    deps = dependencies(big_program(layers=5).build())
    assert deps[:4] == [(), (), (), ()]
    assert deps[4] == (0, 1, 2, 3)            # RAW on h0 from every tile of layer 0
    assert deps[8] == (4, 5, 6, 7)            # WAR on h0 (layer 1 read it) subsumes WAW on layer 0


def test_weights_never_create_dependencies():
    deps = dependencies(big_program(layers=3).build())
    assert all(d < i for i, ds in enumerate(deps) for d in ds)
    q = Builder()
    w = q.buf("w", (4, 4), W)
    x = q.buf("x", (1, 4), IN)
    for _ in range(3):
        q.task(K.GEMV_TILE, [x, w], [q.buf("y", (1, 4))], {"n_off": 0, "N_tile": 4, "K": 4})
    assert dependencies(q.build()) == [(), (), ()]
    _ = DType


def test_validate_checks_the_rows_a_batched_task_writes():
    from amk.program.validate import validate
    assert validate(batch_rows().build()).ok
    # two tasks on sequence 1 and none on 2: a WAW race on row 1, and row 2 read unwritten
    kinds = {(e.kind, e.task) for e in validate(batch_rows(((0, 1), (1, 1), (1, 1))).build()).errors}
    assert ("race", 2) in kinds and ("coverage", 3) in kinds
    msg = next(e.message for e in validate(batch_rows(((0, 1), (1, 1))).build()).errors)
    assert "row 2 cols [0, 8)" in msg
    # one task over sequences 0 and 1 plus one over 2: every row written once
    assert validate(batch_rows(((0, 2), (2, 1))).build()).ok


def test_an_output_written_by_rows_is_checked_row_by_row():
    from amk.program.validate import validate
    p = batch_rows(((0, 1), (2, 1)), wait_all=False)
    p.buffers[3] = p.buffers[3].__class__(3, "y", OUT, DType.F32, (3, 8))
    p.tasks.pop()                                        # y is the output, nobody reads it
    prog = p.build().with_(outputs=(3,))
    errs = validate(prog).errors
    assert [e.kind for e in errs] == ["coverage"] and "row 1 cols [0, 8)" in errs[0].message
    p = batch_rows(wait_all=False)
    p.buffers[3] = p.buffers[3].__class__(3, "y", OUT, DType.F32, (3, 8))
    p.tasks.pop()
    assert validate(p.build().with_(outputs=(3,))).ok


def test_fused_regions_memo_renames_in_any_operand_order():
    """One recipe object over operands whose ids come in other orders, or repeat: the memo
    (one entry per order of the ids) gives what the union of the steps' regions gives."""
    from amk.program.ir import Buffer, Task
    from amk.program.recipe import parse_recipe
    from amk.program.regions import _fused_regions_over, forget_fused_regions, merge
    recipe = parse_recipe({"steps": [
        {"op": int(K.GEMV_TILE), "args": [{"in": 0}, {"in": 1}], "out": 0,
         "params": {"n_off": 16, "N_tile": 16, "K": 16}, "out_shape": [1, 32],
         "out_dtype": "float32"},
        {"op": int(K.ADD), "args": [{"s": 0}, {"in": 2}], "out": "final",
         "params": {"n_off": 16, "N_tile": 16}}]})
    shapes = {0: (1, 16), 1: (32, 16), 2: (1, 32), 3: (1, 32), 4: (1, 16), 5: (32, 16),
              6: (1, 32), 7: (1, 32)}
    bufs = tuple(Buffer(i, f"b{i}", BufferKind.ACTIVATION, DType.F32, s)
                 for i, s in sorted(shapes.items()))
    forget_fused_regions()
    for ins, outs in (((0, 1, 2), (3,)), ((4, 5, 6), (7,)), ((4, 1, 6), (2,)),
                      ((0, 5, 3), (3,)), ((4, 1, 2), (2,))):       # (the last two: in place)
        t = Task(0, K.FUSED, ins, outs, {"recipe": recipe}, (), 0, "")
        ops = list(dict.fromkeys(ins + outs))
        over = _fused_regions_over(recipe, [ops.index(b) for b in ins],
                                   [ops.index(b) for b in outs],
                                   lambda k: bufs[ops[k]].cols, lambda k: 1)
        want = tuple(merge([Region(ops[r.buffer], r.lo, r.hi, r.r0, r.r1) for r in rs])
                     for rs in over)
        assert task_regions(t, bufs) == want
        assert task_regions(t, list(bufs)) == want          # no shapes table for a list
    t = Task(0, K.FUSED, (4, 1, 6), (2,), {"recipe": recipe}, (), 0, "")
    assert task_regions(t, bufs) == ([Region(1, 0, 16), Region(4, 0, 16), Region(6, 16, 32)],
                                     [Region(2, 16, 32)])


def test_fused_regions_memo_per_buffers_and_operand_pair():
    """The per-(buffers, operands) structure memo: the same operand ids over another buffers
    tuple with other widths, and the same recipe over other operands, each give the regions
    computed from scratch (the memo forgotten)."""
    from amk.program.ir import Buffer, Task
    from amk.program.recipe import parse_recipe
    from amk.program.regions import forget_fused_regions
    recipe = parse_recipe({"steps": [
        {"op": int(K.ADD), "args": [{"in": 0}, {"in": 1}], "out": "final",
         "params": {"n_off": 8, "N_tile": 8}}]})

    def bufs(width):
        return tuple(Buffer(i, f"b{i}", BufferKind.ACTIVATION, DType.F32, (1, w))
                     for i, w in enumerate((width, width, width, 64)))

    cases = [((0, 1), (2,), bufs(16)), ((0, 1), (2,), bufs(32)), ((1, 0), (2,), bufs(16)),
             ((3, 1), (2,), bufs(16)), ((0, 1), (2,), bufs(16))]
    fresh = []
    for ins, outs, b in cases:
        forget_fused_regions()
        fresh.append(task_regions(Task(0, K.FUSED, ins, outs, {"recipe": recipe}, (), 0, ""), b))
    forget_fused_regions()
    warm = [task_regions(Task(0, K.FUSED, ins, outs, {"recipe": recipe}, (), 0, ""), b)
            for ins, outs, b in cases]
    assert warm == fresh
    assert fresh[3] == ([Region(1, 8, 16), Region(3, 0, 64)], [Region(2, 8, 16)])  # x whole
