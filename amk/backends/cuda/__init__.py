"""CUDA backend: one persistent megakernel per Program, NVRTC-compiled from templates.

render(program, options) -> CUDA C++; compile_cuda(program, arch, options) -> CUBIN bytes
(disk-cached); CudaProgram(program, device, options=...).run(bindings) -> outputs, with the
reference VM's binding contract. Its stages (folded program, tables, kernel.cu, cubin):
stages.build. Its settings: one frozen CudaOptions (options.py), built at the edge.

Everything but CudaOptions is imported on first use: every run builds CudaOptions at the edge,
and a CPU run (`amk generate` on the reference VM) should not pay for the code generator.
"""
from amk.backends.cuda.options import CudaOptions

_LAZY = {"render": "codegen", "compile_cuda": "compile", "compile_program": "compile",
         "compile_source": "compile", "CompileResult": "compile", "CudaProgram": "runtime"}


def __getattr__(name):
    if name in _LAZY:                 # runtime: imports torch.cuda / the driver
        import importlib
        return getattr(importlib.import_module(f"amk.backends.cuda.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'amk.backends.cuda' has no attribute {name!r}")


__all__ = ["render", "compile_cuda", "compile_program", "compile_source", "CompileResult",
           "CudaOptions", "CudaProgram"]
