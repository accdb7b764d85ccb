"""Lowering folds of the CUDA backend on a real decode step (Llama-3.2-1B shape, one layer, on
the meta device): the ropes of q and of the new k row go into the staged attention (NEW_KV,
passes/defer_kv_append.py), the rope of k into the deferred cache append, the combine's
smem-only output is never zeroed. Numerics: tests/gpu (model tests)."""
from dataclasses import replace

import pytest

pytest.importorskip("cuda.bindings")

from amk.backends.cuda import abi
from amk.backends.cuda.lower import lower_program
from amk.models.presets import LLAMA_3_2_1B, random_model
from amk.program.ir import InstructionKind as K
from amk.program.recipe import recipe_of


def _lowered():
    m = random_model(replace(LLAMA_3_2_1B, max_seq=1088, n_layers=1), device="meta")
    prog = m.lower(backend="cuda").program
    return prog, lower_program(prog)


def _steps(prog, low, has_op):
    """(task, its lowered steps) of every FUSED task whose recipe has `has_op`; a task whose
    steps fold into one instruction is lowered as that instruction (its own only step)."""
    out = []
    for i, t in enumerate(prog.tasks):
        if t.op is K.FUSED and any(s.op is has_op for s in recipe_of(t).steps):
            d = low.tasks[i]
            fused = int(d["op"]) == int(K.FUSED)
            out.append((d, low.tasks[d["sub_begin"]:d["sub_begin"] + d["n_sub"]] if fused else [d]))
    return out


def _ip(step, group, name):
    return int(step["ip"][abi.ip_index(group, name)])


def test_q_and_new_k_ropes_are_done_by_the_staged_attention():
    prog, low = _lowered()
    att = _steps(prog, low, K.ATTENTION_TILE)
    assert len(att) == 64                                       # 8 kv heads x 8 shards
    for _, subs in att:
        assert [int(s["op"]) for s in subs] == [int(K.ATTENTION_TILE)]
        a = subs[0]
        # q, k cache, v cache, pos, new k row (unrotated), new v row, the inverse frequencies
        assert (_ip(a, "ATTN", "Q_ROPE"), _ip(a, "ATTN", "K_ROPE"), _ip(a, "ATTN", "NEW_KV"),
                _ip(a, "ATTN", "ROPE_INV"), int(a["n_in"])) == (1, 1, 1, 1, 7)
    assert not any(v.fn == "op_rope" for v in low.variants)


def test_k_rope_is_done_by_the_cache_append():
    prog, low = _lowered()
    appends = [subs for _, subs in _steps(prog, low, K.KV_APPEND)]
    assert len(appends) == 1                 # k's rope + append (v's append was never FUSED)
    (a,) = appends[0]
    assert int(a["op"]) == int(K.KV_APPEND)
    assert (_ip(a, "KV", "ROPE_HD"), _ip(a, "KV", "ROPE_INV"), int(a["n_in"])) == (64, 1, 3)


def test_a_combine_that_writes_only_shared_memory_zeroes_nothing():
    prog, low = _lowered()
    combos = _steps(prog, low, K.ATTENTION_COMBINE)
    assert combos
    for d, subs in combos:
        assert _ip(subs[0], "COMB", "TO_SMEM") == 1
        assert int(d["n_zero"]) == 0


def test_the_lm_head_tiles_reduce_the_argmax_and_the_argmax_task_their_partials():
    prog, low = _lowered()
    (am,) = [i for i, t in enumerate(prog.tasks) if t.op is K.SAMPLE_ARGMAX]
    d = low.tasks[am]
    assert low.variants[int(d["variant"])].fn == "op_argmax_parts"
    n = _ip(d, "ARGMAX", "V")
    heads = [s for d2, subs in _steps(prog, low, K.GEMV_TILE) for s in subs
             if low.variants[int(s["variant"])].arg("epi") == 3]
    assert n == len(heads) == 132                                      # one partial a tile
    assert sorted(_ip(s, "GEMV", "ARG_SLOT") for s in heads) == list(range(n))
    # slots follow the columns; the tiles cover the vocabulary exactly
    by_slot = sorted((_ip(s, "GEMV", "ARG_SLOT"), _ip(s, "GEMV", "N_OFF"), _ip(s, "GEMV", "N_TILE")) for s in heads)
    assert [o for _, o, _ in by_slot] == [0] + [o + t for _, o, t in by_slot[:-1]]
    assert by_slot[-1][1] + by_slot[-1][2] == LLAMA_3_2_1B.vocab
