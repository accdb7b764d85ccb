"""amk.jit: trace once per abstract signature, compile through the pass pipeline, run a backend.

    step = amk.jit(decode_step, donate=("kv",))
    token = step(params, token, pos, kv)      # traces + compiles on the first call only
    low = step.lower(params, token, pos, kv)  # .graph, .stages, .program

The signature is the pytree structure, every leaf's shape and dtype, the static arguments and
the backend. New data (a new token, a new decode position) is not a new signature.
"""
from __future__ import annotations

import functools
import inspect
import operator
import time
from itertools import compress
from typing import Any, Callable, Sequence

import torch

from amk import knobs, pytree
from amk.errors import TraceError
from amk.graph import Graph
from amk.passes.dump import dump_stages
from amk.passes.options import PassOptions
from amk.passes.pipeline import run_pipeline, run_pipeline_cached
from amk.program.ir import BufferKind, Program
from amk.trace import trace

BACKENDS = ("reference", "cuda", "triton")


class Lowered:
    """The staged result of tracing and compiling one signature."""

    def __init__(self, graph: Graph, program: Program, programs: dict[str, Program] | None,
                 out_treedef, options, timings: dict[str, float], backend: str = "reference",
                 cuda_options=None):
        self.graph = graph
        self.program = program          # the final program, what backends run
        self._programs = programs       # None after a cache hit: recomputed when asked for
        self.out_treedef = out_treedef
        self.options = options
        self.timings = timings
        self.backend = backend
        self.cuda_options = cuda_options if cuda_options is not None else knobs.cuda_options()
        self._stages: dict[str, str] | None = None
        self._cuda_build = None

    @property
    def programs(self) -> dict[str, Program]:
        """{pass name: program after it}, in pipeline order."""
        if self._programs is None:
            self._programs = run_pipeline(self.graph, self.options)
        return self._programs

    @property
    def stages(self) -> dict[str, str]:
        """{"graph": text, "lower": text, "tile": text, ...}, rendered on first access; for the
        cuda backend the backend's stages follow: "cuda_folded", "cuda_tables", "kernel.cu" and
        "cubin" (a summary line; cuda_build().compiled.cubin is the binary)."""
        if self._stages is None:
            from amk.program.text import program_to_text
            self._stages = {"graph": str(self.graph)}
            self._stages.update({k: program_to_text(p) for k, p in self.programs.items()})
            if self.backend == "cuda":
                self._stages.update(self.cuda_build().stages())
        return self._stages

    def cuda_build(self, arch: str = "sm_90a"):
        """The CUDA backend's stages of this program for ``arch`` (NVRTC only, no GPU)."""
        if self._cuda_build is None or self._cuda_build[0] != arch:
            from amk.backends.cuda.stages import build
            self._cuda_build = (arch, build(self.program, self.options.target.num_sms, arch,
                                            self.cuda_options))
        return self._cuda_build[1]

    def compile_cuda(self, arch: str = "sm_90a") -> bytes:
        """The CUBIN for this program (works without a GPU: NVRTC only)."""
        from amk.backends.cuda import compile_cuda
        return compile_cuda(self.program, arch, self.cuda_options)

    def executable(self, backend: str, device: torch.device):
        from amk.backends import make_executable
        return make_executable(self.program, backend, device, self.cuda_options,
                               vm_timeout_s=knobs.vm_timeout_s())


def _default_backend(device: torch.device) -> str:
    b = knobs.backend()
    if b:
        return b
    return "cuda" if device.type == "cuda" else "reference"


