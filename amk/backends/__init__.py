"""Backends run a validated Program: reference (the oracle), cuda (one persistent kernel),
triton (one launch per task). Each exposes `run(bindings) -> list[Tensor]`, bindings mapping
every input/weight/kv buffer's source path to a tensor."""
from __future__ import annotations

import torch

from amk.errors import BackendUnavailable
from amk.program.ir import Program


def resolve_device(device, who: str, hint: str) -> torch.device:
    """torch.device(device) with a concrete CUDA index; a clear error when CUDA is absent."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise BackendUnavailable(f"{who}(device={device!r}): torch sees no CUDA device; {hint}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def make_executable(program: Program, backend: str, device: torch.device, cuda_options=None,
                    vm_timeout_s: float | None = None):
    """cuda_options: the CUDA backend's CudaOptions (None: its defaults); vm_timeout_s: the
    reference VM's wall-clock limit per run (None: its default)."""
    _refuse_collectives(program, backend)
    if backend == "reference":
        from amk.backends.reference.vm import DEFAULT_TIMEOUT_S, ReferenceVM
        return ReferenceVM(program, device=device, timeout_s=vm_timeout_s or DEFAULT_TIMEOUT_S)
    if backend == "cuda":
        if device.type != "cuda":
            raise BackendUnavailable(f"backend 'cuda' needs CUDA tensors; the arguments are on {device}")
        from amk.program.positions import prompt_block_tasks
        blocks = prompt_block_tasks(program)
        if blocks:   # the megakernel reads one position a sequence (pos[0], or pos[b])
            raise BackendUnavailable(
                f"backend 'cuda' runs one position per sequence; program {program.name!r} reads "
                f"several for one cache (a prompt chunk) in task {blocks[0].id} "
                f"{blocks[0].name!r}: run prefill chunks on the triton backend (Model.generate "
                f"does)")
        from amk.backends.cuda import CudaProgram
        from amk.backends.cuda.options import CudaOptions
        # Asynchronous steps: a fault raises at the next call or at Jitted.sync()
        return CudaProgram(program, device=device, options=cuda_options or CudaOptions(),
                           sync_each_run=False)
    if backend == "triton":
        from amk.backends.triton.backend import TritonProgram
        # On a GPU the step is captured once in a CUDA graph and replayed (no per-launch gaps).
        return TritonProgram(program, device=device, capture_graph=device.type == "cuda")
    raise BackendUnavailable(f"unknown backend {backend!r}: choose reference, cuda or triton")


def _refuse_collectives(program: Program, backend: str) -> None:
    """A rank program's all-reduces need its peers: the GPU backends run one device's program
    alone, so they would compute one rank's part as if it were the sum."""
    from amk.program.collectives import collective_tasks
    coll = collective_tasks(program)
    if backend != "reference" and coll:
        t = coll[0]
        raise BackendUnavailable(
            f"backend {backend!r} cannot run program {program.name!r}: task {t.id} {t.name!r} is "
            f"a cross-rank all-reduce (rank {t.params.get('rank')} of {t.params.get('world')}); "
            f"tensor-parallel programs run on the reference backend's rank simulator "
            f"(Model.shard(n)); the multi-GPU all-reduce is not implemented yet "
            f"(docs/TENSOR_PARALLEL.md)")
