"""The Triton backend on CUDA: every micro-kernel in bf16 and fp32 against the reference
semantics, and a hand-built one-layer decode program (eager and CUDA-graph replay) against the
reference VM over several steps. `decode_layer_program` also serves the interpreter tests.

Run apart from the interpreter tests (TRITON_INTERPRET=1 decides how kernels compile):
    python -m pytest tests/gpu/test_triton_gpu.py
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from amk.program.ir import (Buffer, BufferKind as BK, Counter, DType, InstructionKind as K,
                            Program, Task, Wait)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def _compiled_kernels():
    # checked at run time: the interpreter tests set TRITON_INTERPRET=1 when they are collected
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("Triton kernels are interpreted in this session; run tests/gpu on its own")


# ------------------------------------------------------------------------------ the program
class _Builder:
    """Hand-written programs: every task has its own counter and waits for every earlier task
    that wrote a buffer it reads, or read/wrote a buffer it writes (conservative, always valid)."""

    def __init__(self):
        self.buffers, self.tasks = [], []
        self.writers: dict[int, list[int]] = {}
        self.readers: dict[int, list[int]] = {}

    def buf(self, name, shape, kind=BK.ACTIVATION, dtype=DType.F32, source=""):
        src = source or (name if kind in (BK.IO_INPUT, BK.WEIGHT, BK.CONST, BK.KV_CACHE) else "")
        self.buffers.append(Buffer(len(self.buffers), name, kind, dtype, tuple(shape), src))
        return len(self.buffers) - 1

    def task(self, op, ins, outs, params=None, name=""):
        tid = len(self.tasks)
        deps = set()
        for b in ins:
            deps.update(self.writers.get(b, ()))
        for b in outs:
            deps.update(self.writers.get(b, ()))
            deps.update(self.readers.get(b, ()))
        deps.discard(tid)
        self.tasks.append(Task(tid, op, tuple(ins), tuple(outs), dict(params or {}),
                               tuple(Wait(d, 1) for d in sorted(deps)), tid, name or op.name))
        for b in ins:
            self.readers.setdefault(b, []).append(tid)
        for b in outs:
            self.writers.setdefault(b, []).append(tid)
        return tid

    def build(self, outputs, name):
        counters = tuple(Counter(i) for i in range(len(self.tasks)))
        return Program(tuple(self.buffers), counters, tuple(self.tasks), name=name,
                       outputs=tuple(outputs))


def decode_layer_program(dt: DType = DType.F32, V=64, H=32, n_heads=4, n_kv=2, hd=8, F=48,
                         max_seq=16):
    """A one-layer Llama-style decode step exercising embed, rmsnorm, tiled GEMVs, rope (theta
    and inv_freq), KV append, split-KV attention over head ranges, the combine, FUSED chains
    (linear->add, rmsnorm->gate/up->silu_mul), argmax. Returns (program, make_bindings)."""
    p = _Builder()
    tok = p.buf("token", (1,), BK.IO_INPUT, DType.I32)
    pos = p.buf("pos", (1,), BK.IO_INPUT, DType.I32)
    w = {n: p.buf(n, s, BK.WEIGHT, dt) for n, s in [
        ("embed", (V, H)), ("n1", (H,)), ("wq", (n_heads * hd, H)), ("wk", (n_kv * hd, H)),
        ("wv", (n_kv * hd, H)), ("wo", (H, n_heads * hd)), ("n2", (H,)), ("wg", (F, H)),
        ("wu", (F, H)), ("wd", (H, F)), ("nf", (H,)), ("lm", (V, H))]}
    inv_freq = p.buf("rope.inv_freq", (hd // 2,), BK.CONST, DType.F32)
    kc = p.buf("kv.k", (max_seq, n_kv, hd), BK.KV_CACHE, dt)
    vc = p.buf("kv.v", (max_seq, n_kv, hd), BK.KV_CACHE, dt)
    a = {n: p.buf(n, s, BK.ACTIVATION, d) for n, s, d in [
        ("x", (1, H), dt), ("h", (1, H), dt), ("q", (1, n_heads * hd), dt),
        ("k", (1, n_kv * hd), dt), ("v", (1, n_kv * hd), dt), ("qr", (1, n_heads * hd), dt),
        ("kr", (1, n_kv * hd), dt), ("p0", (1, n_heads * (hd + 2)), DType.F32),
        ("p1", (1, n_heads * (hd + 2)), DType.F32), ("att", (1, n_heads * hd), dt), ("x2", (1, H), dt),
        ("act", (1, F), dt), ("y", (1, H), dt), ("x3", (1, H), dt), ("hf", (1, H), dt)]}
    logits = p.buf("logits", (1, V), BK.IO_OUTPUT, DType.F32)
    ids = p.buf("ids", (1,), BK.IO_OUTPUT, DType.I32)
    sd = {DType.F32: "float32", DType.BF16: "bfloat16", DType.F16: "float16"}[dt]

    p.task(K.EMBED, [tok, w["embed"]], [a["x"]])
    p.task(K.RMSNORM, [a["x"], w["n1"]], [a["h"]], {"eps": 1e-5})
    for i in range(2):                                    # two column tiles of wq
        n = n_heads * hd // 2
        p.task(K.GEMV_TILE, [a["h"], w["wq"]], [a["q"]], {"n_off": i * n, "N_tile": n, "K": H})
    p.task(K.GEMV_TILE, [a["h"], w["wk"]], [a["k"]], {"n_off": 0, "N_tile": n_kv * hd, "K": H})
    p.task(K.GEMV_TILE, [a["h"], w["wv"]], [a["v"]], {"n_off": 0, "N_tile": n_kv * hd, "K": H})
    p.task(K.ROPE, [a["q"], pos], [a["qr"]], {"head_dim": hd, "theta": 10000.0})
    p.task(K.ROPE, [a["k"], pos, inv_freq], [a["kr"]], {"head_dim": hd})
    p.task(K.KV_APPEND, [a["kr"], pos], [kc])
    p.task(K.KV_APPEND, [a["v"], pos], [vc])
    att = {"head_dim": hd, "n_heads": n_heads, "n_kv_heads": n_kv, "flags": 2}
    half_h = n_heads // 2
    for part, lo in ((a["p0"], 0), (a["p1"], max_seq // 2)):
        for h_off in (0, half_h):                         # two head ranges per shard
            p.task(K.ATTENTION_TILE, [a["qr"], kc, vc, pos], [part],
                   dict(att, kv_start=lo, kv_len=max_seq // 2, h_off=h_off, h_count=half_h))
    p.task(K.ATTENTION_COMBINE, [a["p0"], a["p1"]], [a["att"]],
           {"head_dim": hd, "n_heads": n_heads})
    p.task(K.FUSED, [a["att"], w["wo"], a["x"]], [a["x2"]], {"recipe": {"steps": [
        {"op": int(K.GEMV_TILE), "args": [{"in": 0}, {"in": 1}], "out": 0,
         "params": {"n_off": 0, "N_tile": H, "K": n_heads * hd}, "out_shape": [1, H],
         "out_dtype": sd},
        {"op": int(K.ADD), "args": [{"s": 0}, {"in": 2}], "out": "final", "params": {}}]}},
        name="o_proj+residual")
    p.task(K.FUSED, [a["x2"], w["n2"], w["wg"], w["wu"]], [a["act"]], {"recipe": {"steps": [
        {"op": int(K.RMSNORM), "args": [{"in": 0}, {"in": 1}], "out": 0,
         "params": {"eps": 1e-5}, "out_shape": [1, H], "out_dtype": sd},
        {"op": int(K.GEMV_TILE), "args": [{"s": 0}, {"in": 2}], "out": 1,
         "params": {"n_off": 0, "N_tile": F, "K": H},
         "out_shape": [1, F], "out_dtype": sd},
        {"op": int(K.GEMV_TILE), "args": [{"s": 0}, {"in": 3}], "out": 2,
         "params": {"n_off": 0, "N_tile": F, "K": H},
         "out_shape": [1, F], "out_dtype": sd},
        {"op": int(K.SILU_MUL), "args": [{"s": 1}, {"s": 2}], "out": "final", "params": {}}]}},
        name="norm+gate/up+silu")
    p.task(K.GEMV_TILE, [a["act"], w["wd"]], [a["y"]], {"n_off": 0, "N_tile": H, "K": F})
    p.task(K.ADD, [a["y"], a["x2"]], [a["x3"]])
    p.task(K.RMSNORM, [a["x3"], w["nf"]], [a["hf"]], {"eps": 1e-5})
    for i in range(2):
        p.task(K.GEMV_TILE, [a["hf"], w["lm"]], [logits], {"n_off": i * V // 2, "N_tile": V // 2,
                                                          "K": H})
    p.task(K.SAMPLE_ARGMAX, [logits], [ids])
    program = p.build([logits, ids, kc, vc], "decode_layer")

    def make_bindings(device, seed=0):
        g = torch.Generator().manual_seed(seed)
        b = {}
        for buf in program.buffers:
            if buf.kind == BK.WEIGHT:
                t = torch.randn(buf.shape, generator=g) / math.sqrt(buf.shape[-1])
                if len(buf.shape) == 1:
                    t = 1.0 + 0.1 * t
                b[buf.source] = t.to(device, buf.dtype.torch)
        b["rope.inv_freq"] = (1.0 / 500000.0 ** (torch.arange(hd // 2) / (hd // 2))).float().to(device)
        for name in ("kv.k", "kv.v"):
            b[name] = (torch.randn(max_seq, n_kv, hd, generator=g) * 0.5).to(device, dt.torch)
        b["token"] = torch.tensor([7], dtype=torch.int32, device=device)
        b["pos"] = torch.tensor([0], dtype=torch.int32, device=device)
        return b

    return program, make_bindings


def run_steps_vs_reference(program, make_bindings, device, steps, capture_graph=False,
                           tol=1e-4, exact_ids=True):
    """Run `steps` (token, pos) pairs through TritonProgram and the ReferenceVM from the same
    start state; compare logits, ids and both KV caches after every step."""
    from amk.backends.reference.vm import ReferenceVM
    from amk.backends.triton.backend import TritonProgram
    ours, ref = make_bindings(device), make_bindings(device)
    tp = TritonProgram(program, device=device, capture_graph=capture_graph)
    vm = ReferenceVM(program, device=device)
    for token, pos in steps:
        for b in (ours, ref):
            b["token"] = torch.tensor([token], dtype=torch.int32, device=device)
            b["pos"] = torch.tensor([pos], dtype=torch.int32, device=device)
        got, want = tp.run(ours), vm.run(ref)
        assert got[2] is ours["kv.k"] and got[3] is ours["kv.v"]       # updated in place
        torch.testing.assert_close(got[0], want[0], rtol=tol, atol=tol)
        if exact_ids:
            assert torch.equal(got[1], want[1])
        for g, w in zip(got[2:], want[2:]):
            torch.testing.assert_close(g.float(), w.float(), rtol=tol, atol=tol)
    return tp


# ------------------------------------------------------------------------------ per-op, CUDA
def _case_inputs(op, dt, dev):
    """(inputs, output shapes/dtypes, params) of one random case per opcode."""
    r = lambda *s: torch.randn(*s, device=dev).to(dt)                     # noqa: E731
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)       # noqa: E731
    hd, nh, nkv, S = 64, 8, 2, 300
    att = {"head_dim": hd, "n_heads": nh, "n_kv_heads": nkv}
    cases = {
        K.COPY: ([r(4, 1000)], [((4, 1000), dt)], {"n_off": 100, "N_tile": 600}),
        K.ADD: ([r(2, 1000), r(2, 1000)], [((2, 1000), dt)], {}),
        K.MUL: ([r(2, 1000)], [((2, 1000), dt)], {"scale": 0.5}),
        K.GELU: ([r(2, 1000)], [((2, 1000), dt)], {}),
        K.SILU_MUL: ([r(1, 2048), r(1, 2048)], [((1, 2048), dt)], {"n_off": 1024, "N_tile": 512}),
        K.SOFTMAX: ([r(3, 5000)], [((3, 5000), torch.float32)], {}),
        K.ALLREDUCE_SHARD: ([r(1, 777) for _ in range(5)], [((1, 777), dt)], {}),
        K.RMSNORM: ([r(2, 2048), r(2048)], [((2, 2048), dt)], {"eps": 1e-5}),
        K.LAYERNORM: ([r(2, 2048), r(2048), r(2048)], [((2, 2048), dt)], {}),
        K.EMBED: ([i32([5, 999]), r(1000, 2048)], [((2, 2048), dt)], {}),
        K.SAMPLE_ARGMAX: ([r(2, 50000)], [((2,), torch.int32)], {}),
        K.GEMV_TILE: ([r(1, 2048), r(1024, 2048)], [((1, 1024), dt)],
                      {"n_off": 256, "N_tile": 512}),
        K.GEMM_TILE: ([r(3, 1000), r(96, 1000), r(96)], [((3, 96), dt)], {}),
        K.ROPE: ([r(1, nh * hd), i32([123])], [((1, nh * hd), dt)], {"head_dim": hd,
                                                                     "theta": 500000.0}),
        K.KV_APPEND: ([r(1, nkv * hd), i32([17])], [], {}),
        K.ATTENTION_TILE: ([r(1, nh * hd), r(S, nkv, hd), r(S, nkv, hd), i32([250])],
                           [((1, nh * hd), dt)], att),
        K.ATTENTION_COMBINE: (None, [((1, nh * hd), dt)], {"head_dim": hd, "n_heads": nh}),
    }
    return cases[op]


OPS = [K.COPY, K.ADD, K.MUL, K.GELU, K.SILU_MUL, K.SOFTMAX, K.ALLREDUCE_SHARD, K.RMSNORM,
       K.LAYERNORM, K.EMBED, K.SAMPLE_ARGMAX, K.GEMV_TILE, K.GEMM_TILE, K.ROPE, K.KV_APPEND,
       K.ATTENTION_TILE, K.ATTENTION_COMBINE]


@needs_cuda
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("op", OPS, ids=[o.name for o in OPS])
def test_op_matches_reference_on_cuda(op, dt):
    from amk.backends.reference.semantics import semantics_for
    from amk.backends.triton.launch import launch_op
    torch.manual_seed(int(op))
    dev = "cuda"
    ins, outs_spec, params = _case_inputs(op, dt, dev)
    if op == K.ATTENTION_COMBINE:                       # partials from the tile kernel itself
        q, k, v = (torch.randn(1, 512, device=dev).to(dt), torch.randn(300, 2, 64, device=dev).to(dt),
                   torch.randn(300, 2, 64, device=dev).to(dt))
        ins = []
        for lo in (0, 128, 256):                        # the last shard is cut short by pos
            part = torch.empty(8, 66, device=dev)
            launch_op(K.ATTENTION_TILE, [q, k, v, torch.tensor([200], device=dev, dtype=torch.int32)],
                      [part], {"head_dim": 64, "n_heads": 8, "n_kv_heads": 2, "flags": 2,
                               "kv_start": lo, "kv_len": 128})
            ins.append(part)
    if op == K.KV_APPEND:
        outs = [torch.randn(64, 2, 64, device=dev).to(dt)]
    else:
        outs = [torch.full(s, float("nan") if d.is_floating_point else -1, dtype=d, device=dev)
                for s, d in outs_spec]
    ref = [o.clone() for o in outs]
    launch_op(op, ins, outs, params)
    semantics_for(op)([x.clone() for x in ins], ref, params, None)
    tol = 1e-4 if dt == torch.float32 else 2e-2
    for g, w in zip(outs, ref):
        if g.dtype.is_floating_point:
            torch.testing.assert_close(g.float(), w.float(), rtol=tol, atol=tol, equal_nan=True)
        else:
            assert torch.equal(g, w)


@needs_cuda
@pytest.mark.parametrize("int4", [False, True], ids=["int8", "int4"])
def test_quantized_gemv_and_dequant_on_cuda(int4):
    from amk.backends.reference.semantics import semantics_for
    from amk.backends.triton.launch import launch_op
    dev, N, Kd, group = "cuda", 512, 2048, 128
    torch.manual_seed(1)
    qw = (torch.randint(0, 256, (N, Kd // 2), dtype=torch.uint8) if int4
          else torch.randint(-128, 128, (N, Kd), dtype=torch.int8)).to(dev)
    s = (torch.rand(N, Kd // group, device=dev) * 0.02).to(torch.bfloat16)
    z = torch.randint(-2, 3, (N, Kd // group), device=dev).to(torch.bfloat16)
    x = torch.randn(1, Kd, device=dev).to(torch.bfloat16)
    params = {"qdtype": 7 if int4 else 6, "group": group, "K": Kd, "n_off": 128, "N_tile": 256}
    for op, ins, shape in ((K.GEMV_TILE, [x, qw, s, z], (1, N)),
                           (K.DEQUANT, [qw, s, z], (N, Kd))):
        got = torch.full(shape, float("nan"), device=dev, dtype=torch.float32)
        want = got.clone()
        launch_op(op, ins, [got], params)
        semantics_for(op)(ins, [want], params, None)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3, equal_nan=True)


@needs_cuda
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prompt_block_gemm_on_cuda(dt):
    """fp32 weights get fp32 products (tl.dot's fp32 default, tf32, is off by ~1e-3 relative:
    it made fp32 models' triton prefill differ from the reference VM)."""
    from amk.backends.triton.launch import launch_op
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(40, 512, generator=g), torch.randn(96, 512, generator=g)
    b = torch.randn(96, generator=g)
    xd, wd, bd = (t.to("cuda", dt) for t in (x, w, b))
    out = torch.full((40, 96), float("nan"), device="cuda", dtype=torch.float32)
    launch_op(K.GEMM_TILE, [xd, wd, bd], [out], {"n_off": 16, "N_tile": 64, "K": 512})
    want = (xd.double() @ wd[16:80].double().T + bd[16:80].double()).float().cpu()
    tol = 1e-4 if dt == torch.float32 else 2e-2
    torch.testing.assert_close(out[:, 16:80].cpu(), want, rtol=tol, atol=tol * 10)
    assert out[:, :16].isnan().all() and out[:, 80:].isnan().all()


@needs_cuda
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M,N,Kd", [(512, 8192, 1024), (512, 2048, 2048), (300, 512, 520),
                                    (16, 4096, 2048), (100, 200, 96)])
