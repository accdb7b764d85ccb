"""Whole programs on the megakernel: a multi-task, multi-CTA chain against the ReferenceVM,
monotonic counters over 1,000 steps, a task with more waits than its descriptor carries, the
profile build's marks, and the watchdog turning a deadlock into an error; and the argmax of many rows over its tiles' partials, with ties across tiles."""
import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cuda.bindings")

from amk.errors import DeadlockError
from amk.program.ir import BufferKind as BK, DType as D, InstructionKind as K
from amk.testing.cuda_examples import Builder
from amk.backends.cuda.options import CudaOptions
from amk.backends.cuda.runtime import CudaProgram


def chain_program(queues=True):
    """embed -> rmsnorm -> 4 GEMV tiles (one counter) -> residual add (2 tiles) -> fused
    norm+gemv (lm head, 3 tiles) -> argmax, on 3 queues."""
    H, V = 128, 96
    b = Builder("chain")
    ids = b.buf("ids", BK.IO_INPUT, D.I32, (1,))
    emb = b.buf("embed", BK.WEIGHT, D.BF16, (V, H))
    nw = b.buf("norm", BK.WEIGHT, D.BF16, (H,))
    w = b.buf("w", BK.WEIGHT, D.BF16, (H, H))
    head = b.buf("head", BK.WEIGHT, D.BF16, (V, H))
    x = b.buf("x", BK.ACTIVATION, D.BF16, (1, H))
    xn = b.buf("xn", BK.ACTIVATION, D.BF16, (1, H))
    y = b.buf("y", BK.ACTIVATION, D.BF16, (1, H))
    r = b.buf("r", BK.ACTIVATION, D.BF16, (1, H))
    logits = b.buf("logits", BK.IO_OUTPUT, D.F32, (1, V))
    tok = b.buf("tok", BK.IO_OUTPUT, D.I32, (1,))
    c0 = b.task(K.EMBED, [ids, emb], [x])
    c1 = b.task(K.RMSNORM, [x, nw], [xn], {"eps": 1e-5}, waits=[(c0, 1)])
    c2 = b.counter()
    for i in range(4):
        b.task(K.GEMV_TILE, [xn, w], [y], {"n_off": 32 * i, "N_tile": 32, "K": H},
               waits=[(c1, 1)], out_counter=c2)
    c3 = b.counter()
    for i in range(2):
        b.task(K.ADD, [x, y], [r], {"n_off": 64 * i, "N_tile": 64}, waits=[(c2, 4)], out_counter=c3)
    c4 = b.counter()
    for i in range(3):
        steps = [{"op": int(K.RMSNORM), "args": [{"in": 0}, {"in": 1}], "out": 0,
                  "params": {"eps": 1e-5}, "out_shape": [1, H], "out_dtype": "bfloat16"},
                 {"op": int(K.GEMV_TILE), "args": [{"s": 0}, {"in": 2}], "out": "final",
                  "params": {"n_off": 32 * i, "N_tile": 32, "K": H}}]
        b.task(K.FUSED, [r, nw, head], [logits], {"recipe": {"steps": steps}},
               waits=[(c3, 2)], out_counter=c4)
    b.task(K.SAMPLE_ARGMAX, [logits], [tok], waits=[(c4, 3)])
    b.outputs = [logits, tok]
    n = len(b.tasks)
    qs = [list(range(q, n, 3)) for q in range(3)] if queues else ()
    return b.program(qs)


def chain_bindings(seed):
    g = torch.Generator().manual_seed(seed)
    return {"ids": torch.randint(0, 96, (1,), generator=g, dtype=torch.int32),
            "embed": torch.randn(96, 128, generator=g).bfloat16(),
            "norm": torch.randn(128, generator=g).bfloat16(),
            "w": (torch.randn(128, 128, generator=g) * 0.1).bfloat16(),
            "head": (torch.randn(96, 128, generator=g) * 0.1).bfloat16()}


@pytest.mark.parametrize("queues", [True, False])
def test_chain_matches_reference_vm(queues):
    from amk.backends.reference.vm import ReferenceVM
    prog = chain_program(queues)
    cp = CudaProgram(prog, "cuda")
    for seed in (0, 1):
        binds = chain_bindings(seed)
        ref = ReferenceVM(prog, device="cpu").run(binds)
        got = cp.run({k: v.cuda() for k, v in binds.items()})
        torch.testing.assert_close(got[0].cpu(), ref[0], rtol=2e-2, atol=2e-2)
        assert got[1].item() == ref[1].item() or abs(ref[0][0, got[1].item()] - ref[0].max()) < 2e-2


