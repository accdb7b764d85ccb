"""The CUDA backend's stages, as the passes' are: the folded program and the lowered tables as
text, the kernel source and the cubin (Lowered.stages after `place`; AMK_DUMP_IR writes them).
Every opcode is printed by name."""
from __future__ import annotations

from dataclasses import dataclass

from amk.errors import BackendUnavailable
from amk.program.ir import InstructionKind as K, Program
from amk.backends.cuda import abi
from amk.backends.cuda.codegen import call_text, render_lowered
from amk.backends.cuda.compile import CompileResult, compile_source
from amk.backends.cuda.lower import fold_program
from amk.backends.cuda.options import CudaOptions
from amk.backends.cuda.steps import REF_BUFFER, Folded, View
from amk.backends.cuda.tables import Lowered, pack


@dataclass
class CudaBuild:
    """Every stage of one CUDA build of a program."""
    folded: Folded
    lowered: Lowered
    source: str
    compiled: CompileResult | None       # None: no NVRTC here (why: `missing`)
    missing: str = ""

    def stages(self) -> dict[str, str]:
        r = self.compiled
        cubin = (f"cubin: {len(r.cubin)} bytes, key {r.key}, "
                 f"{'cache hit' if r.cache_hit else f'NVRTC {r.seconds:.1f} s'}" if r is not None
                 else f"cubin: not built ({self.missing})")
        return {"cuda_folded": folded_text(self.folded), "cuda_tables": tables_text(self.lowered),
                "kernel.cu": self.source, "cubin": cubin}


def build(program: Program, n_ctas: int, arch: str, options: CudaOptions) -> CudaBuild:
    folded = fold_program(program, n_ctas, options)
    lowered = pack(program, folded)
    source = render_lowered(lowered, options)
    try:
        return CudaBuild(folded, lowered, source, compile_source(source, arch, cuda_options=options))
    except BackendUnavailable as e:          # the text stages need no NVRTC
        return CudaBuild(folded, lowered, source, None, str(e).splitlines()[0])


def _view_text(v: View) -> str:
    where = f"b{v.ref[1]}" if v.ref[0] == REF_BUFFER else f"scratch@{v.ref[1]}"
    return f"{where}:{v.dtype.name.lower()}{list(v.shape)}"


def _step_text(enc, ins, outs) -> str:
    fn = call_text(enc.variant) if enc.variant is not None else "(nothing to run)"
    params = " ".join(f"{k}={v}" for k, v in {**enc.ip, **enc.fp}.items())
    return (f"{K(enc.op).name} {fn}\n      ({', '.join(map(_view_text, ins))}) -> "
            f"({', '.join(map(_view_text, outs))})  {params}")


def folded_text(f: Folded) -> str:
    """One block a task: its steps after every fold (variant, operands, parameters), the scratch
    it zeroes and the rows the task before it preloads for it."""
    lines = [f"# {len(f.tasks)} tasks on {len(f.queues)} queues, {f.scratch_bytes} scratch bytes"]
    for ft in f.tasks:
        t = ft.task
        kind = "one instruction" if ft.one else f"{len(ft.steps)} steps"
        lines.append(f"task {t.id} {t.name or t.op.name} ({t.op.name}, {kind})")
        for i, (enc, ins, outs) in enumerate(ft.steps):
            lines.append(f"  {i}: {_step_text(enc, ins, outs)}")
        if ft.zero:
            lines.append(f"  zero: {ft.zero}")
        if ft.preload:
            lines.append(f"  preloaded rows: {[(_ref(r), o, n) for r, o, n in ft.preload]}")
    return "\n".join(lines)


def _ref(r) -> str:
    return f"b{r[1]}" if r[0] == REF_BUFFER else f"scratch@{r[1]}"


def tables_text(low: Lowered) -> str:
    """The descriptor arrays as packed: variants, one line a descriptor (fields that are not 0,
    ip/fp slots by name), waits, ranges and queues."""
    lines = [f"# variants ({len(low.variants)})"]
    lines += [f"v{i}: {call_text(v)}" for i, v in enumerate(low.variants)]
    lines.append(f"# descriptors ({low.n_program_tasks} tasks, "
                 f"{len(low.tasks) - low.n_program_tasks} FUSED steps)")
    skip = ("op", "ip", "fp", "wait_c", "wait_t", "wait_s")
    for i, d in enumerate(low.tasks):
        op = K(int(d["op"]))
        group = abi.OP_GROUP.get(op)
        fields = " ".join(f"{n}={int(d[n])}" for n in d.dtype.names if n not in skip and d[n])
        ip = ([f"{n}={int(d['ip'][j])}" for j, n in enumerate(abi.IP_SLOTS[group]) if d["ip"][j]]
              if group else [])
        fp = ([f"{n}={float(d['fp'][j]):g}" for j, n in enumerate(abi.FP_SLOTS.get(group, ())) if d['fp'][j]]
              if group else [])
        lines.append(f"d{i} {op.name} {fields} {' '.join(ip + fp)}".rstrip())
    lines.append(f"# waits ({len(low.waits)}): (counter, threshold, stride)")
    lines += [f"w{i}: {int(w['counter'])} {int(w['threshold'])} {int(w['stride'])}"
              for i, w in enumerate(low.waits)]
    lines.append(f"# ranges ({len(low.ranges)}): (ref, byte offset, bytes)")
    lines += [f"r{i}: {_ref(r)} {o} {n}" for i, (r, o, n) in enumerate(low.ranges)]
    lines.append(f"# pointers ({len(low.ptr_refs)}); queues ({len(low.queues)}); "
                 f"{low.scratch_bytes} scratch bytes")
    lines += [f"q{i}: {q}" for i, q in enumerate(low.queues)]
    return "\n".join(lines)