def test_prompt_gemm_tile_shapes_on_cuda(M, N, Kd, dt):
    """Each tile choice of kernels_gemm.gemm_config (128x128, 128x64, 64x64 with a K tail,
    16-row blocks, 64/32 rows), with a bias, against float64."""
    from amk.backends.triton.launch import launch_op
    g = torch.Generator().manual_seed(M + N)
    xd, wd, bd = (t.to("cuda", dt) for t in (torch.randn(M, Kd, generator=g),
                                             torch.randn(N, Kd, generator=g) / Kd ** 0.5,
                                             torch.randn(N, generator=g)))
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.float32)
    launch_op(K.GEMM_TILE, [xd, wd, bd], [out], {"n_off": 0, "N_tile": N, "K": Kd})
    want = (xd.double() @ wd.double().T + bd.double()).float()
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


@needs_cuda
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n_heads,n_kv,hd,R,start", [(32, 8, 64, 512, 488), (16, 8, 128, 128, 0),
                                                     (8, 4, 256, 16, 900), (4, 4, 64, 37, 5)])
def test_prompt_block_attention_on_cuda(n_heads, n_kv, hd, R, start, dt):
    """The flash-style block attention (kernels_block_attention) of a prompt chunk over the
    cache rows before it plus its own causal part, rows in a padded chunk's order, against
    float64 math on the same (rounded) operands."""
    from amk.backends.triton.launch import launch_op
    g = torch.Generator().manual_seed(hd + R)
    S = 1272
    q = torch.randn(R, n_heads * hd, generator=g).to("cuda", dt)
    kc = torch.randn(S, n_kv, hd, generator=g).to("cuda", dt)
    vc = torch.randn(S, n_kv, hd, generator=g).to("cuda", dt)
    pos = torch.arange(start, start + R, dtype=torch.int32)
    pos[R // 2:-1], pos[-1] = pos[R // 2 + 1:].clone(), int(pos[R // 2])
    out = torch.full((R, n_heads * hd), float("nan"), device="cuda", dtype=torch.float32)
    launch_op(K.ATTENTION_TILE, [q, kc, vc, pos.cuda()], [out],
              {"head_dim": hd, "n_heads": n_heads, "n_kv_heads": n_kv, "scale": hd ** -0.5,
               "kv_start": 0, "kv_len": S, "flags": 0})
    rep = n_heads // n_kv
    want = torch.empty(R, n_heads, hd, dtype=torch.float64, device="cuda")
    for t, p in enumerate(pos.tolist()):
        kk = kc[:p + 1].double().repeat_interleave(rep, dim=1)
        vv = vc[:p + 1].double().repeat_interleave(rep, dim=1)
        s = torch.einsum("hd,nhd->hn", q[t].double().view(n_heads, hd), kk) * hd ** -0.5
        want[t] = torch.einsum("hn,nhd->hd", s.softmax(-1), vv)
    torch.testing.assert_close(out, want.reshape(R, -1).float(), rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------ whole program
STEPS = [(7, 0), (3, 1), (50, 2), (9, 9), (1, 15)]


@needs_cuda
@pytest.mark.parametrize("capture_graph", [False, True], ids=["eager", "graph"])
def test_decode_program_matches_reference_vm_fp32(capture_graph):
    program, make = decode_layer_program(DType.F32)
    run_steps_vs_reference(program, make, "cuda", STEPS, capture_graph=capture_graph)


@needs_cuda
def test_decode_program_bf16_graph_replay():
    program, make = decode_layer_program(DType.BF16)
    tp = run_steps_vs_reference(program, make, "cuda", STEPS, capture_graph=True, tol=5e-2,
                                exact_ids=False)
    assert tp._graph is not None


@needs_cuda
def test_bench_triton_returns_time():
    from amk.backends.triton.bench import bench_triton
    program, make = decode_layer_program(DType.BF16)
    ms = bench_triton(program, make("cuda"), warmup=2, iters=5)
    assert 0 < ms < 1000