def many_waits_program(n_waits=6, stuck=None):
    """n_waits producers (x + x into p_k, each its own counter) and one ALLREDUCE_SHARD waiting on
    all of them: the first abi.INLINE_WAITS waits come from the descriptor, the rest from the
    waits table. stuck=k: wait k needs one more completion than it will ever get."""
    b = Builder("many_waits")
    x = b.buf("x", BK.IO_INPUT, D.F32, (64,))
    out = b.buf("out", BK.IO_OUTPUT, D.F32, (64,))
    waits = []
    parts = []
    for k in range(n_waits):
        p = b.buf(f"p{k}", BK.ACTIVATION, D.F32, (64,))
        waits.append((b.task(K.ADD, [x, x], [p], name=f"twice_{k}"), 2 if k == stuck else 1))
        parts.append(p)
    b.task(K.ALLREDUCE_SHARD, parts, [out], waits=waits, name="sum_of_all")
    b.outputs = [out]
    return b.program([[n_waits]] + [[k] for k in range(n_waits)])   # the consumer on a CTA of its own


def test_a_task_with_more_waits_than_its_descriptor_carries():
    """Six waits: four inline, two from the waits table; the consumer starts at once on its own
    CTA, so it polls while the producers run."""
    from amk.backends.cuda import abi
    from amk.backends.reference.vm import ReferenceVM
    n = abi.INLINE_WAITS + 2
    prog = many_waits_program(n)
    cp = CudaProgram(prog, "cuda")
    assert int(cp.lowered.tasks[n]["n_waits"]) == n
    x = torch.randn(64)
    ref = ReferenceVM(prog, device="cpu").run({"x": x})
    for _ in range(3):
        got = cp.run({"x": x.cuda()})
        torch.testing.assert_close(got[0].cpu(), ref[0])
        torch.testing.assert_close(got[0].cpu(), 2 * n * x)


def test_a_stuck_wait_past_the_inline_ones_is_named():
    from amk.backends.cuda import abi
    n = abi.INLINE_WAITS + 2
    cp = CudaProgram(many_waits_program(n, stuck=n - 1), "cuda", validate=False,
                     options=CudaOptions(watchdog_s=0.2))
    with pytest.raises(DeadlockError, match="sum_of_all") as ei:
        cp.run({"x": torch.ones(64, device="cuda")})
    assert f"counter {n - 1} = 1" in str(ei.value)


def test_thousand_steps_are_identical():
    prog = chain_program()
    cp = CudaProgram(prog, "cuda")
    binds = {k: v.cuda() for k, v in chain_bindings(3).items()}
    first = [t.clone() for t in cp.run(binds)]
    for _ in range(999):
        cp.run(binds, check=False)
    cp.check()
    last = cp.run(binds)
    assert all(torch.equal(a, b) for a, b in zip(first, last))
    assert int(cp.state[0].item()) == 1001                  # the epoch the kernel advanced


def test_cuda_graph_capture_of_one_step():
    prog = chain_program()
    cp = CudaProgram(prog, "cuda")
    binds = {k: v.cuda() for k, v in chain_bindings(4).items()}
    ref = [t.clone() for t in cp.run(binds)]
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            cp.launch()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    cp.check()
    assert torch.equal(cp.buffers[prog.outputs[0]], ref[0])


