"""CUDA backend: one persistent megakernel per Program, NVRTC-compiled from templates.

render(program, options) -> CUDA C++; compile_cuda(program, arch, options) -> CUBIN bytes
(disk-cached); CudaProgram(program, device, options=...).run(bindings) -> outputs, with the
reference VM's binding contract. Its stages (folded program, tables, kernel.cu, cubin):
stages.build. Its settings: one frozen CudaOptions (options.py), built at the edge.
"""
from amk.backends.cuda.codegen import render
from amk.backends.cuda.compile import CompileResult, compile_cuda, compile_program, compile_source
from amk.backends.cuda.options import CudaOptions


def __getattr__(name):
    if name == "CudaProgram":                # imports torch.cuda / the driver lazily
        from amk.backends.cuda.runtime import CudaProgram
        return CudaProgram
    raise AttributeError(name)


__all__ = ["render", "compile_cuda", "compile_program", "compile_source", "CompileResult",
           "CudaOptions", "CudaProgram"]
