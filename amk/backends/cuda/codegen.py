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

from amk.errors import CompileError
from amk.program.ir import Program
from amk.backends.cuda import abi
from amk.backends.cuda.abi import MAX_PTRS
from amk.backends.cuda.lowered_cache import lower_program_cached
from amk.backends.cuda.options import CudaOptions
from amk.backends.cuda.smem import NTHREADS, PRE_OFF, STAGE_BYTES, STAGE_OFF
from amk.backends.cuda.steps import RMS_RN, Variant
from amk.backends.cuda.kernel_spec import KernelSpec
from amk.backends.cuda.tables import Lowered

TEMPLATE_DIR = Path(__file__).with_name("templates")
# Order matters: later files use earlier ones.
TEMPLATE_FILES = ("common.cuh", "ops_simple.cuh", "ops_models.cuh", "gemv.cuh", "gemv_quant.cuh",
                  "gemv_batch.cuh", "attention.cuh", "attention_mma.cuh", "scheduler.cu")


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


def call_text(v: Variant) -> str:
    """The C++ call of a variant in the scheduler's switch: fn<args...>(AMK_ARGS)."""
    args = ", ".join(("true" if a else "false") if isinstance(a, bool) else str(a) for _, a in v.args)
    return f"{v.fn}<{args}>(AMK_ARGS)" if v.args else f"{v.fn}(AMK_ARGS)"


def render_lowered(low: Lowered, options: CudaOptions = CudaOptions()) -> str:
    """The kernel source of lowered tables (render_spec of their spec)."""
    return render_spec(low.spec, options)


def render_spec(spec: KernelSpec, options: CudaOptions = CudaOptions()) -> str:
    """The kernel source for a kernel spec (options.source instead, when set: an edited
    kernel.cu fed back for an experiment; it must match the tables' ABI)."""
    if options.source is not None:
        return options.source
    if spec.too_many:
        raise CompileError(f"CUDA backend: tasks {list(spec.too_many[:8])} have more than {MAX_PTRS} operands")
    cases = "\n".join(f"    case {i}: {call_text(v)}; break;" for i, v in enumerate(spec.variants))
    # the staged attention's early phase (attn_early), for the variants that have one
    early = "\n".join(f"    case {i}: {call_text(Variant('attn_early', v.args))}; break;"
                      for i, v in enumerate(spec.variants) if v.fn == "op_attention_smem")
    t = _templates()
    parts = [f"// AMK megakernel: {len(spec.variants)} instruction variants\n",
             f"#define AMK_NTHREADS {NTHREADS}\n"
             f"#define AMK_STAGE_OFF {STAGE_OFF}\n#define AMK_STAGE_BYTES {STAGE_BYTES}\n"
             f"#define AMK_SPIN_NS {options.spin_ns}\n#define AMK_CSTRIDE {options.counter_stride}\n"
             f"#define AMK_PRE {int(spec.pre)}\n#define AMK_PRE_OFF {PRE_OFF}\n"
             f"#define AMK_RMS_RN {RMS_RN}\n"
             # code for what the program does not use is not compiled (dead code in the hot
             # functions costs time: NOTES v16a)
             f"#define AMK_ZERO {int(spec.zero)}\n#define AMK_EARLY {int(spec.early)}\n",
             abi.render_header()]
    if options.profile:
        parts.insert(2, f"#define AMK_PROFILE 1\n#define AMK_PROF_W {abi.PROF_WORDS}\n"
                        f"#define AMK_PROF_STEPS {abi.PROF_STEPS}\n#define AMK_PROF_MARKS {abi.PROF_MARKS}\n"
                        f"#define AMK_PROF_HEAD {abi.PROF_HEAD}\n#define AMK_PROF_MARK0 {abi.PROF_MARK0}\n")
    for name in TEMPLATE_FILES[:-1]:
        parts.append(f"// ---- {name} ----\n" + t[name])
    parts.append("// ---- scheduler.cu ----\n"
                 + Template(t["scheduler.cu"]).substitute(cases=cases, early_cases=early,
                                                          max_ptrs=MAX_PTRS))
    return "\n".join(parts)


def render(program: Program, options: CudaOptions = CudaOptions()) -> str:
    """CUDA C++ source of ``program``'s megakernel (entry point ``amk_megakernel``)."""
    return render_lowered(lower_program_cached(program, options=options), options)
