"""Hand-built programs covering every opcode and dtype variant the CUDA templates handle.

Used by the CPU compile tests (tests/backends/cuda: render + NVRTC for sm_90a) and by the GPU
tests (each case run
alone against the reference semantics). Each case is one task over fresh buffers; ``bindings``
draws fresh random inputs for every call.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from amk.program.ir import Buffer, BufferKind as BK, Counter, DType as D, InstructionKind as K
from amk.program.ir import Program, Task, Wait


class Builder:
    def __init__(self, name: str = "handbuilt"):
        self.name = name
        self.buffers: list[Buffer] = []
        self.tasks: list[Task] = []
        self.counters: list[Counter] = []
        self.outputs: list[int] = []

    def buf(self, name, kind, dtype, shape) -> int:
        self.buffers.append(Buffer(len(self.buffers), name, kind, dtype, tuple(shape), name))
        return len(self.buffers) - 1

    def counter(self, init: int = 0) -> int:
        self.counters.append(Counter(len(self.counters), init))
        return len(self.counters) - 1

    def task(self, op, ins, outs, params=None, waits=(), out_counter=None, name="") -> int:
        oc = self.counter() if out_counter is None else out_counter
        self.tasks.append(Task(len(self.tasks), op, tuple(ins), tuple(outs), dict(params or {}),
                               tuple(Wait(c, t) for c, t in waits), oc, name or op.name))
        return oc

    def program(self, queues=()) -> Program:
        return Program(tuple(self.buffers), tuple(self.counters), tuple(self.tasks),
                       tuple(tuple(q) for q in queues), self.name, tuple(self.outputs))


@dataclass
class Case:
    name: str
    program: Program
    fill: dict[str, Callable[[torch.Generator], torch.Tensor]] = field(default_factory=dict)

    def bindings(self, device="cpu", seed: int = 0) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return {k: f(g).to(device) for k, f in self.fill.items()}


def _rand(shape, dtype, scale=1.0):
    return lambda g: (torch.randn(shape, generator=g) * scale).to(dtype)


def _ints(shape, lo, hi, dtype=torch.int32):
    return lambda g: torch.randint(lo, hi, shape, generator=g).to(dtype)


def _const(values, dtype=torch.int32):
    return lambda g: torch.tensor(values, dtype=dtype)


def _single(name, op, inputs, outputs, params, fill, out_kinds=None) -> Case:
    """inputs/outputs: [(name, kind, dtype, shape)]."""
    b = Builder(name)
    ins = [b.buf(*spec) for spec in inputs]
    outs = [b.buf(*spec) for spec in outputs]
    b.task(op, ins, outs, params)
    b.outputs = outs
    return Case(name, b.program(), fill)


def _quant_fill(N, Kd, group, bits, zeros):
    ng = math.ceil(Kd / group)
    f = {"x": _rand((1, Kd), torch.bfloat16),
         "scales": lambda g: (torch.rand((N, ng), generator=g) * 0.05 + 0.01).to(torch.bfloat16)}
    if bits == 8:
        f["qw"] = _ints((N, Kd), -128, 128, torch.int8)
    else:
        f["qw"] = _ints((N, (Kd + 1) // 2), 0, 256, torch.uint8)
    if zeros:
        f["zeros"] = lambda g: torch.randint(-3, 4, (N, ng), generator=g).to(torch.bfloat16)
    return f


def cases() -> list[Case]:
    bf, f16, f32, i32 = D.BF16, D.F16, D.F32, D.I32
    tb, th, tf = torch.bfloat16, torch.float16, torch.float32
    C: list[Case] = []
    C.append(_single("nop", K.NOP, [], [], {}, {}))
    C.append(_single("copy_bf16_f32_tile", K.COPY, [("x", BK.IO_INPUT, bf, (3, 40))],
                     [("y", BK.IO_OUTPUT, f32, (3, 40))], {"n_off": 8, "N_tile": 24},
                     {"x": _rand((3, 40), tb)}))
    C.append(_single("add_bcast_tile", K.ADD, [("a", BK.IO_INPUT, bf, (2, 64)), ("b", BK.WEIGHT, f32, (64,))],
                     [("y", BK.IO_OUTPUT, bf, (2, 64))], {"n_off": 16, "N_tile": 32},
                     {"a": _rand((2, 64), tb), "b": _rand((64,), tf)}))
    C.append(_single("mul_f16", K.MUL, [("a", BK.IO_INPUT, f16, (100,)), ("b", BK.IO_INPUT, f16, (100,))],
                     [("y", BK.IO_OUTPUT, f16, (100,))], {}, {"a": _rand((100,), th), "b": _rand((100,), th)}))
    C.append(_single("mul_scale", K.MUL, [("a", BK.IO_INPUT, f32, (5, 7))],
                     [("y", BK.IO_OUTPUT, f32, (5, 7))], {"scale": 0.37}, {"a": _rand((5, 7), tf)}))
    C.append(_single("silu_mul_bf16", K.SILU_MUL, [("g", BK.IO_INPUT, bf, (1, 256)), ("u", BK.IO_INPUT, bf, (1, 256))],
                     [("y", BK.IO_OUTPUT, bf, (1, 256))], {"n_off": 64, "N_tile": 128},
                     {"g": _rand((1, 256), tb, 3), "u": _rand((1, 256), tb)}))
    C.append(_single("gelu_f32", K.GELU, [("x", BK.IO_INPUT, f32, (4, 33))], [("y", BK.IO_OUTPUT, f32, (4, 33))],
                     {}, {"x": _rand((4, 33), tf, 2)}))
    C.append(_single("allreduce3", K.ALLREDUCE_SHARD, [(f"s{i}", BK.IO_INPUT, bf, (1, 96)) for i in range(3)],
                     [("y", BK.IO_OUTPUT, bf, (1, 96))], {}, {f"s{i}": _rand((1, 96), tb) for i in range(3)}))
    C.append(_single("sum4_f32_tile", K.SUM, [(f"p{i}", BK.IO_INPUT, f32, (16, 96)) for i in range(4)],
                     [("y", BK.IO_OUTPUT, bf, (16, 96))], {"n_off": 32, "N_tile": 48},
                     {f"p{i}": _rand((16, 96), tf) for i in range(4)}))
    C.append(_single("rmsnorm_bf16", K.RMSNORM, [("x", BK.IO_INPUT, bf, (2, 320)), ("w", BK.WEIGHT, bf, (320,))],
                     [("y", BK.IO_OUTPUT, bf, (2, 320))], {"eps": 1e-5},
                     {"x": _rand((2, 320), tb, 2), "w": _rand((320,), tb)}))
    # per-head norms (Qwen3's q/k norm: a warp a row), more rows than warps, a ragged row
    C.append(_single("rmsnorm_heads_bf16", K.RMSNORM, [("x", BK.IO_INPUT, bf, (1, 2048)), ("w", BK.WEIGHT, bf, (128,))],
                     [("y", BK.IO_OUTPUT, bf, (1, 2048))], {"eps": 1e-6},
                     {"x": _rand((1, 2048), tb, 2), "w": _rand((128,), tb)}))
    C.append(_single("rmsnorm_rows_f32", K.RMSNORM, [("x", BK.IO_INPUT, f32, (40, 96)), ("w", BK.WEIGHT, f32, (96,))],
                     [("y", BK.IO_OUTPUT, f32, (40, 96))], {"eps": 1e-5},
                     {"x": _rand((40, 96), tf, 2), "w": _rand((96,), tf)}))
    C.append(_single("layernorm_f32_bias", K.LAYERNORM,
                     [("x", BK.IO_INPUT, f32, (3, 48)), ("w", BK.WEIGHT, f32, (48,)), ("b", BK.WEIGHT, f32, (48,))],
                     [("y", BK.IO_OUTPUT, f16, (3, 48))], {"eps": 1e-5},
                     {"x": _rand((3, 48), tf, 2), "w": _rand((48,), tf), "b": _rand((48,), tf)}))
    C.append(_single("gemv_bf16_bias_tile", K.GEMV_TILE,
                     [("x", BK.IO_INPUT, bf, (1, 256)), ("W", BK.WEIGHT, bf, (96, 256)), ("bias", BK.WEIGHT, bf, (96,))],
                     [("y", BK.IO_OUTPUT, bf, (1, 96))], {"n_off": 16, "N_tile": 48, "K": 256},
                     {"x": _rand((1, 256), tb), "W": _rand((96, 256), tb, 0.1), "bias": _rand((96,), tb)}))
    # short rows, four row groups an item (encoders.direct_sr), a ragged last group
    C.append(_single("gemv_bf16_k256_sr4", K.GEMV_TILE,
                     [("x", BK.IO_INPUT, bf, (1, 256)), ("W", BK.WEIGHT, bf, (160, 256))],
                     [("y", BK.IO_OUTPUT, f32, (1, 160))], {"n_off": 3, "N_tile": 127, "K": 256},
                     {"x": _rand((1, 256), tb), "W": _rand((160, 256), tb, 0.1)}))
    # long rows: 4 KiB rows (20 of them, bias); 16 KiB rows (a down projection's, 5 of them)
    C.append(_single("gemv_bf16_stream_k2048", K.GEMV_TILE,
                     [("x", BK.IO_INPUT, f16, (1, 2048)), ("W", BK.WEIGHT, bf, (40, 2048)), ("bias", BK.WEIGHT, f32, (40,))],
                     [("y", BK.IO_OUTPUT, bf, (1, 40))], {"n_off": 8, "N_tile": 20, "K": 2048},
                     {"x": _rand((1, 2048), th), "W": _rand((40, 2048), tb, 0.05), "bias": _rand((40,), tf)}))
    C.append(_single("gemv_bf16_stream_k8192", K.GEMV_TILE,
                     [("x", BK.IO_INPUT, bf, (1, 8192)), ("W", BK.WEIGHT, bf, (8, 8192))],
                     [("y", BK.IO_OUTPUT, f32, (1, 8))], {"n_off": 1, "N_tile": 5, "K": 8192},
                     {"x": _rand((1, 8192), tb), "W": _rand((8, 8192), tb, 0.02)}))
    C.append(_single("gemv_f32_batched_novec", K.GEMV_TILE,
                     [("x", BK.IO_INPUT, f32, (3, 100)), ("W", BK.WEIGHT, f32, (40, 100))],
                     [("y", BK.IO_OUTPUT, f32, (3, 40))], {"n_off": 0, "N_tile": 40, "K": 100},
                     {"x": _rand((3, 100), tf), "W": _rand((40, 100), tf, 0.1)}))
    C.append(_single("gemm_f16_m5", K.GEMM_TILE,
                     [("x", BK.IO_INPUT, f16, (5, 64)), ("W", BK.WEIGHT, f16, (24, 64))],
                     [("y", BK.IO_OUTPUT, f32, (5, 24))], {"n_off": 8, "N_tile": 16, "K": 64},
                     {"x": _rand((5, 64), th), "W": _rand((24, 64), th, 0.1)}))
    for bits, Kd, group, zeros in ((8, 128, 32, True), (8, 72, 24, False), (4, 256, 64, False),
                                   (4, 40, 16, True)):
        N = 32
        q_dt = D.I8 if bits == 8 else D.U8
        qshape = (N, Kd) if bits == 8 else (N, (Kd + 1) // 2)
        ng = math.ceil(Kd / group)
        ins = [("x", BK.IO_INPUT, bf, (1, Kd)), ("qw", BK.WEIGHT, q_dt, qshape), ("scales", BK.WEIGHT, bf, (N, ng))]
        if zeros:
            ins.append(("zeros", BK.WEIGHT, bf, (N, ng)))
        C.append(_single(f"gemv_i{bits}_k{Kd}_g{group}{'_z' if zeros else ''}", K.GEMV_TILE, ins,
                         [("y", BK.IO_OUTPUT, bf, (1, N))],
                         {"n_off": 8, "N_tile": 16, "K": Kd, "qdtype": int(D.I8 if bits == 8 else D.I4),
                          "group": group}, _quant_fill(N, Kd, group, bits, zeros)))
    C.append(_single("rope_bf16_theta_tile", K.ROPE, [("x", BK.IO_INPUT, bf, (1, 4 * 32)), ("pos", BK.IO_INPUT, i32, (1,))],
                     [("y", BK.IO_OUTPUT, bf, (1, 4 * 32))], {"head_dim": 32, "theta": 10000.0, "n_off": 32, "N_tile": 64},
                     {"x": _rand((1, 128), tb), "pos": _const([57])}))
    C.append(_single("rope_f32_invfreq", K.ROPE,
                     [("x", BK.IO_INPUT, f32, (2, 3 * 16)), ("pos", BK.IO_INPUT, i32, (1,)), ("inv", BK.CONST, f32, (8,))],
                     [("y", BK.IO_OUTPUT, f32, (2, 3 * 16))], {"head_dim": 16},
                     {"x": _rand((2, 48), tf), "pos": _const([1000]),
                      "inv": lambda g: torch.rand(8, generator=g) * 0.5}))
    hd, nh, nkv, S = 64, 8, 2, 80
    att_fill = lambda B, pos: {"q": _rand((B, nh * hd), tb), "k": _rand((B, S, nkv, hd), tb),
                               "v": _rand((B, S, nkv, hd), tb), "pos": _const([pos])}
    C.append(_single("attention_gqa_bf16", K.ATTENTION_TILE,
                     [("q", BK.IO_INPUT, bf, (1, nh * hd)), ("k", BK.KV_CACHE, bf, (S, nkv, hd)),
                      ("v", BK.KV_CACHE, bf, (S, nkv, hd)), ("pos", BK.IO_INPUT, i32, (1,))],
                     [("y", BK.IO_OUTPUT, bf, (1, nh * hd))], {"head_dim": hd, "n_heads": nh, "n_kv_heads": nkv},
                     att_fill(1, 37) | {"k": _rand((S, nkv, hd), tb), "v": _rand((S, nkv, hd), tb)}))
    C.append(_single("attention_partial_heads", K.ATTENTION_TILE,
                     [("q", BK.IO_INPUT, bf, (1, nh * hd)), ("k", BK.KV_CACHE, bf, (S, nkv, hd)),
                      ("v", BK.KV_CACHE, bf, (S, nkv, hd)), ("pos", BK.IO_INPUT, i32, (1,))],
                     [("y", BK.IO_OUTPUT, f32, (nh, hd + 2))],
                     {"head_dim": hd, "n_heads": nh, "n_kv_heads": nkv, "kv_start": 16, "kv_len": 32,
                      "flags": 2, "h_off": 4, "h_count": 4},
                     {"q": _rand((1, nh * hd), tb), "k": _rand((S, nkv, hd), tb), "v": _rand((S, nkv, hd), tb),
                      "pos": _const([70])}))
    C.append(_single("attention_empty_shard", K.ATTENTION_TILE,
                     [("q", BK.IO_INPUT, bf, (1, nh * hd)), ("k", BK.KV_CACHE, bf, (S, nkv, hd)),
                      ("v", BK.KV_CACHE, bf, (S, nkv, hd)), ("pos", BK.IO_INPUT, i32, (1,))],
                     [("y", BK.IO_OUTPUT, f32, (nh, hd + 2))],
                     {"head_dim": hd, "n_heads": nh, "n_kv_heads": nkv, "kv_start": 48, "kv_len": 32, "flags": 2},
                     {"q": _rand((1, nh * hd), tb), "k": _rand((S, nkv, hd), tb), "v": _rand((S, nkv, hd), tb),
                      "pos": _const([20])}))
    C.append(_single("attention_batched_long", K.ATTENTION_TILE,
                     [("q", BK.IO_INPUT, f16, (2, 4 * 32)), ("k", BK.KV_CACHE, f16, (2, 700, 4, 32)),
                      ("v", BK.KV_CACHE, f16, (2, 700, 4, 32)), ("pos", BK.IO_INPUT, i32, (1,))],
                     [("y", BK.IO_OUTPUT, f16, (2, 4 * 32))], {"head_dim": 32, "n_heads": 4, "n_kv_heads": 4},
                     {"q": _rand((2, 128), th), "k": _rand((2, 700, 4, 32), th), "v": _rand((2, 700, 4, 32), th),
                      "pos": _const([650])}))
    for name, nq, nk, d, dt, tt in (("attention_rep3_f32", 9, 3, 64, f32, tf),       # 3 heads a pass
                                    ("attention_rep12_hd128", 24, 2, 128, bf, tb)):  # 2 passes of 6
        C.append(_single(name, K.ATTENTION_TILE,
                         [("q", BK.IO_INPUT, dt, (1, nq * d)), ("k", BK.KV_CACHE, dt, (S, nk, d)),
                          ("v", BK.KV_CACHE, dt, (S, nk, d)), ("pos", BK.IO_INPUT, i32, (1,))],
                         [("y", BK.IO_OUTPUT, dt, (1, nq * d))], {"head_dim": d, "n_heads": nq, "n_kv_heads": nk},
                         {"q": _rand((1, nq * d), tt), "k": _rand((S, nk, d), tt), "v": _rand((S, nk, d), tt),
                          "pos": _const([61])}))
    P = 3

    def _partials(nh, hd):
        def fill(g):
            t = torch.randn(nh, hd + 2, generator=g)
            t[:, hd + 1] = torch.rand(nh, generator=g) * 5 + 0.1
            return t
        return fill

    def _empty(nh, hd):
        def fill(g):
            t = torch.zeros(nh, hd + 2)
            t[:, hd] = float("-inf")
            return t
        return fill
    # the staged merge's lanes read 16 apart at hd 64 (5 heads: 2.5 warps' chunks of 128), 32 apart
    # at 128 and 4 apart at 80 (comb_stride)
    for name, hd_c, nh_c, h_off, h_count in (("combine3_one_empty", hd, nh, 2, 5),
                                             ("combine3_hd128", 128, 6, 1, 3), ("combine3_hd80", 80, 4, 0, 4)):
        C.append(_single(name, K.ATTENTION_COMBINE,
                         [(f"p{i}", BK.IO_INPUT, f32, (nh_c, hd_c + 2)) for i in range(P)],
                         [("y", BK.IO_OUTPUT, bf, (1, nh_c * hd_c))],
                         {"head_dim": hd_c, "n_heads": nh_c, "h_off": h_off, "h_count": h_count},
                         {"p0": _partials(nh_c, hd_c), "p1": _empty(nh_c, hd_c), "p2": _partials(nh_c, hd_c)}))
    C.append(_single("embed_bf16", K.EMBED, [("ids", BK.IO_INPUT, i32, (2,)), ("table", BK.WEIGHT, bf, (50, 64))],
                     [("y", BK.IO_OUTPUT, bf, (2, 64))], {}, {"ids": _ints((2,), 0, 50), "table": _rand((50, 64), tb)}))
    C.append(_single("kv_append_rank3", K.KV_APPEND, [("new", BK.IO_INPUT, bf, (1, nkv * hd)), ("pos", BK.IO_INPUT, i32, (1,))],
                     [("cache", BK.KV_CACHE, bf, (S, nkv, hd))], {},
                     {"new": _rand((1, nkv * hd), tb), "pos": _const([33]), "cache": _rand((S, nkv, hd), tb)}))
    C.append(_single("kv_append_batched", K.KV_APPEND, [("new", BK.IO_INPUT, f32, (3, 2, 16)), ("pos", BK.IO_INPUT, i32, (1,))],
                     [("cache", BK.KV_CACHE, bf, (3, 20, 2, 16))], {},
                     {"new": _rand((3, 2, 16), tf), "pos": _const([19]), "cache": _rand((3, 20, 2, 16), tb)}))
    C.append(_single("argmax_bf16", K.SAMPLE_ARGMAX, [("x", BK.IO_INPUT, bf, (2, 3000))],
                     [("y", BK.IO_OUTPUT, i32, (2,))], {}, {"x": _rand((2, 3000), tb)}))
    C.append(_single("softmax_f32", K.SOFTMAX, [("x", BK.IO_INPUT, f32, (3, 77))],
                     [("y", BK.IO_OUTPUT, bf, (3, 77))], {}, {"x": _rand((3, 77), tf, 3)}))
    C.append(_single("dequant_i4_packed", K.DEQUANT,
                     [("qw", BK.WEIGHT, D.U8, (16, 32)), ("scales", BK.WEIGHT, bf, (16, 2)), ("zeros", BK.WEIGHT, bf, (16, 2))],
                     [("y", BK.IO_OUTPUT, bf, (16, 64))], {"qdtype": int(D.I4), "group": 32, "K": 64},
                     {"qw": _ints((16, 32), 0, 256, torch.uint8), "scales": _rand((16, 2), tb),
                      "zeros": _ints((16, 2), -2, 3, torch.bfloat16)}))
    C.append(_single("dequant_i8", K.DEQUANT, [("qw", BK.WEIGHT, D.I8, (8, 48)), ("scales", BK.WEIGHT, f32, (8, 3))],
                     [("y", BK.IO_OUTPUT, f32, (8, 48))], {"qdtype": int(D.I8), "group": 16},
                     {"qw": _ints((8, 48), -128, 128, torch.int8), "scales": _rand((8, 3), tf)}))
    C.append(_single("gemv_f32_k1000_odd_rows", K.GEMV_TILE,     # f32 rows of 250 vectors, 37 rows
                     [("x", BK.IO_INPUT, bf, (1, 1000)), ("W", BK.WEIGHT, f32, (50, 1000))],
                     [("y", BK.IO_OUTPUT, bf, (1, 50))], {"n_off": 13, "N_tile": 37, "K": 1000},
                     {"x": _rand((1, 1000), tb), "W": _rand((50, 1000), tf, 0.05)}))
    C.append(_single("combine20_many_heads", K.ATTENTION_COMBINE,   # 20 x 40 > 512: the slow path
                     [(f"p{i}", BK.IO_INPUT, f32, (1, 40 * 18)) for i in range(20)],
                     [("y", BK.IO_OUTPUT, f32, (1, 40 * 16))], {"head_dim": 16, "n_heads": 40},
                     {f"p{i}": _partial(40, 16, empty_head=i % 3 if i % 2 else None)
                      for i in range(20)}))
    # NEW_KV (flags 4): row pos comes from k_new / v_new; staged (bf16) in the window, at its
    # first row, past it; unstaged (f16 rows of 24 bytes, op_attention) in the window
    for name, dt, tt, d, lo, ln, pos in (("attention_new_kv_bf16", bf, tb, hd, 16, 48, 40),
                                         ("attention_new_kv_first_row", bf, tb, hd, 16, 48, 16),
                                         ("attention_new_kv_past_window", bf, tb, hd, 0, 32, 50),
                                         ("attention_new_kv_unstaged_f16", f16, th, 12, 0, S, 77)):
        C.append(_single(name, K.ATTENTION_TILE,
                         [("q", BK.IO_INPUT, dt, (1, nh * d)), ("k", BK.KV_CACHE, dt, (S, nkv, d)),
                          ("v", BK.KV_CACHE, dt, (S, nkv, d)), ("pos", BK.IO_INPUT, i32, (1,)),
                          ("k_new", BK.IO_INPUT, f32, (1, nkv * d)), ("v_new", BK.IO_INPUT, f32, (1, nkv * d))],
                         [("y", BK.IO_OUTPUT, f32, (nh, d + 2))],
                         {"head_dim": d, "n_heads": nh, "n_kv_heads": nkv, "kv_start": lo, "kv_len": ln,
                          "flags": 2 | 4},
                         {"q": _rand((1, nh * d), tt), "k": _rand((S, nkv, d), tt), "v": _rand((S, nkv, d), tt),
                          "pos": _const([pos]), "k_new": _rand((1, nkv * d), tf, 3), "v_new": _rand((1, nkv * d), tf, 3)}))
    C.append(fused_case())
    C.append(gate_up_case())
    C.append(combine_o_add_case())
    C.append(rope_new_kv_attention_case())
    from amk.testing import cuda_examples_models as examples_models   # issue 25's ops (soft-cap, windows, ...)
    C.extend(examples_models.cases())
    from amk.testing import cuda_examples_live as examples_live   # split-KV's live shard count
    C.extend(examples_live.cases())
    return C


def rope_new_kv_attention_case() -> Case:
    """An attention shard as defer_kv_append + fuse leave it: the whole new k row's rope, its
    kv group's q rope, then the NEW_KV attention reading both scratches (lower folds both ropes
    into op_attention_smem: K_ROPE, Q_ROPE, one inv_freq input)."""
    hd, nh, nkv, S = 64, 8, 2, 96
    b = Builder("rope_new_kv_attention")
    q = b.buf("q", BK.IO_INPUT, D.BF16, (1, nh * hd))
    k = b.buf("k", BK.KV_CACHE, D.BF16, (S, nkv, hd))
    v = b.buf("v", BK.KV_CACHE, D.BF16, (S, nkv, hd))
    pos = b.buf("pos", BK.IO_INPUT, D.I32, (1,))
    inv = b.buf("inv", BK.CONST, D.F32, (hd // 2,))
    kn = b.buf("k_new", BK.IO_INPUT, D.BF16, (1, nkv * hd))
    vn = b.buf("v_new", BK.IO_INPUT, D.BF16, (1, nkv * hd))
    y = b.buf("y", BK.IO_OUTPUT, D.F32, (nh, hd + 2))
    rope = {"head_dim": hd, "theta": 500000.0}
    steps = [
        {"op": int(K.ROPE), "args": [{"in": 5}, {"in": 3}, {"in": 4}], "out": 0, "params": rope,
         "out_shape": [1, nkv * hd], "out_dtype": "bfloat16"},
        {"op": int(K.ROPE), "args": [{"in": 0}, {"in": 3}, {"in": 4}], "out": 1,
         "params": {**rope, "n_off": 4 * hd, "N_tile": 4 * hd}, "out_shape": [1, nh * hd],
         "out_dtype": "bfloat16"},
        {"op": int(K.ATTENTION_TILE), "args": [{"s": 1}, {"in": 1}, {"in": 2}, {"in": 3}, {"s": 0}, {"in": 6}],
         "out": "final", "params": {"head_dim": hd, "n_heads": nh, "n_kv_heads": nkv, "kv_start": 32,
                                    "kv_len": 64, "flags": 2 | 4, "h_off": 4, "h_count": 4}},
    ]
    b.task(K.FUSED, [q, k, v, pos, inv, kn, vn], [y], {"recipe": {"steps": steps}})
    b.outputs = [y]
    fill = {"q": _rand((1, nh * hd), torch.bfloat16), "k": _rand((S, nkv, hd), torch.bfloat16),
            "v": _rand((S, nkv, hd), torch.bfloat16), "pos": _const([70]),
            "inv": lambda g: torch.rand(hd // 2, generator=g) * 0.5,
            "k_new": _rand((1, nkv * hd), torch.bfloat16, 2), "v_new": _rand((1, nkv * hd), torch.bfloat16, 2)}
    return Case(b.name, b.program(), fill)


def combine_o_add_case() -> Case:
    """split-KV combine -> o-projection tile -> residual add, one FUSED task (the cuda pass
    options build these): the combine leaves x in shared memory, the GEMV adds the
    residual itself (folds.fold_add)."""
    P, nh, hd, N = 3, 4, 32, 64
    H = nh * hd
    b = Builder("fused_combine_o_add")
    parts = [b.buf(f"part{p}", BK.IO_INPUT, D.F32, (1, nh * (hd + 2))) for p in range(P)]
    wo = b.buf("wo", BK.WEIGHT, D.BF16, (N, H))
    h = b.buf("h", BK.IO_INPUT, D.BF16, (1, N))
    y = b.buf("y", BK.IO_OUTPUT, D.F32, (1, N))
    steps = [
        {"op": int(K.ATTENTION_COMBINE), "args": [{"in": p} for p in range(P)], "out": 0,
         "params": {"head_dim": hd, "n_heads": nh}, "out_shape": [1, H], "out_dtype": "bfloat16"},
        {"op": int(K.GEMV_TILE), "args": [{"s": 0}, {"in": P}], "out": 1,
         "params": {"n_off": 16, "N_tile": 40, "K": H}, "out_shape": [1, N], "out_dtype": "bfloat16"},
        {"op": int(K.ADD), "args": [{"in": P + 1}, {"s": 1}], "out": "final",
         "params": {"n_off": 16, "N_tile": 40}},
    ]
    b.task(K.FUSED, parts + [wo, h], [y], {"recipe": {"steps": steps}})
    b.outputs = [y]
    fill = {"wo": _rand((N, H), torch.bfloat16, 0.1), "h": _rand((1, N), torch.bfloat16)}
    for p in range(P):
        fill[f"part{p}"] = _partial(nh, hd, empty_head=0 if p == 1 else None)
    return Case(b.name, b.program(), fill)


def _partial(nh: int, hd: int, empty_head: int | None):
    """A split-KV partial [1, nh*(hd+2)] = [acc | m | l] per head, l > 0; an empty shard's
    head (m = -inf, l = 0) where asked."""
    def make(g):
        t = torch.randn((1, nh, hd + 2), generator=g)
        t[..., hd + 1] = t[..., hd + 1].abs() + 0.5
        if empty_head is not None:
            t[0, empty_head, hd], t[0, empty_head, hd + 1] = float("-inf"), 0.0
        return t.reshape(1, nh * (hd + 2))
    return make


def gate_up_case() -> Case:
    """rmsnorm -> gate and up GEMV tiles over one x -> silu_mul: the pipe GEMV pairs the two
    (one NMAT=2 stream); rows of 40 vectors (a short segment), 24 rows a tile."""
    H, F = 320, 64
    b = Builder("fused_norm_gate_up_silu")
    x = b.buf("x", BK.IO_INPUT, D.BF16, (1, H))
    w = b.buf("norm_w", BK.WEIGHT, D.BF16, (H,))
    wg = b.buf("w_gate", BK.WEIGHT, D.BF16, (F, H))
    wu = b.buf("w_up", BK.WEIGHT, D.BF16, (F, H))
    y = b.buf("y", BK.IO_OUTPUT, D.BF16, (1, F))
    tile = {"n_off": 16, "N_tile": 24, "K": H}
    steps = [
        {"op": int(K.RMSNORM), "args": [{"in": 0}, {"in": 1}], "out": 0, "params": {"eps": 1e-5},
         "out_shape": [1, H], "out_dtype": "bfloat16"},
        {"op": int(K.GEMV_TILE), "args": [{"s": 0}, {"in": 2}], "out": 1, "params": tile,
         "out_shape": [1, F], "out_dtype": "bfloat16"},
        {"op": int(K.GEMV_TILE), "args": [{"s": 0}, {"in": 3}], "out": 2, "params": tile,
         "out_shape": [1, F], "out_dtype": "bfloat16"},
        {"op": int(K.SILU_MUL), "args": [{"s": 1}, {"s": 2}], "out": "final",
         "params": {"n_off": 16, "N_tile": 24}},
    ]
    b.task(K.FUSED, [x, w, wg, wu], [y], {"recipe": {"steps": steps}})
    b.outputs = [y]
    fill = {"x": _rand((1, H), torch.bfloat16, 2), "norm_w": _rand((H,), torch.bfloat16),
            "w_gate": _rand((F, H), torch.bfloat16, 0.1), "w_up": _rand((F, H), torch.bfloat16, 0.1)}
    return Case(b.name, b.program(), fill)


def fused_case() -> Case:
    """rmsnorm -> q/k GEMV tiles -> rope -> kv append, and a second output (the q tile)."""
    H, hd, nkv = 128, 32, 2
    b = Builder("fused_norm_gemv_rope_kv")
    x = b.buf("x", BK.IO_INPUT, D.BF16, (1, H))
    w = b.buf("norm_w", BK.WEIGHT, D.BF16, (H,))
    wk = b.buf("wk", BK.WEIGHT, D.BF16, (nkv * hd, H))
    pos = b.buf("pos", BK.IO_INPUT, D.I32, (1,))
    cache = b.buf("cache", BK.KV_CACHE, D.BF16, (16, nkv, hd))
    kout = b.buf("k_roped", BK.IO_OUTPUT, D.BF16, (1, nkv * hd))
    steps = [
        {"op": int(K.RMSNORM), "args": [{"in": 0}, {"in": 1}], "out": 0, "params": {"eps": 1e-5},
         "out_shape": [1, H], "out_dtype": "bfloat16"},
        {"op": int(K.GEMV_TILE), "args": [{"s": 0}, {"in": 2}], "out": 1,
         "params": {"n_off": 0, "N_tile": hd, "K": H}, "out_shape": [1, nkv * hd], "out_dtype": "bfloat16"},
        {"op": int(K.GEMV_TILE), "args": [{"s": 0}, {"in": 2}], "out": 1,
         "params": {"n_off": hd, "N_tile": hd, "K": H}, "out_shape": [1, nkv * hd], "out_dtype": "bfloat16"},
        {"op": int(K.ROPE), "args": [{"s": 1}, {"in": 3}], "out": "final", "params": {"head_dim": hd}},
        {"op": int(K.KV_APPEND), "args": [{"o": 0} if False else {"s": 1}, {"in": 3}], "out": {"o": 1}, "params": {}},
    ]
    # the kv append writes the roped k: read it back from the final output's scratch twin
    steps[4]["args"] = [{"s": 2}, {"in": 3}]
    steps.insert(4, {"op": int(K.ROPE), "args": [{"s": 1}, {"in": 3}], "out": 2, "params": {"head_dim": hd},
                     "out_shape": [1, nkv * hd], "out_dtype": "bfloat16"})
    b.task(K.FUSED, [x, w, wk, pos], [kout, cache], {"recipe": {"steps": steps}})
    b.outputs = [kout, cache]
    fill = {"x": _rand((1, H), torch.bfloat16), "norm_w": _rand((H,), torch.bfloat16),
            "wk": _rand((nkv * hd, H), torch.bfloat16, 0.1), "pos": _const([5]),
            "cache": _rand((16, nkv, hd), torch.bfloat16)}
    return Case(b.name, b.program(), fill)


def combined_program(cs: list[Case] | None = None) -> Program:
    """Every case's task in one program (independent tasks): one NVRTC compile covers them all."""
    cs = cs if cs is not None else cases()
    bufs, tasks, counters = [], [], []
    for c in cs:
        p = c.program
        boff, coff = len(bufs), len(counters)
        for bb in p.buffers:
            bufs.append(Buffer(bb.id + boff, f"{c.name}.{bb.name}", bb.kind, bb.dtype, bb.shape,
                               f"{c.name}.{bb.source}"))
        counters.extend(Counter(x.id + coff, x.init) for x in p.counters)
        for t in p.tasks:
            tasks.append(Task(len(tasks), t.op, tuple(i + boff for i in t.inputs),
                              tuple(o + boff for o in t.outputs), t.params,
                              tuple(Wait(w.counter + coff, w.threshold) for w in t.waits),
                              t.out_counter + coff, f"{c.name}"))
    return Program(tuple(bufs), tuple(counters), tuple(tasks), (), "all_cases", ())
