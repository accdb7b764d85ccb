"""Render a Program into CUDA C++: the generated ABI header, the op templates, and the
scheduler with one switch case per instruction variant.

Templates are plain files in templates/; the only substitution is string.Template's ``$name``
in scheduler.cu (the variant switch and a size). Everything per-task lives in descriptors.
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from string import Template

from amk.program.ir import Program
from amk.backends.cuda import abi
from amk.backends.cuda.lower import RMS_RN, Lowered
from amk.backends.cuda.lowered_cache import lower_program_cached
from amk.backends.cuda.smem import PRE_OFF, RING_BYTES, RING_OFF, STREAM_WIN, WIN_OFF, launch_shape

TEMPLATE_DIR = Path(__file__).with_name("templates")
# Order matters: later files use earlier ones.
TEMPLATE_FILES = ("common.cuh", "ops_simple.cuh", "ops_models.cuh", "gemv.cuh", "gemv_pipe.cuh", "attention.cuh",
                  "scheduler.cu")
MAX_PTRS = 64                    # operands one task may have (a split-KV combine has P + 1)


@functools.lru_cache(maxsize=1)
def _templates() -> dict[str, str]:
    return {name: (TEMPLATE_DIR / name).read_text() for name in TEMPLATE_FILES}


def template_hash() -> str:
    """Hash of every template and of this module's ABI: part of the compile-cache key."""
    h = hashlib.sha256()
    for name, text in sorted(_templates().items()):
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    h.update(abi.render_header().encode())
    return h.hexdigest()[:16]


def render_lowered(low: Lowered, ctas_per_sm: int | None = None) -> str:
    """``ctas_per_sm`` None = amk.knobs.ctas_per_sm(); it sets the CTA's thread count and its
    launch bounds (the runtime launches with the same launch_shape)."""
    from amk import knobs
    from amk.errors import CompileError
    k = knobs.ctas_per_sm() if ctas_per_sm is None else int(ctas_per_sm)
    if k > 1 and knobs.gemv_ring():
        raise CompileError(f"CUDA backend: AMK_CTAS_PER_SM={k} leaves no room for the weight-stream "
                           "ring (196 KiB a CTA); set AMK_GEMV_RING=0 or AMK_CTAS_PER_SM=1")
    nt, _ = launch_shape(k)
    ring_stages, chunk = knobs.gemv_ring_shape()
    if not ring_stages:          # off: the stream's code still compiles, nothing calls it
        ring_stages, chunk = 4, RING_BYTES // 4
    pipe_v, pipe_s = knobs.gemv_pipe()
    # the ring area when neither the weight stream nor the pipe uses it: steps may stage there
    free_ring = RING_BYTES if k == 1 and not knobs.gemv_ring() and not pipe_v else 0
    pipe_on = int(bool(pipe_v))
    if not pipe_v:               # off: the template still compiles, nothing calls it
        pipe_v, pipe_s = 1, 2
    too_many = [int(t["task_id"]) for t in low.tasks if t["n_in"] + t["n_out"] > MAX_PTRS]
    if too_many:
        raise CompileError(f"CUDA backend: tasks {too_many[:8]} have more than {MAX_PTRS} operands")
    cases = "\n".join(f"    case {i}: {call}; break;" for i, call in enumerate(low.variants))
    t = _templates()
    parts = [f"// AMK megakernel: {len(low.variants)} instruction variants\n",
             f"#define AMK_NTHREADS {nt}\n#define AMK_CTAS_PER_SM {k}\n"
             f"#define AMK_RING_OFF {RING_OFF}\n#define AMK_FREE_RING {free_ring}\n"
             f"#define AMK_RING_STAGES {ring_stages}\n#define AMK_CHUNK {chunk}\n"
             f"#define AMK_WIN_OFF {WIN_OFF}\n#define AMK_WIN {STREAM_WIN}\n"
             f"#define AMK_PIPE_V {pipe_v}\n#define AMK_PIPE_S {pipe_s}\n#define AMK_PIPE_ON {pipe_on}\n"
             f"#define AMK_SPIN_NS {knobs.spin_ns()}\n#define AMK_CSTRIDE {knobs.counter_stride()}\n"
             f"#define AMK_PF {int(any(t['n_pf'] for t in low.tasks))}\n"
             f"#define AMK_PF_OWN {int(knobs.l2_prefetch() == 2)}\n"
             f"#define AMK_PRE {int(any(t['n_pre'] for t in low.tasks))}\n#define AMK_PRE_OFF {PRE_OFF}\n"
             f"#define AMK_RMS_RN {RMS_RN}\n"
             # code for what the program does not use is not compiled (dead code in the hot
             # functions costs time: NOTES v16a)
             f"#define AMK_STREAM {int(len(low.stream) > 0)}\n"
             f"#define AMK_ZERO {int(any(t['n_zero'] for t in low.tasks))}\n",
             abi.render_header()]
    if knobs.profile():
        parts.insert(2, f"#define AMK_PROFILE 1\n#define AMK_PROF_W {abi.PROF_WORDS}\n")
    for name in TEMPLATE_FILES[:-1]:
        parts.append(f"// ---- {name} ----\n" + t[name])
    parts.append("// ---- scheduler.cu ----\n"
                 + Template(t["scheduler.cu"]).substitute(cases=cases, max_ptrs=MAX_PTRS))
    return "\n".join(parts)


def render(program: Program) -> str:
    """CUDA C++ source of ``program``'s megakernel (entry point ``amk_megakernel``)."""
    return render_lowered(lower_program_cached(program))
