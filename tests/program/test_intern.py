"""interned(program): the pass cache's stored form shares equal params, waits and operand tuples
between tasks, and is the same program value (equal, same repr: the canonical form the CUDA
lowered cache keys on)."""
import pickle

import amk
from amk.models.presets import TINY_LLAMA, random_model
from amk.passes.options import PassOptions
from amk.program.intern import interned
from amk.program.ir import Buffer, BufferKind, Counter, DType, InstructionKind as K, Program, Task


def _cuda_program():
    m = random_model(TINY_LLAMA)
    step = amk.jit(m.fn, donate=("kv",), options=PassOptions.for_backend("cuda"))
    return step.lower(*m.example_args()).programs["place"]    # as the passes built it


def test_interned_is_the_same_program_with_fewer_objects():
    prog = _cuda_program()
    shared = interned(prog)
    assert shared == prog and repr(shared) == repr(prog)
    assert len({id(t.params) for t in shared.tasks}) < len({id(t.params) for t in prog.tasks})
    assert len(pickle.dumps(shared)) < len(pickle.dumps(prog))
    assert pickle.loads(pickle.dumps(shared)) == prog


def _task(i, params):
    return Task(i, K.ADD, (0, 1), (2,), params, (), 0)


def test_params_that_are_equal_but_print_differently_stay_apart():
    # 1 == 1.0 == True and 0.0 == -0.0, yet each prints (and runs) as itself
    bufs = tuple(Buffer(i, f"b{i}", BufferKind.ACTIVATION, DType.F32, (4,)) for i in range(3))
    values = [{"n": 1}, {"n": 1.0}, {"n": True}, {"x": 0.0}, {"x": -0.0}, {"n": 1}]
    prog = Program(bufs, (Counter(0),), tuple(_task(i, p) for i, p in enumerate(values)))
    shared = interned(prog)
    assert [repr(t.params) for t in shared.tasks] == [repr(p) for p in values]
    ids = [id(t.params) for t in shared.tasks]
    assert len(set(ids[:5])) == 5 and ids[5] == ids[0]
