"""The reference VM on small hand-built Programs, checked against eager torch."""
import time

import pytest
import torch
import torch.nn.functional as F

from amk.backends.reference.vm import ReferenceVM
from amk.errors import DeadlockError, TraceError, ValidationError
from amk.program.ir import Buffer, BufferKind as BK, Counter, DType, InstructionKind as K, Program, Task, Wait


class Builder:
    """Hand-builds a Program: buffers, counters and tasks get dense ids in creation order."""

    def __init__(self):
        self.buffers, self.counters, self.tasks = [], [], []

    def buf(self, name, kind, shape, dtype=DType.F32, source=None):
        bound = kind in (BK.IO_INPUT, BK.WEIGHT, BK.CONST, BK.KV_CACHE)
        self.buffers.append(Buffer(len(self.buffers), name, kind, dtype, tuple(shape),
                                   source if source is not None else (name if bound else "")))
        return len(self.buffers) - 1

    def counter(self, init=0):
        self.counters.append(Counter(len(self.counters), init))
        return len(self.counters) - 1

    def task(self, op, ins, outs, params=None, waits=(), counter=None, name=""):
        counter = self.counter() if counter is None else counter
        self.tasks.append(Task(len(self.tasks), op, tuple(ins), tuple(outs), dict(params or {}),
                               tuple(Wait(c, th) for c, th in waits), counter, name or op.name.lower()))
        return counter

    def build(self, outputs, queues=(), name="test"):
        return Program(tuple(self.buffers), tuple(self.counters), tuple(self.tasks),
                       queues=tuple(tuple(q) for q in queues), name=name, outputs=tuple(outputs))


