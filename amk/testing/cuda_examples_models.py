"""Hand-built cases for the ops issue 25 added (examples.py appends them to its cases): soft-cap,
tanh GELU, COPY's column move (slice / concat), attention with a sliding window and with
soft-capped scores. The CPU compile test renders them for sm_90a; the GPU tests run each one
against the reference semantics."""
from __future__ import annotations

import torch

from amk.testing.cuda_examples import Case, _const, _rand, _single
from amk.program.ir import BufferKind as BK, DType as D, InstructionKind as K


def cases() -> list[Case]:
    bf, f32, i32 = D.BF16, D.F32, D.I32
    tb, tf = torch.bfloat16, torch.float32
    C: list[Case] = []
    C.append(_single("softcap_f32", K.SOFTCAP, [("x", BK.IO_INPUT, f32, (2, 37))],
                     [("y", BK.IO_OUTPUT, f32, (2, 37))], {"cap": 3.0}, {"x": _rand((2, 37), tf, 6)}))
    C.append(_single("softcap_bf16_tile", K.SOFTCAP, [("x", BK.IO_INPUT, bf, (1, 96))],
                     [("y", BK.IO_OUTPUT, bf, (1, 96))], {"cap": 30.0, "n_off": 32, "N_tile": 32},
                     {"x": _rand((1, 96), tb, 40)}))
    C.append(_single("gelu_tanh_bf16", K.GELU, [("x", BK.IO_INPUT, bf, (3, 50))],
                     [("y", BK.IO_OUTPUT, bf, (3, 50))], {"tanh": 1}, {"x": _rand((3, 50), tb, 2)}))
    C.append(_single("copy_slice_cols", K.COPY, [("x", BK.IO_INPUT, f32, (2, 40))],
                     [("y", BK.IO_OUTPUT, f32, (2, 12))], {"x_off": 9, "n_off": 0, "N_tile": 12},
                     {"x": _rand((2, 40), tf)}))
    C.append(_single("copy_concat_part_bf16", K.COPY, [("x", BK.IO_INPUT, bf, (2, 20))],
                     [("y", BK.IO_OUTPUT, f32, (2, 36))], {"x_off": 0, "n_off": 16, "N_tile": 20},
                     {"x": _rand((2, 20), tb)}))
    nh, nkv, hd, S = 8, 2, 64, 96
    attn_in = [("q", BK.IO_INPUT, bf, (1, nh * hd)), ("k", BK.KV_CACHE, bf, (S, nkv, hd)),
               ("v", BK.KV_CACHE, bf, (S, nkv, hd)), ("pos", BK.IO_INPUT, i32, (1,))]
    fill = {"q": _rand((1, nh * hd), tb), "k": _rand((S, nkv, hd), tb),
            "v": _rand((S, nkv, hd), tb), "pos": _const([70])}
    base = {"head_dim": hd, "n_heads": nh, "n_kv_heads": nkv}
    C.append(_single("attention_sliding_window", K.ATTENTION_TILE, attn_in,
                     [("y", BK.IO_OUTPUT, bf, (1, nh * hd))], {**base, "window": 13}, fill))
    C.append(_single("attention_softcap", K.ATTENTION_TILE, attn_in,
                     [("y", BK.IO_OUTPUT, f32, (1, nh * hd))], {**base, "softcap": 2.0}, fill))
    C.append(_single("attention_window_softcap_partial", K.ATTENTION_TILE, attn_in,
                     [("y", BK.IO_OUTPUT, f32, (nh, hd + 2))],
                     {**base, "window": 40, "softcap": 5.0, "kv_start": 0, "kv_len": 48, "flags": 2},
                     fill))
    return C
