"""The whole pass pipeline on a Llama-3.2-1B-shaped program (hidden 2048, 16 layers, 32/8 heads,
FFN 8192, vocab 128256, bf16) for a 132-SM target: structure only (no data, no timing asserts)."""
from pass_helpers import run_passes

from amk.models.llama import DecoderConfig
from amk.passes.options import H200, PassOptions
from amk.passes.place import placement_balance
from amk.program.ir import DType, InstructionKind as K
from amk.program.recipe import recipe_of
from amk.program.validate import validate

LLAMA_1B = DecoderConfig(vocab=128256, hidden=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                         head_dim=64, ffn=8192, max_seq=4096)


def test_llama_1b_pipeline_shape():
    from pass_helpers import llama_program
    st = run_passes(llama_program(LLAMA_1B, dtype=DType.BF16), PassOptions(target=H200))
    p = st["place"]
    assert len(p.counters) * 20 < len(p.tasks)
    assert placement_balance(p) <= 1.10
    assert len(p.queues) == 132
    # q, k and v read one x: tiled together, 24 columns each (96 KiB of bf16 weight), so the
    # stage is one round of <= 132 tiles; o alone: 16 columns; the LM head one tile per SM
    tiles = {w: [t for t in st["tile"].tasks if t.op is K.GEMV_TILE and f"layers.0.{w}" in t.name]
             for w in ("wq", "wk", "wv", "wo", "w_gate", "w_up")}
    assert [len(tiles[w]) for w in ("wq", "wk", "wv", "wo")] == [86, 22, 22, 128]
    # gate and up are fused tile by tile into one task: the pair counts once (64 columns each)
    assert [len(tiles[w]) for w in ("w_gate", "w_up")] == [128, 128]
    assert {tiles["wq"][0].params["N_tile"], tiles["wo"][0].params["N_tile"]} == {24, 16}
    assert len([t for t in st["tile"].tasks if "lm_head" in t.name]) == 132
    att = [t for t in p.tasks if t.op is K.FUSED and
           recipe_of(t).steps[-1].op is K.ATTENTION_TILE]
    assert len(att) == 16 * 8 * 16
    # each attention shard waits on the q tiles that hold its 4 heads and on the two appends
    by_counter = {}
    for t in p.tasks:
        by_counter.setdefault(t.out_counter, []).append(t)
    for a in att[:16]:
        waited = [m for w in a.waits for m in by_counter[w.counter]]
        assert sum(a.inputs[0] in m.outputs for m in waited) == 11      # ceil(256 / 24)
        assert len(waited) == 13
    res = validate(p)
    assert res.ok, res.report()[:2000]


def test_llama_1b_on_the_triton_target_is_one_task_per_op():
    # one launch per task whose grid covers the op: no column tiles, no kv-group attention
    # tasks (before: 500 tasks, q-rope and attention split 8 ways a layer; the cuda target
    # above keeps its tiles)
    from pass_helpers import llama_program
    st = run_passes(llama_program(LLAMA_1B, dtype=DType.BF16), PassOptions.for_backend("triton"))
    p = st["place"]
    assert len(p.tasks) == len(st["lower"].tasks) == 16 * 17 + 4
    assert not [t for t in p.tasks if {"h_off", "kv_shard"} & set(t.params)]
    assert all(t.params.get("n_off", 0) == 0 and
               t.params.get("N_tile", p.buffers[t.outputs[0]].cols) == p.buffers[t.outputs[0]].cols
               for t in p.tasks)
    assert sum(t.op is K.ATTENTION_TILE for t in p.tasks) == 16
    assert validate(p).ok
