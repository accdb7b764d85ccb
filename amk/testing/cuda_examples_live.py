"""Hand-built cases for split-KV's live shard count (kv_shard_rows; examples.py appends them to
its cases): attention shards that are live, and one past the live count (it writes nothing: its
output stays poisoned); combines, alone and folded into an o tile, whose partials past the live
count hold NaN (a combine that reads one fails). The CPU compile test renders them for sm_90a;
the GPU tests run each one against the reference semantics."""
from __future__ import annotations

import torch

from amk.testing.cuda_examples import Builder, Case, _const, _partial, _rand, _single
from amk.program.ir import BufferKind as BK, DType as D, InstructionKind as K


def _stale(nh: int, hd: int):
    """A partial no shard wrote this step: NaN."""
    return lambda g: torch.full((1, nh * (hd + 2)), float("nan"))


def _live(R: int, kv_len: int) -> dict:
    return {"kv_shard_rows": R, "kv_start": 0, "kv_len": kv_len, "window": 0}


def cases() -> list[Case]:
    bf, f32, i32 = D.BF16, D.F32, D.I32
    tb = torch.bfloat16
    C: list[Case] = []
    nh, nkv, hd, S = 8, 2, 64, 160
    # pos 100 (101 live rows): R 64 -> 1 live shard (shard 3 of 4 not live); R 16 -> all 4
    # live, shard 1 rows [26, 52); R 32 of 8 shards -> 3 live, shard 2 rows [68, 101)
    for name, shard, shards, R in (("attention_shard_not_live", 3, 4, 64),
                                   ("attention_live_shard_of_4", 1, 4, 16),
                                   ("attention_last_live_shard_of_8", 2, 8, 32)):
        C.append(_single(name, K.ATTENTION_TILE,
                         [("q", BK.IO_INPUT, bf, (1, nh * hd)), ("k", BK.KV_CACHE, bf, (S, nkv, hd)),
                          ("v", BK.KV_CACHE, bf, (S, nkv, hd)), ("pos", BK.IO_INPUT, i32, (1,))],
                         [("y", BK.IO_OUTPUT, f32, (nh, hd + 2))],
                         {"head_dim": hd, "n_heads": nh, "n_kv_heads": nkv, "kv_start": 0, "kv_len": S,
                          "flags": 2, "kv_shard": shard, "kv_shards": shards, "kv_shard_rows": R},
                         {"q": _rand((1, nh * hd), tb), "k": _rand((S, nkv, hd), tb),
                          "v": _rand((S, nkv, hd), tb), "pos": _const([100])}))
    # staged combines: 8 partials, pos 400 of an 8192-row window at R 128 -> 3 live; pos 50 -> 1
    cn, chd = 4, 32
    for name, pos, live in (("combine8_live3", 400, 3), ("combine8_live1", 50, 1)):
        fill = {f"p{i}": _partial(cn, chd, empty_head=1 if i == 2 else None) if i < live
                else _stale(cn, chd) for i in range(8)}
        fill["pos"] = _const([pos])
        C.append(_single(name, K.ATTENTION_COMBINE,
                         [(f"p{i}", BK.IO_INPUT, f32, (1, cn * (chd + 2))) for i in range(8)]
                         + [("pos", BK.IO_INPUT, i32, (1,))],
                         [("y", BK.IO_OUTPUT, bf, (1, cn * chd))],
                         {"head_dim": chd, "n_heads": cn, **_live(128, 8192)}, fill))
    # the direct (global-memory) combine: 20 partials of 40 heads, pos 1300 at R 100 -> 13 live
    fill = {f"p{i}": _partial(40, 16, None) if i < 13 else _stale(40, 16) for i in range(20)}
    fill["pos"] = _const([1300])
    C.append(_single("combine20_direct_live13", K.ATTENTION_COMBINE,
                     [(f"p{i}", BK.IO_INPUT, f32, (1, 40 * 18)) for i in range(20)]
                     + [("pos", BK.IO_INPUT, i32, (1,))],
                     [("y", BK.IO_OUTPUT, f32, (1, 40 * 16))],
                     {"head_dim": 16, "n_heads": 40, **_live(100, 4096)}, fill))
    C.append(combine_o_live_case(pos=50, live=1))
    C.append(combine_o_live_case(pos=700, live=5))
    return C


def combine_o_live_case(pos: int, live: int) -> Case:
    """The o tile as the cuda passes build it at a large cache: 16 partials (P from the
    capacity), the combine folded into the GEMV (x in shared memory), pos 700 of an 8192-row
    window at R 128 -> 5 live shards (pos 50 -> 1: the single partial's acc / l)."""
    P, nh, hd, N = 16, 4, 32, 64
    H = nh * hd
    b = Builder(f"fused_combine_o_live{live}")
    parts = [b.buf(f"part{p}", BK.IO_INPUT, D.F32, (1, nh * (hd + 2))) for p in range(P)]
    posb = b.buf("pos", BK.IO_INPUT, D.I32, (1,))
    wo = b.buf("wo", BK.WEIGHT, D.BF16, (N, H))
    y = b.buf("y", BK.IO_OUTPUT, D.F32, (1, N))
    steps = [
        {"op": int(K.ATTENTION_COMBINE), "args": [{"in": p} for p in range(P + 1)], "out": 0,
         "params": {"head_dim": hd, "n_heads": nh, **_live(128, 8192)}, "out_shape": [1, H],
         "out_dtype": "bfloat16"},
        {"op": int(K.GEMV_TILE), "args": [{"s": 0}, {"in": P + 1}], "out": "final",
         "params": {"n_off": 8, "N_tile": 40, "K": H}},
    ]
    b.task(K.FUSED, parts + [posb, wo], [y], {"recipe": {"steps": steps}})
    b.outputs = [y]
    fill = {"wo": _rand((N, H), torch.bfloat16, 0.1), "pos": _const([pos])}
    for p in range(P):
        fill[f"part{p}"] = _partial(nh, hd, empty_head=0 if p == 1 else None) if p < live \
            else _stale(nh, hd)
    return Case(b.name, b.program(), fill)