def rnd(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- a diamond
def diamond():
    b = Builder()
    x = b.buf("x", BK.IO_INPUT, (1, 8))
    a, l, r = (b.buf(n, BK.ACTIVATION, (1, 8)) for n in ("a", "l", "r"))
    y = b.buf("y", BK.IO_OUTPUT, (1, 8))
    ca = b.task(K.MUL, [x], [a], {"scale": 2.0}, name="a=2x")
    cl = b.task(K.ADD, [a, x], [l], waits=[(ca, 1)], name="l=a+x")
    cr = b.task(K.MUL, [a, x], [r], waits=[(ca, 1)], name="r=a*x")
    b.task(K.ADD, [l, r], [y], waits=[(cl, 1), (cr, 1)], name="y=l+r")
    return b.build([y], queues=[[0, 2], [1, 3]])


@pytest.mark.parametrize("order", ["program", "random", "queues"])
def test_diamond_matches_eager_in_every_order(order):
    x = rnd(1, 8, seed=1)
    vm = ReferenceVM(diamond(), order=order, seed=3)
    (y,) = vm.run({"x": x})
    assert torch.equal(y, (2 * x + x) + (2 * x) * x)
    ex = vm.last_stats.exec_order
    assert sorted(ex) == [0, 1, 2, 3] and ex[0] == 0 and ex[-1] == 3
    assert vm.last_stats.epoch == 1 and vm.last_stats.wall_s >= 0


def test_queue_order_is_round_robin_per_worker():
    vm = ReferenceVM(diamond().with_(queues=((0, 1), (2, 3))), order="queues")
    vm.run({"x": rnd(1, 8)})
    # round 1: worker 0 runs t0, then worker 1 finds t2 ready; round 2: t1, then t3
    assert vm.last_stats.exec_order == [0, 2, 1, 3]


def test_queue_placement_that_cannot_advance_is_a_deadlock():
    prog = diamond().with_(queues=((3, 0), (1, 2)))     # worker 0 starts with the sink
    vm = ReferenceVM(prog, order="queues", check=False)
    with pytest.raises(DeadlockError) as e:
        vm.run({"x": rnd(1, 8)})
    msg = str(e.value)
    assert "no worker can advance" in msg and "task 3 'y=l+r'" in msg
    assert "queued on worker 0 behind task 3" in msg


# ---------------------------------------------------------------- sibling tiles
def tiled_gemv(n_tiles=4, N=16, Kdim=8):
    b = Builder()
    x = b.buf("x", BK.IO_INPUT, (1, Kdim))
    W = b.buf("W", BK.WEIGHT, (N, Kdim), DType.BF16)
    y = b.buf("y", BK.ACTIVATION, (1, N))
    z = b.buf("z", BK.IO_OUTPUT, (1, N))
    cy = b.counter()
    step = N // n_tiles
    for i in range(n_tiles):
        b.task(K.GEMV_TILE, [x, W], [y], {"n_off": i * step, "N_tile": step, "K": Kdim},
               counter=cy, name=f"W[tile {i}/{n_tiles}]")
    b.task(K.SILU_MUL, [y, y], [z], waits=[(cy, n_tiles)], name="z=silu(y)*y")
    return b.build([z])


def test_sibling_tiles_share_one_counter_and_random_orders_are_bit_identical():
    prog = tiled_gemv()
    binds = {"x": rnd(1, 8, seed=2), "W": rnd(16, 8, seed=3).bfloat16()}
    want = ReferenceVM(prog).run(binds)[0]
    y = binds["x"] @ binds["W"].float().T
    torch.testing.assert_close(want, F.silu(y) * y, rtol=1e-5, atol=1e-5)
    orders = set()
    for seed in range(6):
        vm = ReferenceVM(prog, order="random", seed=seed)
        assert torch.equal(vm.run(binds)[0], want)
        orders.add(tuple(vm.last_stats.exec_order))
        assert vm.last_stats.exec_order[-1] == 4            # the consumer waits for all 4 tiles
    assert len(orders) > 1                                  # the interleavings really differed
    again = ReferenceVM(prog, order="random", seed=5)
    again.run(binds)
    assert tuple(again.last_stats.exec_order) in orders     # a seed reproduces its order


def test_threshold_below_tile_count_fires_the_consumer_early():
    """A wait counts completions, not which tile: threshold 1 lets the consumer run after the
    first tile (the validator refuses such a program; the VM obeys the counters)."""
    b = Builder()
    x = b.buf("x", BK.IO_INPUT, (1, 4))
    y = b.buf("y", BK.ACTIVATION, (1, 4))
    z = b.buf("z", BK.IO_OUTPUT, (1, 4))
    cy = b.counter()
    b.task(K.COPY, [x], [y], {"n_off": 0, "N_tile": 2}, counter=cy)
    b.task(K.COPY, [y], [z], waits=[(cy, 1)])
    b.task(K.COPY, [x], [y], {"n_off": 2, "N_tile": 2}, counter=cy)
    vm = ReferenceVM(b.build([z]), check=False)
    x_val = rnd(1, 4) + 10
    (z_val,) = vm.run({"x": x_val})
    assert vm.last_stats.exec_order == [0, 1, 2]
    assert torch.equal(z_val[0, :2], x_val[0, :2]) and (z_val[0, 2:] == 0).all()


# ---------------------------------------------------------------- deadlocks
def test_unreachable_threshold_deadlocks_fast_and_names_the_task():
    b = Builder()
    x = b.buf("x", BK.IO_INPUT, (1, 4))
    y = b.buf("y", BK.IO_OUTPUT, (1, 4))
    c = b.task(K.COPY, [x], [y], name="producer")
    b.task(K.MUL, [y], [y], {"scale": 2.0}, waits=[(c, 2)], name="needs two")
    vm = ReferenceVM(b.build([y]), check=False)
    t0 = time.perf_counter()
    with pytest.raises(DeadlockError) as e:
        vm.run({"x": rnd(1, 4)})
    assert time.perf_counter() - t0 < 1.0
    msg = str(e.value)
    assert "task 1 'needs two' (MUL): counter 0: have 1, need 2" in msg
    assert "1 of 2 tasks never ran" in msg
    with pytest.raises(DeadlockError, match="task 1 'needs two'"):    # counters were restored:
        vm.run({"x": rnd(1, 4)})                                      # the same report again
    assert vm.counters == {0: 0, 1: 0} and vm.epoch == 0


def test_a_failed_step_restores_the_counters_and_the_vm_runs_again():
    b = Builder()
    ids = b.buf("ids", BK.IO_INPUT, (1,), DType.I32)
    table = b.buf("table", BK.WEIGHT, (4, 3))
    y = b.buf("y", BK.IO_OUTPUT, (1, 3))
    b.task(K.EMBED, [ids, table], [y])
    vm = ReferenceVM(b.build([y]))
    t = rnd(4, 3)
    with pytest.raises(TraceError, match="EMBED.*'ids'.*7.*4 rows"):
        vm.run({"ids": torch.tensor([7], dtype=torch.int32), "table": t})
    (out,) = vm.run({"ids": torch.tensor([2], dtype=torch.int32), "table": t})
    assert torch.equal(out[0], t[2]) and vm.epoch == 1


def test_wait_cycle_deadlock_lists_at_most_16_tasks():
    b = Builder()
    n = 40
    for i in range(n):                       # a ring: task i waits for task i-1's counter
        b.task(K.NOP, [], [], waits=[((i - 1) % n, 1)], counter=b.counter())
    vm = ReferenceVM(b.build([]), check=False)
    t0 = time.perf_counter()
    with pytest.raises(DeadlockError) as e:
        vm.run({})
    assert time.perf_counter() - t0 < 1.0
    msg = str(e.value)
    assert msg.count("have 0, need 1") == 16 and "... and 24 more stuck tasks" in msg


def test_wall_clock_limit_raises_deadlock():
    b = Builder()
    prev = b.task(K.NOP, [], [])
    for _ in range(600):
        prev = b.task(K.NOP, [], [], waits=[(prev, 1)])
    with pytest.raises(DeadlockError, match=r"wall-clock limit of 1e-09 s exceeded \(AMK_VM_TIMEOUT_S\)"):
        ReferenceVM(b.build([]), check=False, timeout_s=1e-9).run({})


def test_jit_hands_the_timeout_knob_to_the_vm(monkeypatch):
    import amk
    from amk import ops
    monkeypatch.setenv("AMK_VM_TIMEOUT_S", "123")
    f = amk.jit(lambda x: ops.add(x, x), backend="reference")
    x = torch.ones(1, 4)
    exe, _ = f.executable(x)
    assert exe.timeout_s == 123.0


# ---------------------------------------------------------------- a tiny decode step
H, NH, NKV, HD, S, V = 16, 2, 1, 8, 8, 12


def tiny_decode():
    """embed -> rmsnorm -> q/k/v -> rope -> kv append -> split-KV attention -> o-proj + residual
    -> logits -> argmax, with the decode position a runtime input."""
    b = Builder()
    tok = b.buf("token", BK.IO_INPUT, (1,), DType.I32)
    pos = b.buf("pos", BK.IO_INPUT, (1,), DType.I32)
    emb = b.buf("embed", BK.WEIGHT, (V, H))
    ln = b.buf("ln", BK.WEIGHT, (H,))
    wq, wk, wv = (b.buf(n, BK.WEIGHT, (d, H)) for n, d in (("wq", NH * HD), ("wk", NKV * HD), ("wv", NKV * HD)))
    wo = b.buf("wo", BK.WEIGHT, (H, NH * HD))
    lm = b.buf("lm_head", BK.WEIGHT, (V, H))
    kc = b.buf("kc", BK.KV_CACHE, (S, NKV, HD), source="kv.k")
    vc = b.buf("vc", BK.KV_CACHE, (S, NKV, HD), source="kv.v")
    x, xn, o, h = (b.buf(n, BK.ACTIVATION, (1, H)) for n in ("x", "xn", "o", "h"))
    q, qr, attn = (b.buf(n, BK.ACTIVATION, (1, NH * HD)) for n in ("q", "qr", "attn"))
    k, kr, v = (b.buf(n, BK.ACTIVATION, (1, NKV * HD)) for n in ("k", "kr", "v"))
    parts = [b.buf(f"part{i}", BK.ACTIVATION, (NH, HD + 2)) for i in range(2)]
    logits = b.buf("logits", BK.IO_OUTPUT, (1, V))
    nxt = b.buf("next", BK.IO_OUTPUT, (1,), DType.I32)

    cx = b.task(K.EMBED, [tok, emb], [x])
    cxn = b.task(K.RMSNORM, [x, ln], [xn], {"eps": 1e-6}, waits=[(cx, 1)])
    cq = b.counter()
    for i in range(2):
        b.task(K.GEMV_TILE, [xn, wq], [q], {"n_off": i * HD, "N_tile": HD, "K": H}, [(cxn, 1)], cq)
    ck = b.task(K.GEMV_TILE, [xn, wk], [k], {"n_off": 0, "N_tile": HD, "K": H}, [(cxn, 1)])
    cv = b.task(K.GEMV_TILE, [xn, wv], [v], {"n_off": 0, "N_tile": HD, "K": H}, [(cxn, 1)])
    cqr = b.task(K.ROPE, [q, pos], [qr], {"head_dim": HD, "theta": 10000.0}, [(cq, 2)])
    ckr = b.task(K.ROPE, [k, pos], [kr], {"head_dim": HD, "theta": 10000.0}, [(ck, 1)])
    ckv = b.counter()
    b.task(K.KV_APPEND, [kr, pos], [kc], {}, [(ckr, 1)], ckv)
    b.task(K.KV_APPEND, [v, pos], [vc], {}, [(cv, 1)], ckv)
    cp = b.counter()
    for i, part in enumerate(parts):
        b.task(K.ATTENTION_TILE, [qr, kc, vc, pos], [part],
               {"head_dim": HD, "n_heads": NH, "n_kv_heads": NKV, "scale": HD ** -0.5,
                "kv_start": i * S // 2, "kv_len": S // 2, "flags": 2}, [(cqr, 1), (ckv, 2)], cp)
    ca = b.task(K.ATTENTION_COMBINE, parts, [attn], {"head_dim": HD, "n_heads": NH}, [(cp, 2)])
    co = b.counter()
    for i in range(2):
        b.task(K.GEMV_TILE, [attn, wo], [o], {"n_off": i * H // 2, "N_tile": H // 2, "K": NH * HD},
               [(ca, 1)], co)
    ch = b.task(K.ADD, [o, x], [h], {}, [(co, 2), (cx, 1)])
    cl = b.task(K.GEMV_TILE, [h, lm], [logits], {"n_off": 0, "N_tile": V, "K": H}, [(ch, 1)])
    b.task(K.SAMPLE_ARGMAX, [logits], [nxt], {}, [(cl, 1)])
    return b.build([nxt, logits, kc])


def tiny_weights(seed=10):
    names = {"embed": (V, H), "ln": (H,), "wq": (NH * HD, H), "wk": (NKV * HD, H),
             "wv": (NKV * HD, H), "wo": (H, NH * HD), "lm_head": (V, H)}
    return {n: rnd(*s, seed=seed + i) for i, (n, s) in enumerate(names.items())}


def eager_decode(w, tokens):
    """Independent eager torch: HF-style rope and F.scaled_dot_product_attention."""
    kc, vc = torch.zeros(S, NKV, HD), torch.zeros(S, NKV, HD)
    inv = 1.0 / 10000.0 ** (torch.arange(0, HD, 2).float() / HD)

    def rope(t, p):
        ang = torch.cat([p * inv, p * inv])
        t = t.view(-1, HD)
        return (t * ang.cos() + torch.cat([-t[:, HD // 2:], t[:, :HD // 2]], -1) * ang.sin()).view(1, -1)

    outs = []
    for p, tok in enumerate(tokens):
        x = w["embed"][tok][None]
        xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w["ln"]
        q, k, v = rope(xn @ w["wq"].T, p), rope(xn @ w["wk"].T, p), xn @ w["wv"].T
        kc[p], vc[p] = k.view(NKV, HD), v.view(NKV, HD)
        kk = kc[:p + 1].repeat_interleave(NH // NKV, 1).transpose(0, 1)     # [NH, p+1, HD]
        vv = vc[:p + 1].repeat_interleave(NH // NKV, 1).transpose(0, 1)
        a = F.scaled_dot_product_attention(q.view(NH, 1, HD), kk, vv).reshape(1, NH * HD)
        logits = (a @ w["wo"].T + x) @ w["lm_head"].T
        outs.append((int(logits.argmax()), logits))
    return outs, kc


def decode_bindings(w, kv, tok, p):
    return {**w, "kv.k": kv[0], "kv.v": kv[1], "token": torch.tensor([tok], dtype=torch.int32),
            "pos": torch.tensor([p], dtype=torch.int32)}


@pytest.mark.parametrize("order", ["program", "random"])
def test_tiny_decode_steps_kv_in_place_monotonic_counters(order):
    prog = tiny_decode()
    w = tiny_weights()
    tokens = [3, 7, 1, 5, 11]                                  # pos 4+ crosses into shard 1
    want, want_kc = eager_decode(w, tokens)
    kv = (torch.zeros(S, NKV, HD), torch.zeros(S, NKV, HD))
    vm = ReferenceVM(prog, order=order, seed=7)
    first_logits = None
    for p, tok in enumerate(tokens):
        nxt, logits, kc = vm.run(decode_bindings(w, kv, tok, p))
        assert kc is kv[0]                                     # the bound cache, updated in place
        assert vm.last_stats.epoch == p + 1
        assert int(nxt) == want[p][0]
        torch.testing.assert_close(logits, want[p][1], rtol=1e-4, atol=1e-4)
        if first_logits is None:
            first_logits, first_copy = logits, logits.clone()
    assert torch.equal(first_logits, first_copy)             # returned outputs are clones
    torch.testing.assert_close(kv[0], want_kc, rtol=1e-5, atol=1e-5)
    incs = [0] * len(prog.counters)
    for t in prog.tasks:
        incs[t.out_counter] += 1
    assert vm.counters == {c: n * len(tokens) for c, n in enumerate(incs)}   # never reset


def test_tiny_decode_random_orders_bit_identical():
    prog, w = tiny_decode(), tiny_weights(seed=20)
    results = []
    for seed in range(4):
        kv = (torch.zeros(S, NKV, HD), torch.zeros(S, NKV, HD))
        vm = ReferenceVM(prog, order="random", seed=seed)
        for p, tok in enumerate([2, 9, 4]):
            _, logits, _ = vm.run(decode_bindings(w, kv, tok, p))
        results.append((logits, kv[0].clone(), kv[1].clone()))
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r, results[0]))


# ---------------------------------------------------------------- bindings and refusal
def test_binding_errors_name_buffer_source_and_expectation():
    prog, w = tiny_decode(), tiny_weights()
    vm = ReferenceVM(prog)
    kv = (torch.zeros(S, NKV, HD), torch.zeros(S, NKV, HD))
    good = decode_bindings(w, kv, 1, 0)
    missing = dict(good)
    del missing["wq"]
    with pytest.raises(TraceError, match=r"buffer 4 'wq' \(WEIGHT, source 'wq'\): no binding"):
        vm.run(missing)
    with pytest.raises(TraceError, match=r"expected shape \(16, 16\) dtype torch.float32, got shape "
                                         r"\(16, 8\) dtype torch.float32"):
        vm.run({**good, "wq": torch.zeros(16, 8)})
    with pytest.raises(TraceError, match=r"'pos'.*got shape \(1,\) dtype torch.int64"):
        vm.run({**good, "pos": torch.tensor([0])})
    with pytest.raises(TraceError, match="is on meta but the VM runs on cpu"):
        vm.run({**good, "kv.k": torch.zeros(S, NKV, HD, device="meta")})
    nxt, _, _ = vm.run(good)                                  # errors left the VM usable
    assert vm.last_stats.epoch == 1 and nxt.dtype == torch.int32


def test_invalid_program_is_refused_with_the_validator_report():
    b = Builder()
    x = b.buf("x", BK.IO_INPUT, (1, 4))
    y = b.buf("y", BK.IO_OUTPUT, (1, 4))
    b.task(K.COPY, [x], [y], name="writer a")
    b.task(K.MUL, [x], [y], {"scale": 2.0}, name="writer b")       # unordered second writer
    prog = b.build([y])
    with pytest.raises(ValidationError, match="refuses an invalid program") as e:
        ReferenceVM(prog)
    assert e.value.result is not None and not e.value.result.ok
    ReferenceVM(prog, check=False).run({"x": rnd(1, 4)})       # the unchecked VM still runs it


def test_malformed_fused_recipe_is_refused_at_construction():
    b = Builder()
    x = b.buf("x", BK.IO_INPUT, (1, 4))
    y = b.buf("y", BK.IO_OUTPUT, (1, 4))
    b.task(K.FUSED, [x], [y], {"recipe": {"steps": [{"op": int(K.COPY), "args": [{"in": 3}],
                                                      "out": "final"}]}}, name="bad fused")
    with pytest.raises(ValidationError, match=r"(?s)task 0 'bad fused' \(FUSED\).*input index 3"):
        ReferenceVM(b.build([y]), check=False)


def test_error_inside_a_task_names_the_task():
    prog, w = tiny_decode(), tiny_weights()
    kv = (torch.zeros(S, NKV, HD), torch.zeros(S, NKV, HD))
    vm = ReferenceVM(prog)
    with pytest.raises(TraceError, match="outside the cache") as e:
        vm.run(decode_bindings(w, kv, 1, S))                 # pos past the cache
    assert any("kv_append" in n and "KV_APPEND" in n for n in e.value.__notes__)


def test_rebinding_a_weight_between_runs_takes_effect():
    prog = tiled_gemv()
    vm = ReferenceVM(prog)
    x, W1, W2 = rnd(1, 8, seed=4), rnd(16, 8, seed=5).bfloat16(), rnd(16, 8, seed=6).bfloat16()
    for W in (W1, W2, W1):
        y = x @ W.float().T
        torch.testing.assert_close(vm.run({"x": x, "W": W})[0], F.silu(y) * y, rtol=1e-5, atol=1e-5)
    assert vm.last_stats.epoch == 3


# ---------------------------------------------------------------- partial thresholds across steps
def test_a_partial_threshold_still_waits_on_later_steps():
    """Two tasks increment one counter; a third waits for just one of them. On step 2 it must
    wait for one step-2 increment (threshold + per_step*(epoch-1) = 3), not fire at once on the
    two increments left over from step 1."""
    b = Builder()
    x = b.buf("x", BK.IO_INPUT, (1, 4))
    a1, a2, y = (b.buf(n, BK.ACTIVATION if n != "y" else BK.IO_OUTPUT, (1, 4)) for n in ("a1", "a2", "y"))
    c = b.counter()
    b.task(K.COPY, [x], [a1], counter=c, name="first")
    b.task(K.COPY, [x], [a2], counter=c, name="second")
    b.task(K.MUL, [x], [y], {"scale": 3.0}, waits=[(c, 1)], name="after one of them")
    prog = b.build([y])
    for seed in range(20):
        vm = ReferenceVM(prog, order="random", seed=seed, check=False)
        for step in range(3):
            vm.run({"x": rnd(1, 4)})
            assert vm.last_stats.exec_order.index(2) >= 1, (seed, step, vm.last_stats.exec_order)


def test_subnormals_flush_to_zero_inside_the_vm_only():
    """The VM flushes subnormals (x86 microcode for each one made real decode steps ~30x
    slower); the caller's arithmetic outside run() is untouched."""
    b = Builder()
    x = b.buf("x", BK.IO_INPUT, (1, 2))
    y = b.buf("y", BK.IO_OUTPUT, (1, 2))
    b.task(K.MUL, [x], [y], {"scale": 1e-10})
    (got,) = ReferenceVM(b.build([y])).run({"x": torch.tensor([[1e-30, 1.0]])})
    assert got[0, 0].item() == 0.0 and got[0, 1].item() == pytest.approx(1e-10)
    assert (torch.tensor([1e-30]) * 1e-10).item() > 0       # outside: subnormals as usual
