"""CUDA backend: one persistent megakernel per Program, NVRTC-compiled from templates.

render(program) -> CUDA C++; compile_cuda(program, arch) -> CUBIN bytes (disk-cached);
CudaProgram(program, device).run(bindings) -> outputs, with the reference VM's binding contract.
"""
from amk.backends.cuda.codegen import render
from amk.backends.cuda.compile import CompileResult, compile_cuda, compile_program, compile_source


def __getattr__(name):
    if name == "CudaProgram":                # imports torch.cuda / the driver lazily
        from amk.backends.cuda.runtime import CudaProgram
        return CudaProgram
    raise AttributeError(name)


__all__ = ["render", "compile_cuda", "compile_program", "compile_source", "CompileResult",
           "CudaProgram"]
