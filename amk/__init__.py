"""AMK: automatic megakernels. A model's decode step, written with amk.ops, compiled into one
persistent GPU kernel (or run on the reference VM, the correctness oracle)."""
from amk import ops
from amk.errors import (AmkError, BackendUnavailable, CompileError, DeadlockError, TraceError,
                        ValidationError)
from amk.jit import Jitted, Lowered, jit
from amk.quant import QuantizedWeight, dequantize, quantize
from amk.version import VERSION

__version__ = VERSION


def validate(program):
    """Structural proof that a Program is race- and deadlock-free; see amk/program/validate.py."""
    from amk.program.validate import validate as _validate
    return _validate(program)


def __getattr__(name):
    if name == "models":                     # imported lazily: it pulls in transformers
        import importlib
        return importlib.import_module("amk.models")
    raise AttributeError(f"module 'amk' has no attribute {name!r}")


__all__ = ["ops", "jit", "Jitted", "Lowered", "validate", "QuantizedWeight", "quantize",
           "dequantize", "AmkError", "TraceError", "ValidationError", "DeadlockError",
           "CompileError", "BackendUnavailable", "__version__"]
