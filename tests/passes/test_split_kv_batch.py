"""split_kv on a decode batch (a cache per sequence): attention tasks per (sequences, kv group,
shard), each over its own sequences at their own positions, writing sequence-major partials
(or, at one shard a sequence, their rows of y), with P chosen for the batch; the step equals
the unsplit one on the reference VM."""
from dataclasses import replace

import pytest
import torch
from pass_helpers import TINY, bindings, close, llama_avals, run, run_passes

from amk.graph import Aval
from amk.models.llama import make_decode_step
from amk.passes.lower import lower
from amk.passes.options import PassOptions, Target
from amk.passes.split_kv import sequences_per_task
from amk.program.ir import BufferKind, DType, InstructionKind as K
from amk.program.regions import PARTIAL_WRITE, Region, task_regions
from amk.program.validate import validate
from amk.trace import trace

WIDE = Target("wide", num_sms=32, smem_bytes=1 << 16, max_tile_bytes=16 * 32 * 4)


def batch_program(batch: int, max_seq: int):
    """The tiny Llama's decode step for `batch` sequences, each at its own position (pos [B])."""
    cfg = replace(TINY, max_seq=max_seq)
    avals = llama_avals(cfg, batch)
    avals[2] = Aval((batch,), DType.I32)
    g, _ = trace(make_decode_step(cfg), avals, ["params", "token", "pos", "kv"],
                 [BufferKind.WEIGHT, BufferKind.IO_INPUT, BufferKind.IO_INPUT, BufferKind.KV_CACHE],
                 name="llama")
    return lower(g)


def batch_bindings(program, positions):
    b = bindings(program)
    b["pos"] = torch.tensor(positions, dtype=torch.int32)
    return b


def _attention(program):
    return [t for t in program.tasks if t.op is K.ATTENTION_TILE]


def test_sequences_per_task_fill_the_sms_before_grouping():
    opts = PassOptions(target=WIDE)
    assert [sequences_per_task(b, 2, opts) for b in (1, 4, 16, 32, 64, 48)] == [1, 1, 1, 2, 4, 3]


@pytest.mark.parametrize("batch, seqs, shards", [(4, 1, 4), (16, 1, 1), (64, 4, 1)])
def test_batch_tasks_cover_every_sequence_kv_group_and_shard(batch, seqs, shards):
    p = batch_program(batch, 8192)
    split = run_passes(p, PassOptions(target=WIDE), upto="split_kv")["split_kv"]
    assert validate(split).ok
    att = _attention(split)
    assert len(att) == 2 * (batch // seqs) * 2 * shards         # layers x groups x kv x P
    assert {t.params["b_count"] for t in att} == {seqs}
    assert {t.params.get("kv_shards", 1) for t in att} == {shards}
    assert sorted({t.params["b_off"] for t in att}) == list(range(0, batch, seqs))
    assert all(("kv_shard_rows" in t.params) == (shards > 1) for t in att)
    nh, hd = TINY.n_heads, TINY.head_dim
    combines = [t for t in split.tasks if t.op is K.ATTENTION_COMBINE]
    if shards > 1:      # sequence-major partials, merged by a combine a kv group
        assert {split.buffers[t.outputs[0]].shape for t in att} == {(1, batch * nh * (hd + 2))}
        assert len(combines) == 2 * 2
    else:               # one shard a sequence: each task writes its rows of y, no combine
        assert {split.buffers[t.outputs[0]].shape for t in att} == {(batch, nh * hd)}
        assert not any(int(t.params.get("flags", 0)) & PARTIAL_WRITE for t in att)
        assert not combines


def test_a_batch_task_at_one_shard_writes_only_its_sequences_rows_of_y():
    p = batch_program(16, 8192)
    split = run_passes(p, PassOptions(target=WIDE), upto="split_kv")["split_kv"]
    t = next(t for t in _attention(split) if t.params["b_off"] == 0 and t.params["h_off"] == 0)
    y = t.outputs[0]
    _, writes = task_regions(t, split.buffers)
    rep = TINY.n_heads // TINY.n_kv_heads
    assert writes == [Region(y, 0, rep * TINY.head_dim, 0, 1)]


@pytest.mark.parametrize("batch, max_seq", [(2, 64), (3, 8192), (5, 64), (16, 300), (64, 256)])
@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_batch_split_matches_the_unsplit_step_per_sequence(batch, max_seq, backend):
    """Mixed positions (0, max_seq-1 and lengths between) through split_kv with the batch's
    tasks (for "cuda" its pass options on an H200: combine in the o tiles, the appends after the
    attention) on one reference VM in a random legal order, against the unsplit program; the
    first step at max_seq-1 everywhere leaves stale partials later steps must not read."""
    from amk.backends.reference.vm import ReferenceVM
    p = batch_program(batch, max_seq)
    opts = PassOptions(target=WIDE) if backend == "reference" else PassOptions.for_backend("cuda")
    prog = run_passes(p, opts, upto="place")["place"]
    assert validate(prog).ok
    vm = ReferenceVM(prog, order="random")
    mixed = [(0, max_seq - 1, 1, 130, 17)[b % 5] % max_seq for b in range(batch)]
    for positions in ([max_seq - 1] * batch, mixed, list(reversed(mixed))):
        b = batch_bindings(p, positions)
        got = [t.clone() for t in vm.run({k: v.clone() for k, v in b.items()})]
        close(got, run(p, b))


@pytest.mark.parametrize("batch", [1, 16])
def test_cuda_folds_the_combine_into_the_o_tiles_only_at_batch_1(batch):
    """At batch 1 each o tile merges the partials itself (no hop); a batch's partials are every
    sequence's, so one combine a kv group writes y once and the o tiles read it."""
    from amk.program.recipe import recipe_of
    prog = run_passes(batch_program(batch, 512), PassOptions.for_backend("cuda"), upto="fuse")["fuse"]
    alone = [t for t in prog.tasks if t.op is K.ATTENTION_COMBINE]
    folded = [t for t in prog.tasks if t.op is K.FUSED
              and any(s.op is K.ATTENTION_COMBINE for s in recipe_of(t).steps)]
    if batch == 1:
        assert folded and not alone
    else:
        assert not folded and len(alone) == 2 * TINY.n_kv_heads        # layers x kv groups
        assert {t.params["h_count"] for t in alone} == {TINY.n_heads // TINY.n_kv_heads}
