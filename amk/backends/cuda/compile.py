"""NVRTC compilation of rendered sources to a CUBIN (never PTX: a newer NVRTC's PTX can be newer
than the driver accepts), with a disk cache keyed by everything that affects the binary.

Works without a GPU. The rendered source is freestanding (NVRTC built-ins only), so no CUDA
headers are needed; cuda-bindings 12.x and 13.x are both supported.
"""
from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from concurrent.futures import Future, wait as futures_wait
from dataclasses import dataclass

from amk.diskcache import write_atomic
from amk.errors import BackendUnavailable, CompileError
from amk.program.ir import Program
from amk.version import VERSION
from amk.backends.cuda.options import CudaOptions

SOURCE_NAME = "amk_megakernel.cu"
DEFAULT_OPTIONS = ("-std=c++17", "--ptxas-options=-v")


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        try:
            from cuda import nvrtc            # cuda-python < 12.6 layout
        except ImportError as e:
            raise BackendUnavailable(
                "the CUDA backend needs cuda-python's NVRTC bindings: "
                "pip install 'cuda-bindings' 'nvidia-cuda-nvrtc'") from e
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    nvrtc = _nvrtc()
    err, major, minor = nvrtc.nvrtcVersion()
    if int(err) != 0:
        raise BackendUnavailable(f"nvrtcVersion failed: {err}")
    return int(major), int(minor)


@dataclass
class CompileResult:
    cubin: bytes
    log: str                 # NVRTC + ptxas log (registers, spills)
    seconds: float           # wall time of the NVRTC compile (0 on a cache hit)
    cache_hit: bool
    key: str
    path: str


def _log(nvrtc, prog) -> str:
    err, n = nvrtc.nvrtcGetProgramLogSize(prog)
    buf = b" " * n
    nvrtc.nvrtcGetProgramLog(prog, buf)
    return buf.decode(errors="replace").rstrip("\x00 \n")


def numbered_excerpt(source: str, log: str, context: int = 4, max_sites: int = 5) -> str:
    """The source lines the NVRTC log points at, numbered, with ``context`` lines around."""
    lines = source.splitlines()
    sites = []
    for m in re.finditer(rf"{re.escape(SOURCE_NAME)}\((\d+)\)", log):
        n = int(m.group(1))
        if n not in sites:
            sites.append(n)
    if not sites:
        sites = [1]
    out = []
    for n in sites[:max_sites]:
        lo, hi = max(1, n - context), min(len(lines), n + context)
        for i in range(lo, hi + 1):
            out.append(f"{'>>' if i == n else '  '} {i:5d} | {lines[i - 1]}")
        out.append("   ...")
    return "\n".join(out)


def cache_key(source: str, arch: str, options: tuple[str, ...], cuda_options: CudaOptions) -> str:
    from amk.backends.cuda.codegen import template_hash
    h = hashlib.sha256()
    for part in (VERSION, template_hash(), hashlib.sha256(source.encode()).hexdigest(),
                 " ".join(options), arch, "%d.%d" % nvrtc_version(), cuda_options.key()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:32]


# Compiles started ahead (start_compile), by cache key: compile_source of the same key waits
# for one instead of compiling again. NVRTC releases the GIL, so the Python work between the
# start and the wait (the program's final proof, the pass cache's store) runs beside it.
_IN_FLIGHT: dict[str, Future] = {}
_IN_FLIGHT_LOCK = threading.Lock()


def _before_fork() -> None:
    """NVRTC is not fork-safe (a child forked while a compile ran hung in its own NVRTC call)
    and a child has no compiling threads: a fork waits for the compiles in flight, so the child
    inherits them finished. The lock is held across the fork: none starts meanwhile."""
    _IN_FLIGHT_LOCK.acquire()
    futures_wait(list(_IN_FLIGHT.values()))


def _after_fork() -> None:
    _IN_FLIGHT_LOCK.release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork,
                        after_in_child=_after_fork)


def _nvrtc_options(options: tuple[str, ...] | None, cuda_options: CudaOptions) -> tuple[str, ...]:
    if options is None:
        options = DEFAULT_OPTIONS + (("-lineinfo",) if cuda_options.lineinfo else ())
    return tuple(options)


def _cubin_path(cuda_options: CudaOptions, key: str) -> str:
    """Where the disk cache keeps key's CUBIN ("": no disk cache)."""
    d = cuda_options.cache_dir
    return str(d / "cuda" / f"{key}.cubin") if d is not None else ""


def _cached(path: str, key: str) -> CompileResult | None:
    """The disk cache's CUBIN at path ("": no cache), or None."""
    if path and os.path.exists(path):
        with open(path, "rb") as f:
            data = f.read()
        if data:
            logp = path[:-6] + ".log"
            log = open(logp).read() if os.path.exists(logp) else ""
            return CompileResult(data, log, 0.0, True, key, path)
    return None