def test_profile_build_records_each_gemv_tasks_marks_in_order():
    """The profile build (AMK_PROFILE=1): every task's ready time lies between its wait's end and
    its end; every plain op_gemv_direct task records its AMK_MARK points (entered, x staged,
    warp 0's first weights 5, its first item 2, all items, stored) as step 0's, in that order,
    after ready; a FUSED task's marks are its steps' own, each step's after that step's start."""
    prog = chain_program()
    cp = CudaProgram(prog, "cuda", options=CudaOptions(profile=True))
    cp.run({k: v.cuda() for k, v in chain_bindings(5).items()})
    rows = {r[0]: r for r in cp.profile()}
    assert all(r[3] <= r[6] <= r[4] for r in rows.values())
    marks = cp.profile_marks()
    gemvs = [i for i, t in enumerate(prog.tasks) if t.op == K.GEMV_TILE]
    assert len(gemvs) == 4 and set(gemvs) <= set(marks)
    for i in gemvs:
        by_k = {k: t for _, k, t in marks[i]}
        assert [s for s, _, _ in marks[i]] == [0] * 6 and sorted(by_k) == [0, 1, 2, 3, 4, 5]
        ts = [by_k[k] for k in (0, 1, 5, 2, 3, 4)]
        assert rows[i][6] <= ts[0] and ts == sorted(ts) and ts[-1] <= rows[i][4]
    steps = cp.profile_steps()                 # the lowered FUSED tasks (the norm + LM-head tiles)
    fused = [i for i in range(len(prog.tasks)) if int(cp.lowered.tasks[i]["op"]) == int(K.FUSED)]
    assert fused and all(i in steps for i in fused)
    for i in fused:
        starts = [t for _, t in steps[i]] + [rows[i][4]]
        for s, k, t in marks.get(i, []):
            assert starts[s] <= t <= starts[s + 1], (i, s, k)
    assert any(marks.get(i) for i in fused)     # the LM-head tiles' GEMV steps mark


def test_deadlock_raises_instead_of_hanging():
    b = Builder("stuck")
    x = b.buf("x", BK.IO_INPUT, D.F32, (8,))
    y = b.buf("y", BK.IO_OUTPUT, D.F32, (8,))
    c = b.task(K.COPY, [x], [y])
    b.task(K.COPY, [x], [y], waits=[(c, 5)], name="waits_forever")   # only one incrementer
    b.outputs = [y]
    cp = CudaProgram(b.program(), "cuda", validate=False,
                     options=CudaOptions(watchdog_s=0.2))
    t0 = time.time()
    with pytest.raises(DeadlockError, match="waits_forever") as ei:
        cp.run({"x": torch.ones(8, device="cuda")})
    assert time.time() - t0 < 30
    assert "counter 0 = 1" in str(ei.value)



def argmax_rows_program(rows, tiles=5, H=64, tile_n=24):
    """x [rows, H] -> an LM head of `tiles` GEMV tiles (op_gemv_mma: rows > 1), each writing its
    tile's argmax partial of every row -> one argmax over the partials (argmax_fold)."""
    V = tiles * tile_n
    b = Builder("argmax_rows")
    x = b.buf("x", BK.IO_INPUT, D.BF16, (rows, H))
    head = b.buf("head", BK.WEIGHT, D.BF16, (V, H))
    logits = b.buf("logits", BK.IO_OUTPUT, D.F32, (rows, V))
    tok = b.buf("tok", BK.IO_OUTPUT, D.I32, (rows,))
    c = b.counter()
    for i in range(tiles):
        b.task(K.GEMV_TILE, [x, head], [logits], {"n_off": tile_n * i, "N_tile": tile_n, "K": H},
               out_counter=c)
    b.task(K.SAMPLE_ARGMAX, [logits], [tok], waits=[(c, tiles)])
    b.outputs = [logits, tok]
    return b.program()


@pytest.mark.parametrize("rows", [3, 16, 40])
def test_the_argmax_of_many_rows_takes_the_first_of_tied_logits_across_tiles(rows):
    """Every head row repeats in every tile (row v = row v mod 24), so each row's best logit ties
    in all five tiles: the token must be the first of them, whichever warp reduced the row
    (40 rows: more than the CTA's warps)."""
    from amk.backends.reference.vm import ReferenceVM
    prog = argmax_rows_program(rows)
    cp = CudaProgram(prog, "cuda")
    fns = {cp.lowered.variants[int(d["variant"])].fn for d in cp.lowered.tasks}
    assert {"op_gemv_mma", "op_argmax_parts"} <= fns
    g = torch.Generator().manual_seed(rows)
    binds = {"x": torch.randn(rows, 64, generator=g).bfloat16(),
             "head": (torch.randn(24, 64, generator=g) * 0.1).bfloat16().repeat(5, 1)}
    ref = ReferenceVM(prog, device="cpu").run(binds)
    logits, tok = cp.run({k: v.cuda() for k, v in binds.items()})
    assert torch.equal(logits[:, :24].repeat(1, 5), logits)              # the ties are exact
    assert torch.equal(tok.cpu().long(), logits.argmax(-1).cpu())          # the first of them
    assert bool((tok.cpu().long() < 24).all())
    torch.testing.assert_close(logits.cpu(), ref[0], rtol=2e-2, atol=2e-2)
