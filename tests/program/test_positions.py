"""block_position_tasks: the tasks a one-position backend (the CUDA megakernel) must refuse."""


def test_block_position_tasks_sees_fused_steps_and_not_the_seeds_static_pos():
    from amk.program.ir import (Buffer, BufferKind as BK, Counter, DType as D,
                                InstructionKind as K, Program, Task)
    from amk.program.positions import block_position_tasks
    bufs = (Buffer(0, "x", BK.IO_INPUT, D.F32, (4, 16)), Buffer(1, "pos", BK.IO_INPUT, D.I32, (4,)),
            Buffer(2, "y", BK.IO_OUTPUT, D.F32, (4, 16)), Buffer(3, "cache", BK.KV_CACHE, D.F32, (8, 2, 8)))
    rope = {"op": int(K.ROPE), "args": [{"in": 0}, {"in": 1}], "out": "final", "params": {"head_dim": 8}}
    tasks = (Task(0, K.FUSED, (0, 1), (2,), {"recipe": {"steps": [rope]}}, (), 0, "fused rope"),
             Task(1, K.KV_APPEND, (0, 3), (3,), {"pos": 2}, (), 1, "seed append"))
    prog = Program(bufs, (Counter(0), Counter(1)), tasks, (), "p", (2,))
    assert [t.id for t in block_position_tasks(prog)] == [0]