def start_compile(source: str, arch: str = "sm_90a",
                  cuda_options: CudaOptions = CudaOptions()) -> None:
    """compile_source(source, arch, cuda_options=cuda_options) on a background thread, unless
    the disk cache has it or it already runs; its result (or error) goes to the
    compile_source call of the same source, arch and options."""
    options = _nvrtc_options(None, cuda_options)
    key = cache_key(source, arch, options, cuda_options)
    path = _cubin_path(cuda_options, key)
    with _IN_FLIGHT_LOCK:
        if key in _IN_FLIGHT or (path and os.path.exists(path)):
            return
        fut = _IN_FLIGHT[key] = Future()

    def run():
        try:
            fut.set_result(_compile(source, arch, options, key, path))
        except BaseException as e:      # handed to the waiting compile_source, raised there
            fut.set_exception(e)

    # not a daemon: a process that ends while NVRTC runs (a refused program, a script that only
    # lowers) waits for it at exit; a daemon thread inside NVRTC then crashes the interpreter
    threading.Thread(target=run, name="amk-nvrtc").start()


def compile_source(source: str, arch: str = "sm_90a", options: tuple[str, ...] | None = None,
                   use_cache: bool = True, cuda_options: CudaOptions = CudaOptions()) -> CompileResult:
    """Compile ``source`` to a CUBIN for ``arch`` (e.g. sm_90a), through the disk cache in
    cuda_options.cache_dir (none when it is None), or wait for the same compile started ahead
    (start_compile). ``options`` (NVRTC's) default: DEFAULT_OPTIONS, plus -lineinfo under
    cuda_options.lineinfo."""
    options = _nvrtc_options(options, cuda_options)
    if not re.fullmatch(r"sm_\d+[af]?", arch):
        raise CompileError(f"arch {arch!r} is not a real GPU architecture like 'sm_90a' "
                           "(AMK loads CUBINs, never PTX)")
    key = cache_key(source, arch, options, cuda_options)
    if use_cache:                       # a compile started ahead is as good as a cached one
        with _IN_FLIGHT_LOCK:
            fut = _IN_FLIGHT.pop(key, None)
        if fut is not None:
            return fut.result()
    path = _cubin_path(cuda_options, key) if use_cache else ""
    hit = _cached(path, key)
    if hit is not None:
        return hit
    return _compile(source, arch, options, key, path)


def _compile(source: str, arch: str, options: tuple[str, ...], key: str, path: str) -> CompileResult:
    """NVRTC: the CUBIN of source (and its log, into the disk cache when path is set)."""
    nvrtc = _nvrtc()
    t0 = time.perf_counter()
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), SOURCE_NAME.encode(), 0, [], [])
    if int(err) != 0:
        raise CompileError(f"nvrtcCreateProgram failed: {err}")
    try:
        opts = [f"--gpu-architecture={arch}".encode()] + [o.encode() for o in options]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        log = _log(nvrtc, prog)
        if int(err) != 0:
            raise CompileError(
                f"NVRTC could not compile the generated megakernel for {arch} ({err}).\n"
                f"Source excerpt:\n{numbered_excerpt(source, log)}\n\nNVRTC log:\n{log}\n"
                "Set AMK_DEBUG=4 or AMK_DUMP_IR=DIR to get the whole kernel.cu.")
        err, n = nvrtc.nvrtcGetCUBINSize(prog)
        if int(err) != 0:
            raise CompileError(f"nvrtcGetCUBINSize failed ({err}); is {arch} a real architecture?")
        buf = b" " * n
        (err,) = nvrtc.nvrtcGetCUBIN(prog, buf)
        if int(err) != 0:
            raise CompileError(f"nvrtcGetCUBIN failed: {err}")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    seconds = time.perf_counter() - t0
    if path:
        write_atomic(path[:-6] + ".log", log.encode())
        write_atomic(path, bytes(buf))
    return CompileResult(bytes(buf), log, seconds, False, key, path)


def arch_of(device) -> str:
    """The real architecture to compile for: the CUDA device's (with Hopper's 'a' features),
    sm_90a without one (a lowering on a machine without a GPU)."""
    import torch
    if getattr(device, "type", None) != "cuda" or not torch.cuda.is_available():
        return "sm_90a"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}" + ("a" if major == 9 else "")


def start_program(program: Program, n_ctas: int, arch: str,
                  options: CudaOptions = CudaOptions()) -> None:
    """start_compile of ``program``'s kernel on ``n_ctas`` queues (as CudaProgram will render
    it), for amk.jit to call before the program's final proof: as soon as the kernel spec is
    known, the tables packed beside NVRTC. Best effort: a program this fails on fails again,
    with its proper error, where it is compiled for real."""
    from amk.backends.cuda.codegen import render_spec
    from amk.backends.cuda.lowered_cache import lower_program_cached
    try:
        lower_program_cached(program, n_ctas, options,
                             on_spec=lambda spec: start_compile(render_spec(spec, options), arch, options))
    except Exception:
        return


def compile_cuda(program: Program, arch: str = "sm_90a",
                 options: CudaOptions = CudaOptions()) -> bytes:
    """The CUBIN of ``program``'s megakernel (see compile_program for timings)."""
    return compile_program(program, arch, options).cubin


def compile_program(program: Program, arch: str = "sm_90a",
                    options: CudaOptions = CudaOptions()) -> CompileResult:
    from amk.backends.cuda.codegen import render
    return compile_source(render(program, options), arch, cuda_options=options)