class Jitted:
    def __init__(self, fn: Callable, backend: str | None = None, donate: Sequence[str] = (),
                 weights: Sequence[str] = ("params",), static_argnames: Sequence[str] = (),
                 options=None):
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"amk.jit: unknown backend {backend!r}; choose one of {BACKENDS}")
        self.fn = fn
        self.backend = backend
        self.donate = tuple(donate)
        self.weights = tuple(weights)
        self.static_argnames = tuple(static_argnames)
        self.options = options
        self.sig = inspect.signature(fn)
        for n in (*self.donate, *self.static_argnames):
            if n not in self.sig.parameters:
                raise ValueError(f"amk.jit: {fn.__name__} has no argument named {n!r}")
        self.trace_count = 0
        self._cuda_options = None           # built from the knobs at the first call, once
        self._cache: dict[Any, Lowered] = {}
        self._executables: dict[Any, Any] = {}
        self._fast: _FastCall | None = None     # the last plain call, for the per-call fast path
        self._accessors: dict[Any, Callable] = {}
        self._last_tds = None
        functools.update_wrapper(self, fn)

    # -- signature -----------------------------------------------------------------------
    def _split(self, args, kwargs):
        bound = self.sig.bind(*args, **kwargs)
        bound.apply_defaults()
        dyn, static = [], []
        for name, val in bound.arguments.items():
            if name in self.static_argnames:
                static.append((name, val))
            else:
                dyn.append((name, val))
        return dyn, tuple(static)

    def _kind(self, name: str) -> BufferKind:
        if name in self.donate:
            return BufferKind.KV_CACHE
        if name in self.weights:
            return BufferKind.WEIGHT
        return BufferKind.IO_INPUT

    def _flatten(self, dyn, with_paths: bool = True):
        leaves, paths, tds = [], [], []
        for name, val in dyn:
            lv, ps, td = pytree.flatten(val, name, with_paths=with_paths)
            leaves += lv
            paths += ps
            tds.append(td)
        return leaves, paths, tuple(tds)

    def _key(self, dyn, static, leaves, tds, backend):
        avals = tuple((tuple(t.shape), t.dtype) for t in leaves)
        try:
            hash(static)
        except TypeError:
            raise TraceError(f"amk.jit: static arguments must be hashable, got {static!r}") from None
        return (tds, avals, static, backend, str(self.options), self.cuda_options.key())

    @property
    def cuda_options(self):
        """The CUDA backend's options: read from the knobs once, at this function's first use."""
        if self._cuda_options is None:
            self._cuda_options = knobs.cuda_options()
        return self._cuda_options

    # -- staging -----------------------------------------------------------------------------
    def _lower(self, dyn, static, leaves, backend: str, device: torch.device) -> Lowered:
        names = [n for n, _ in dyn]
        fn = self.fn
        if static:
            fn = functools.partial(self.fn, **dict(static))
        t0 = time.perf_counter()
        graph, out_td = trace(fn, [v for _, v in dyn], names, [self._kind(n) for n in names],
                              name=getattr(self.fn, "__name__", "fn"))
        self.trace_count += 1
        t1 = time.perf_counter()
        opts = self.options if self.options is not None else PassOptions.for_backend(backend, device)
        debug = knobs.debug()          # the pass and dump knobs, read once per compile
        program, programs, hit = run_pipeline_cached(graph, opts, knobs.cache_dir(), debug,
                                                     self._compile_ahead(backend, device, opts))
        t2 = time.perf_counter()
        low = Lowered(graph, program, programs, out_td, opts,
                      {"trace_s": t1 - t0, "passes_s": t2 - t1, "cache_hit": hit},
                      backend, self.cuda_options)
        dump_stages(low, knobs.dump_ir_dir(), knobs.print_ir_after(), debug)
        return low

    def _compile_ahead(self, backend: str, device: torch.device, opts: PassOptions):
        """For a step that will run on a GPU, the cuda backend's NVRTC started on the final
        program before its proof (NVRTC releases the GIL: the ~0.5 s proof of a 20k-task
        program runs beside it). A lowering of CPU or meta tensors compiles nothing ahead."""
        if backend != "cuda" or device.type != "cuda":
            return None
        from amk.backends.cuda.compile import arch_of, start_program
        return functools.partial(start_program, n_ctas=opts.target.num_sms, arch=arch_of(device),
                                 options=self.cuda_options)

    def _prepare(self, args, kwargs):
        dyn, static = self._split(args, kwargs)
        leaves, _, tds = self._flatten(dyn, with_paths=False)     # paths: from the graph
        device = _device_of(leaves, lambda: self._flatten(dyn)[1])
        backend = self.backend or _default_backend(device)
        key = self._key(dyn, static, leaves, tds, backend)
        self._last_tds = tds                  # for _remember: no second flatten
        low = self._cache.get(key)
        if low is None:
            low = self._cache[key] = self._lower(dyn, static, leaves, backend, device)
        return low, key, leaves, low.graph.input_paths, device, backend

    def lower(self, *args, **kwargs) -> Lowered:
        return self._prepare(args, kwargs)[0]

    # -- running -------------------------------------------------------------------------------
    def executable(self, *args, **kwargs):
        """(backend executable, bindings) for these arguments: for benchmarks and tools that
        drive a backend directly (e.g. replay the CUDA megakernel's launch from a graph)."""
        return self._executable(*self._prepare(args, kwargs))[1:]

    def _executable(self, low, key, leaves, paths, device, backend):
        exe = self._executables.get((key, device))
        if exe is None:
            exe = self._executables[(key, device)] = low.executable(backend, device)
        return low, exe, dict(zip(paths, leaves))

    def sync(self) -> None:
        """Wait for every step launched so far and raise a fault any of them recorded (cuda
        steps launch and return; their faults otherwise show at the next call)."""
        for exe in self._executables.values():
            if callable(getattr(exe, "check", None)):
                exe.check()

    def _fast_prepare(self, args):
        """The last call's signature again, when args hold the same structure and every leaf
        that is not the last call's tensor object has its shape, dtype and device (a leaf
        that is the same object is not re-checked: the backend checks its address)."""
        f = self._fast
        if f is None or len(args) != f.nargs:
            return None
        try:
            leaves = f.access(args)
        except (KeyError, IndexError, TypeError, AttributeError):
            return None
        if leaves is None:
            return None
        last = f.leaves
        for i in compress(range(len(leaves)), map(operator.is_not, leaves, last)):
            t = leaves[i]
            if (not isinstance(t, torch.Tensor) or t.shape != last[i].shape
                    or t.dtype != last[i].dtype or t.device != f.device):
                return None
        f.leaves = leaves
        return f.prepared[:2] + (leaves,) + f.prepared[3:]

    def _remember(self, args, kwargs, prepared) -> None:
        """Keep what the fast path needs: only for plain positional calls of every argument."""
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        params = self.sig.parameters.values()
        if (kwargs or self.static_argnames or len(args) != len(params)
                or any(p.kind not in kinds for p in params)):
            self._fast = None
            return
        tds = self._last_tds
        access = self._accessors.get(tds)
        if access is None:                    # one per structure (prefill and decode alternate)
            access = self._accessors[tds] = pytree.accessor(tds)
        self._fast = _FastCall(len(args), access, prepared[2], prepared[4], prepared)

    def __call__(self, *args, **kwargs):
        prepared = self._fast_prepare(args) if not kwargs else None
        if prepared is None:
            prepared = self._prepare(args, kwargs)
            self._remember(args, kwargs, prepared)
        low, key, leaves, paths, device, backend = prepared
        fast = self._fast
        if fast is not None and fast.exe is not None and fast.prepared[1] is key:
            exe, bindings = fast.exe, dict(zip(paths, leaves))    # no hash of the long key
        else:
            low, exe, bindings = self._executable(low, key, leaves, paths, device, backend)
            if fast is not None and fast.prepared[1] is key:
                fast.exe = exe
        try:
            outs = exe.run(bindings)
        except BaseException:
            # A failed run may leave a backend's counters mid-step: drop the executable so the
            # next call builds a fresh one from the (still valid) compiled program.
            self._executables.pop((key, device), None)
            self._fast = None
            raise
        outs = [o if o.shape == v.aval.shape else o.view(v.aval.shape)
                for o, v in zip(outs, low.graph.outputs)]
        return pytree.unflatten(low.out_treedef, outs)


class _FastCall:
    """The last plain call of a Jitted: its structure's accessor, leaves and _prepare result."""

    def __init__(self, nargs, access, leaves, device, prepared):
        self.nargs, self.access, self.leaves, self.device = nargs, access, leaves, device
        self.prepared = prepared
        self.exe = None


def _device_of(leaves: Sequence[torch.Tensor], paths: Callable[[], Sequence[str]]) -> torch.device:
    if not leaves:
        return torch.device("cpu")
    dev = leaves[0].device
    for i, t in enumerate(leaves):
        if t.device != dev:
            p = paths()
            raise TraceError(f"amk.jit: {p[i]} is on {t.device} but {p[0]} is on {dev}; "
                             f"all arguments must be on one device")
    return dev


def jit(fn: Callable | None = None, **kw) -> Jitted | Callable[[Callable], Jitted]:
    """Decorator or function: amk.jit(fn, backend=..., donate=("kv",), weights=("params",))."""
    if fn is None:
        return lambda f: Jitted(f, **kw)
    return Jitted(fn, **kw)
