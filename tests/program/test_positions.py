"""prompt_block_tasks: the tasks a one-position-a-sequence backend (the CUDA megakernel) must
refuse: several positions for one cache, not one position per sequence of a batch."""
from amk.program.ir import (Buffer, BufferKind as BK, Counter, DType as D, InstructionKind as K,
                            Program, Task)
from amk.program.positions import prompt_block_tasks


def _program(cache_shape):
    bufs = (Buffer(0, "x", BK.IO_INPUT, D.F32, (4, 16)), Buffer(1, "pos", BK.IO_INPUT, D.I32, (4,)),
            Buffer(2, "y", BK.IO_OUTPUT, D.F32, (4, 16)), Buffer(3, "cache", BK.KV_CACHE, D.F32, cache_shape))
    rope = {"op": int(K.ROPE), "args": [{"in": 0}, {"in": 1}], "out": 0, "params": {"head_dim": 8},
            "out_shape": [4, 16], "out_dtype": "f32"}
    append = {"op": int(K.KV_APPEND), "args": [{"s": 0}, {"in": 1}], "out": {"o": 0}, "params": {}}
    tasks = (Task(0, K.FUSED, (0, 1), (2,), {"recipe": {"steps": [dict(rope, out="final")]}}, (), 0, "rope"),
             Task(1, K.FUSED, (0, 1), (3,), {"recipe": {"steps": [rope, append]}}, (), 1, "rope+append"),
             Task(2, K.KV_APPEND, (0, 3), (3,), {"pos": 2}, (), 2, "seed append"))
    return Program(bufs, (Counter(0), Counter(1), Counter(2)), tasks, (), "p", (2,))


def test_a_block_for_one_cache_is_found_in_fused_steps_not_the_seeds_static_pos():
    assert [t.id for t in prompt_block_tasks(_program((8, 2, 8)))] == [1]


def test_one_position_per_sequence_of_a_batch_is_not_a_block():
    assert prompt_block_tasks(_program((4, 8, 2, 8))) == []
