"""Hand-built batched attention tasks for the tensor-core attention (op_attention_mma,
templates/attention_mma.cuh): bf16 q, caches [B, S, n_kv, hd] and a position per sequence (or
one for all), head dims 64 and 128, GQA ratios 1, 2, 4, 8 and 16 (two passes of 8 heads), a
window of several chunks, a static window piece with partial output, NEW_KV rows, a soft-cap,
an empty window and a task over some of the sequences. Cases as cuda_examples' (one task each;
the CPU test checks each takes op_attention_mma and compiles, the GPU test runs them against the
reference semantics)."""
from __future__ import annotations

import torch

from amk.program.ir import BufferKind as BK, DType as D, InstructionKind as K
from amk.testing.cuda_examples import Case, _const, _rand, _single

BF = torch.bfloat16


def _case(name: str, B: int, S: int, nh: int, nkv: int, hd: int, pos: list[int], out_dtype=D.BF16,
          new_kv: bool = False, **params) -> Case:
    partial = bool(int(params.get("flags", 0)) & 2)
    width = hd + 2 if partial else hd
    ins = [("q", BK.IO_INPUT, D.BF16, (B, nh * hd)), ("k", BK.KV_CACHE, D.BF16, (B, S, nkv, hd)),
           ("v", BK.KV_CACHE, D.BF16, (B, S, nkv, hd)), ("pos", BK.IO_INPUT, D.I32, (len(pos),))]
    fill = {"q": _rand((B, nh * hd), BF), "k": _rand((B, S, nkv, hd), BF), "v": _rand((B, S, nkv, hd), BF),
            "pos": _const(pos)}
    if new_kv:
        ins += [("k_new", BK.IO_INPUT, D.F32, (B, nkv * hd)), ("v_new", BK.IO_INPUT, D.F32, (B, nkv * hd))]
        fill |= {"k_new": _rand((B, nkv * hd), torch.float32, 3), "v_new": _rand((B, nkv * hd), torch.float32, 3)}
        params["flags"] = int(params.get("flags", 0)) | 4
    return _single(name, K.ATTENTION_TILE, ins, [("y", BK.IO_OUTPUT, out_dtype, (B, nh * width))],
                   {"head_dim": hd, "n_heads": nh, "n_kv_heads": nkv, **params}, fill)


def cases() -> list[Case]:
    return [
        # a 700-row window: several chunks and a last block of 12 rows; one sequence at pos 0
        _case("attn_mma_hd64_rep4_long", 3, 700, 8, 2, 64, [699, 0, 300]),
        # Qwen3's head dim: a static window piece [100, 350) of each sequence, partial output
        _case("attn_mma_hd128_rep2_piece", 2, 500, 4, 2, 128, [450, 499], D.F32,
              kv_start=100, kv_len=250, flags=2),
        # the 8B's ratio at hd 128, the new rows from k_new / v_new (row pos of the cache stale)
        _case("attn_mma_hd128_rep8_new_kv", 2, 300, 16, 2, 128, [250, 37], D.F32, new_kv=True, flags=2),
        # MHA, one position for all sequences, Gemma 2's soft-cap
        _case("attn_mma_hd64_mha_softcap", 4, 64, 4, 4, 64, [40], softcap=5.0),
        # 16 q heads a kv head: two passes of 8
        _case("attn_mma_hd64_rep16", 2, 200, 16, 1, 64, [199, 150]),
        # sequence 0's piece [48, 80) is past its pos: empty (acc 0, m -inf, l 0)
        _case("attn_mma_empty_window", 2, 80, 4, 2, 64, [20, 60], D.F32, kv_start=48, kv_len=32, flags=2),
        # a task of sequences 1 and 2 of 4: the others' rows untouched
        _case("attn_mma_sequence_range", 4, 100, 8, 2, 64, [90, 10, 50, 99], D.F32, b_off=1, b_count=2, flags=2),
    ]
