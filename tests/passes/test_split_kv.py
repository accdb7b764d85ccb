"""split_kv: each attention becomes P shards over kv rows writing flash partials, and a combine
per kv group merges them (close to, not bit-identical with, one softmax)."""
from dataclasses import replace

import pytest
from pass_helpers import (SMALL, TINY, bindings, check_lines, close, golden, llama_program, run,
                          run_passes, same, text)

from small_programs import TWO_SMS, attention_program
from amk.passes.options import PassOptions, Target
from amk.passes.split_kv import split_kv
from amk.program.ir import InstructionKind as K

GOLDEN = """
program attn outputs=(b6)
buffers:
  b0 new.q io_input f32[1,8] source="new.q"
  b1 new.k io_input f32[1,4] source="new.k"
  b2 new.v io_input f32[1,4] source="new.v"
  b3 pos io_input i32[1] source="pos"
  b4 kv.k kv_cache f32[8,1,4] source="kv.k"
  b5 kv.v kv_cache f32[8,1,4] source="kv.v"
  b6 v8 io_output f32[1,8]
  b7 v8.part0 activation f32[1,12]
  b8 v8.part1 activation f32[1,12]
counters:
  c0 init=0
  c1 init=0
  c2 init=0
  c3 init=0
tasks:
  t0 KV_APPEND in=(b1,b3) out=(b4) waits=() -> c0 {} # kv_update @ small_programs.py:N
  t1 KV_APPEND in=(b2,b3) out=(b5) waits=() -> c1 {} # kv_update @ small_programs.py:N
  t2 ATTENTION_TILE in=(b0,b4,b5,b3) out=(b7) waits=(c0>=1,c1>=1) -> c3 {"head_dim": 4, "n_heads": 2, "n_kv_heads": 1, "scale": 0.5, "kv_start": 0, "kv_len": 8, "flags": 2, "h_off": 0, "h_count": 2, "kv_shard": 0, "kv_shards": 2, "kv_shard_rows": 1} # attention @ small_programs.py:N[kv 0/1 shard 0/2]
  t3 ATTENTION_TILE in=(b0,b4,b5,b3) out=(b8) waits=(c0>=1,c1>=1) -> c3 {"head_dim": 4, "n_heads": 2, "n_kv_heads": 1, "scale": 0.5, "kv_start": 0, "kv_len": 8, "flags": 2, "h_off": 0, "h_count": 2, "kv_shard": 1, "kv_shards": 2, "kv_shard_rows": 1} # attention @ small_programs.py:N[kv 0/1 shard 1/2]
  t4 ATTENTION_COMBINE in=(b7,b8,b3) out=(b6) waits=(c3>=2) -> c2 {"head_dim": 4, "n_heads": 2, "h_off": 0, "h_count": 2, "kv_shard_rows": 1, "kv_start": 0, "kv_len": 8, "window": 0} # attention @ small_programs.py:N[combine 0/1]
"""


def test_split_kv_golden_text():
    # two shards of the live window (kv_shard of kv_shards; live from one row each: a forced
    # attn_splits), each a flash partial [2 x (4+2)]; the combine counts them again from pos
    golden(split_kv(attention_program(), TWO_SMS), GOLDEN)


def test_split_kv_matches_unsplit_attention_closely(stages, reference):
    b, ref = reference
    close(run(stages["split_kv"], b, order="random"), ref)
    for pos in (0, 7, 15):                 # empty shards (pos=0), shard edges, a full cache
        bb = bindings(stages["lower"], pos=pos)
        close(run(stages["split_kv"], bb), run(stages["lower"], bb))


def test_split_kv_text(stages):
    t = text(stages["split_kv"])
    check_lines(t, [r"b\d+ v\d+\.part0 activation f32\[1,40\]",          # 4 heads x (8+2)
                    # every shard spans the cache; kv_shard picks its piece of the live window
                    r'ATTENTION_TILE .*"kv_start": 0, "kv_len": 16, "flags": 2, "h_off": 0, "h_count": 2, "kv_shard": 0, "kv_shards": 3',
                    r'ATTENTION_TILE .*"kv_start": 0, "kv_len": 16, "flags": 2, "h_off": 0, "h_count": 2, "kv_shard": 2, "kv_shards": 3',
                    r'ATTENTION_TILE .*"kv_start": 0, "kv_len": 16, "flags": 2, "h_off": 2, "h_count": 2, "kv_shard": 2, "kv_shards": 3',
                    r'ATTENTION_COMBINE in=\(b\d+,b\d+,b\d+,b\d+\) .*"h_off": 0, "h_count": 2',
                    r'ATTENTION_COMBINE .*"h_off": 2, "h_count": 2'])


def test_split_kv_one_shard_keeps_exact_per_group_tasks():
    p = llama_program()
    one = run_passes(p, PassOptions(target=SMALL, attn_splits=1), upto="split_kv")["split_kv"]
    att = [t for t in one.tasks if t.op is K.ATTENTION_TILE]
    assert len(att) == 4 and all(t.params["flags"] == 0 for t in att)
    assert not any(t.op is K.ATTENTION_COMBINE for t in one.tasks)
    b = bindings(p)
    same(run(one, b, order="random"), run(p, b))


