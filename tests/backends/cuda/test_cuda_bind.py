"""CudaProgram's binding on the host (no GPU: the program object is built around CPU tensors):
the same tensors at the same addresses skip the checks and the table upload; a new or
re-pointed tensor is checked and uploads; bad inputs stay clear errors."""
import pytest
import torch

from amk.backends.cuda.runtime import CudaProgram
from amk.errors import TraceError
from amk.program.ir import BufferKind as BK, DType as D, InstructionKind as K
from amk.testing.cuda_examples import Builder


def _program():
    b = Builder("bind")
    x = b.buf("x", BK.IO_INPUT, D.F32, (8,))
    w = b.buf("w", BK.WEIGHT, D.F32, (8,))
    y = b.buf("y", BK.IO_OUTPUT, D.F32, (8,))
    b.task(K.ADD, [x, w], [y])
    b.outputs = [y]
    return b.program()


class _Cpu(CudaProgram):
    """CudaProgram's binding code around CPU buffers; uploads are counted, not done."""

    def __init__(self, program):
        self.program, self.device = program, torch.device("cpu")
        self.buffers = {bf.id: torch.zeros(bf.shape) for bf in program.buffers
                        if bf.kind in (BK.IO_INPUT, BK.IO_OUTPUT)}
        self._bound, self._bound_key, self._args, self.uploads = {}, None, None, 0
        self._bind_plan()

    def _upload_tables(self):
        self.uploads += 1
        self._args = b"args"


def test_same_tensors_skip_the_upload_and_new_addresses_upload():
    cp = _Cpu(_program())
    w = torch.ones(8)
    cp._bind({"x": torch.arange(8.0), "w": w})
    assert cp.uploads == 1 and torch.equal(cp.buffers[0], torch.arange(8.0))
    cp._bind({"x": torch.ones(8), "w": w})
    assert cp.uploads == 1 and torch.equal(cp.buffers[0], torch.ones(8))   # inputs still copied
    w.data = torch.zeros(8)                     # the same object, re-pointed: rebinds
    cp._bind({"x": torch.ones(8), "w": w})
    assert cp.uploads == 2 and cp._bound[1].data_ptr() == w.data_ptr()
    cp._bind({"x": torch.ones(8), "w": torch.ones(8)})
    assert cp.uploads == 3
    assert cp.output_buffers()[0] is cp.buffers[2] and cp.input_buffer("x") is cp.buffers[0]


def test_bad_bindings_are_clear_errors_after_the_fast_path():
    cp = _Cpu(_program())
    w = torch.ones(8)
    cp._bind({"x": torch.ones(8), "w": w})
    with pytest.raises(TraceError, match="expects F32"):
        cp._bind({"x": torch.ones(8), "w": torch.ones(9)})
    with pytest.raises(TraceError, match="expects F32"):
        cp._bind({"x": torch.ones(8, dtype=torch.float64), "w": w})
    with pytest.raises(TraceError, match="needs a tensor bound to 'w'"):
        cp._bind({"x": torch.ones(8)})
    with pytest.raises(TraceError, match="needs a tensor bound to 'x'"):
        cp._bind({"w": w})
    with pytest.raises(KeyError):
        cp.input_buffer("nope")