def _wide(**kw) -> PassOptions:
    # 32 "SMs", two kv groups: a derived P of 16 shards a group at an 8192-row cache
    return PassOptions(target=Target("wide", num_sms=32, smem_bytes=1 << 16,
                                     max_tile_bytes=16 * 32 * 4), **kw)


def test_an_8k_cache_keeps_p_from_its_capacity_and_counts_live_shards_from_pos():
    p = llama_program(replace(TINY, max_seq=8192))
    split = run_passes(p, _wide(), upto="split_kv")["split_kv"]
    shards = [t for t in split.tasks if t.op is K.ATTENTION_TILE]
    assert len(shards) == 2 * 2 * 16                    # 2 layers x 2 kv groups x P = 16
    assert {t.params["kv_shard_rows"] for t in shards} == {128}   # R = kv_shard_min
    comb = [t for t in split.tasks if t.op is K.ATTENTION_COMBINE]
    assert all(len(t.inputs) == 17 and split.buffers[t.inputs[-1]].source == "pos" and
               t.params["kv_len"] == 8192 for t in comb)


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_live_shards_at_an_8k_cache_match_the_unsplit_step(backend):
    """The tiny Llama at an 8192-row cache through split_kv (P = 16, R = 128; for "cuda" the
    cuda backend's pass options: one combine folded into every o tile, the K/V appends after
    the attention) on one reference VM, against the unsplit program. Position 8191 first: every
    partial then holds that step's values, which the later steps' combines must not read (1, 1
    and 11 live shards at 0, 200, 1500)."""
    from amk.backends.reference.vm import ReferenceVM
    p = llama_program(replace(TINY, max_seq=8192))
    opts = _wide() if backend == "reference" else PassOptions.for_backend("cuda")
    vm = ReferenceVM(run_passes(p, opts, upto="place")["place"], order="random")
    for pos in (8191, 0, 200, 1500):
        b = bindings(p, pos=pos)
        got = [t.clone() for t in vm.run({k: v.clone() for k, v in b.items()})]
        close(got, run(p, b))


@pytest.mark.parametrize("preset, combines", [("LLAMA_3_2_1B", 1), ("QWEN3_0_6B", 1),
                                             ("LLAMA_3_8B", 8)])
def test_batch_1_folds_its_combine_only_where_a_reader_stages_every_partial(preset, combines):
    """The cuda options fold batch 1's one combine into every o tile, which stages its x and
    all P partials below the preload: the 1B's and Qwen3-0.6B's 16 partials (~8.4 KB each)
    fit, the 8B's (16.6 KB) do not, so there one combine a kv group. The fold never lowers P
    (16 from the SMs on every preset); a smaller bound sends the 1B to the combine tasks too;
    a forced attn_splits and a batch keep their P and their combines."""
    from amk.models import presets
    cfg = replace(getattr(presets, preset), n_layers=1, vocab=256, max_seq=8192,
                  qk_norm=False)            # (pass_helpers' params have no q/k norms)
    opts = PassOptions.for_backend("cuda")
    assert opts.fold_partial_bytes and opts.target.num_sms == 132

    def split(o, batch=1):
        prog = run_passes(llama_program(cfg, batch), o, upto="split_kv")["split_kv"]
        P = {t.params.get("kv_shards", 1) for t in prog.tasks if t.op is K.ATTENTION_TILE}
        return P, sum(t.op is K.ATTENTION_COMBINE for t in prog.tasks)

    assert split(opts) == ({16}, combines)
    assert split(opts.with_(fold_partial_bytes=None)) == ({16}, 1)      # num_sms // kv groups
    x = cfg.n_heads * cfg.head_dim * 4
    need = -(-x // 1024) * 1024 + 16 * cfg.n_heads * (cfg.head_dim + 2) * 4
    assert split(opts.with_(fold_partial_bytes=need)) == ({16}, 1)
    assert split(opts.with_(fold_partial_bytes=need - 1)) == ({16}, cfg.n_kv_heads)
    assert split(opts.with_(attn_splits=12)) == ({12}, 1)
    assert split(opts, batch=4) == split(opts.with_(fold_partial_bytes=None), batch=4)


def test_no_backend_task_merges_more_partials_than_it_may_have_operands():
    """Two kv heads at an 8K cache asked for 64 shards a head (132 // 2, 8192 // 128): the
    combine's 66 operands failed the cuda backend's 64. max_kv_shards bounds a derived P; a
    forced attn_splits is the user's."""
    from amk.backends.cuda.codegen import MAX_PTRS
    cfg = replace(TINY, max_seq=8192)
    opts = PassOptions.for_backend("cuda")
    assert opts.max_kv_shards == MAX_PTRS - 8

    def shards(o):
        prog = run_passes(llama_program(cfg), o, upto="split_kv")["split_kv"]
        return {t.params.get("kv_shards", 1) for t in prog.tasks if t.op is K.ATTENTION_TILE}

    assert shards(opts) == {MAX_PTRS - 8}
    assert shards(opts.with_(max_kv_shards=None)) == {64}
    assert shards(opts.with_(attn_splits=60)) == {60}
