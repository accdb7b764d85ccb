"""Program -> the CUDA backend's tables: task descriptors, waits, pointer references, prefetch
ranges, and the list of device-function variants the renderer turns into a switch.

Nothing here touches a GPU: pointers are symbolic (a buffer id or a scratch-arena offset) and
the runtime resolves them once the buffers are bound. Per-task parameters live in descriptors,
so the rendered source depends only on the set of (opcode, dtypes, shape class) variants, never
on the number of tasks: a Llama program renders to a few dozen functions and compiles in seconds.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from amk import knobs
from amk.errors import CompileError
from amk.program.ir import Buffer, BufferKind, DType, InstructionKind as K, Program, Task
from amk.program.regions import NEW_KV
from amk.backends.cuda import abi
from amk.backends.cuda.smem import XS_MAX, launch_shape

# C++ type of each buffer dtype in the templates (bf16/f16 are freestanding bit structs).
CTYPE = {DType.F32: "float", DType.F16: "f16", DType.BF16: "bf16", DType.I32: "int",
         DType.I64: "long long", DType.I8: "signed char", DType.U8: "unsigned char"}
RECIPE_DTYPES = {"float32": DType.F32, "float16": DType.F16, "bfloat16": DType.BF16,
                 "int8": DType.I8, "int32": DType.I32,
                 **{d.short: d for d in (DType.F32, DType.F16, DType.BF16, DType.I32, DType.I8,
                                         DType.U8)}}
FLOATS = (DType.F32, DType.F16, DType.BF16)
HD_MAX = 256            # largest attention head_dim the templates handle
RMS_RN = 8              # row elements a thread of rms_row holds (the kernel's AMK_RMS_RN)
SCRATCH_ALIGN = 256

REF_BUFFER, REF_SCRATCH = 0, 1


@dataclass(frozen=True)
class View:
    """What an op sees of one operand: shape, dtype, where it lives, and what it is."""
    shape: tuple[int, ...]
    dtype: DType
    ref: tuple[int, int]                 # (REF_BUFFER, buffer id) or (REF_SCRATCH, byte offset)
    kind: BufferKind | None = None       # None for FUSED scratch

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def cols(self) -> int:
        return self.shape[-1] if self.shape else 1

    @property
    def esize(self) -> int:
        return self.dtype.itemsize


@dataclass
class Encoded:
    """One descriptor's content, before it is packed."""
    op: int
    call: str | None                     # C++ call of the device function; None = nothing to run
    ip: dict[str, int] = field(default_factory=dict)
    fp: dict[str, float] = field(default_factory=dict)
    group: str = ""
    prefetch: list[tuple[tuple[int, int], int, int]] = field(default_factory=list)  # (ref, off, n)
    chunks: list[tuple[tuple[int, int], int, int]] = field(default_factory=list)    # weight stream
    direct: dict[str, Any] | None = None     # op_gemv_direct's template arguments (_direct_call)


@dataclass
class Lowered:
    variants: list[str]
    tasks: np.ndarray                    # TASK_DTYPE, program tasks first then FUSED steps
    n_program_tasks: int
    waits: np.ndarray                    # WAIT_DTYPE
    ptr_refs: np.ndarray                 # int64 [n, 2]: (kind, buffer id | scratch offset)
    ranges: list[tuple[tuple[int, int], int, int]]   # (ref, byte offset, bytes): prefetch,
                                                     # preload, zero
    scratch_bytes: int
    queues: list[list[int]]              # per-CTA task ids (program order within a queue)
    stream: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))   # range indices
    stream_off: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int32))  # per CTA


class _Err(CompileError):
    pass


def _fail(task, msg: str) -> None:
    where = f"task {task.id} ({task.name or task.op.name})" if task is not None else "program"
    raise CompileError(f"CUDA backend: {where}: {msg}")


def _ct(task, dt: DType) -> str:
    if dt not in CTYPE:
        _fail(task, f"dtype {dt.name} is not supported by the CUDA templates")
    return CTYPE[dt]


def _ft(task, dt: DType) -> str:
    if dt not in FLOATS:
        _fail(task, f"expected a float dtype (f32/f16/bf16), got {dt.name}")
    return CTYPE[dt]


def _b(v: bool) -> str:
    return "true" if v else "false"


def _col_range(task, params, out: View) -> tuple[int, int]:
    lo = int(params.get("n_off", 0))
    nt = params.get("N_tile")
    hi = out.cols if nt is None else lo + int(nt)
    if not 0 <= lo <= hi <= out.cols:
        _fail(task, f"column tile [{lo}, {hi}) is outside the output's {out.cols} columns")
    return lo, hi


def _bcast(task, x: View, out: View) -> tuple[int, int]:
    """(row stride, col stride) of an elementwise operand read as the output (see tile_view)."""
    C = out.cols
    R = out.numel // max(C, 1)
    if x.numel == out.numel:
        return C, 1
    if x.numel == C and x.cols == C:
        return 0, 1
    if x.numel == 1:
        return 0, 0
    if x.cols == 1 and x.numel == R:
        return 1, 0
    _fail(task, f"operand of shape {x.shape} does not broadcast to the output {out.shape}")
    return 0, 0


# ---------------------------------------------------------------------------------------------
# One encoder per opcode: (task for errors, inputs, outputs, params) -> Encoded
# ---------------------------------------------------------------------------------------------
_EW = {K.COPY: "COPY", K.ADD: "ADD", K.MUL: "MUL", K.SILU_MUL: "SILU_MUL", K.GELU: "GELU"}


def _enc_elementwise(t, op, ins, outs, p) -> Encoded:
    out = outs[0]
    kind = _EW[op]
    n_args = {"COPY": 1, "GELU": 1, "ADD": 2, "SILU_MUL": 2, "MUL": 2}[kind]
    if op == K.MUL and len(ins) == 1:
        kind, n_args = "MULS", 1
    if len(ins) < n_args:
        _fail(t, f"{op.name} needs {n_args} inputs, got {len(ins)}")
    a = ins[0]
    b = ins[1] if n_args == 2 else ins[0]
    c0, c1 = _col_range(t, p, out)
    ars, acs = _bcast(t, a, out)
    brs, bcs = _bcast(t, b, out)
    ta = _ct(t, a.dtype)
    tb = _ct(t, b.dtype)
    ty = _ct(t, out.dtype)
    e = Encoded(int(op), f"op_ew<EW_{kind}, {ty}, {ta}, {tb}>(AMK_ARGS)", group="EW")
    e.ip = dict(ROWS=out.numel // out.cols, COLS=out.cols, C0=c0, C1=c1, A_RS=ars, A_CS=acs,
                B_RS=brs, B_CS=bcs, KIND=abi.EW_KINDS.index(kind))
    e.fp = dict(SCALE=float(p.get("scale", 1.0)))
    return e


def _enc_allreduce(t, op, ins, outs, p) -> Encoded:
    out = outs[0]
    for x in ins:
        if x.numel != out.numel or x.dtype != ins[0].dtype:
            _fail(t, "ALLREDUCE_SHARD inputs must all have the output's numel and one dtype")
    e = Encoded(int(op), f"op_allreduce<{_ct(t, out.dtype)}, {_ct(t, ins[0].dtype)}>(AMK_ARGS)",
                group="RED")
    e.ip = dict(N=out.numel)
    return e


def _weight_prefetch(x: View, off: int, nbytes: int, e: Encoded) -> None:
    if x.kind in (BufferKind.WEIGHT, BufferKind.CONST) and nbytes > 0 and knobs.l2_prefetch() in (1, 2):
        e.prefetch.append((x.ref, off, nbytes))


def _enc_gemv(t, op, ins, outs, p) -> Encoded:
    x, w, out = ins[0], ins[1], outs[0]
    Kd = int(p.get("K", x.cols))
    if Kd <= 0 or x.numel % Kd:
        _fail(t, f"x of {x.numel} elements is not rows of K={Kd}")
    M = x.numel // Kd
    N = out.cols
    if out.numel != M * N:
        _fail(t, f"output {out.shape} is not [{M}, N] for x {x.shape} and K={Kd}")
    qd = int(p.get("qdtype", 0))
    quant = qd in (int(DType.I4), int(DType.I8)) and len(ins) >= 3
    rows = w.shape[0] if w.shape else 1
    ldw = w.numel // max(rows, 1)
    if quant:
        scales = ins[2]
        zeros = ins[3] if len(ins) > 3 else None
        n_full = scales.shape[0]
        group = int(p.get("group", Kd))
        ngroups = scales.numel // n_full
        qmode = 2 if qd == int(DType.I4) else 1
        if qmode == 2 and w.dtype not in (DType.U8, DType.I8):
            _fail(t, f"int4 weights are packed in a U8 buffer, got {w.dtype.name}")
        if qmode == 1 and w.dtype != DType.I8:
            _fail(t, f"int8 weights must be an I8 buffer, got {w.dtype.name}")
        vw = 32 if qmode == 2 else 16
        vec = Kd % vw == 0 and ldw % 16 == 0
        ts = _ft(t, scales.dtype)
        tz = _ft(t, zeros.dtype) if zeros is not None else ts
        tw = _ct(t, w.dtype)
    else:
        zeros = None
        n_full = rows
        group, ngroups, qmode = Kd, 1, 0
        tw = _ft(t, w.dtype)
        vw = 16 // w.esize
        vec = Kd % vw == 0 and ldw % vw == 0
        bias = ins[2] if len(ins) > 2 else None
        ts = _ft(t, bias.dtype) if bias is not None else "float"
        tz = ts
    n_off = int(p.get("n_off", 0))
    n_tile = int(p.get("N_tile", n_full))
    if not (0 <= n_off and n_off + n_tile <= min(n_full, N)):
        _fail(t, f"tile [{n_off}, {n_off + n_tile}) exceeds the weight's {n_full} rows / "
                 f"output's {N} columns")
    if Kd > XS_MAX:
        _fail(t, f"K={Kd} exceeds the {XS_MAX} elements a GEMV stages in shared memory")
    mb = max(1, min(M, 4, XS_MAX // Kd))
    # the non-coherent read-only path only for buffers nothing writes during the kernel
    w_ro = w.kind in (BufferKind.WEIGHT, BufferKind.CONST)
    has_bias = not quant and len(ins) > 2
    row_bytes = ldw * w.esize
    # Float weights of a read-only buffer, batch 1: the tile's rows come through the CTA's
    # weight stream (shared memory, bulk copies running ahead across task boundaries) in chunks
    # of whole rows, each one contiguous byte range.
    chunk = knobs.gemv_ring_shape()[1]
    ring = (chunk > 0 and qmode == 0 and vec and w_ro and M == 1 and row_bytes <= chunk
            and row_bytes % 16 == 0 and Kd + n_tile <= XS_MAX)
    pipe = (not ring and _pipe_on() and qmode == 0 and vec and w_ro and M == 1
            and row_bytes % 16 == 0 and _pipe_pair_fits(Kd, n_tile, Kd * w.esize // 16))
    direct = (not ring and not pipe and qmode == 0 and vec and M == 1 and row_bytes % 16 == 0
              and _direct_fits(Kd, n_tile, Kd * w.esize // 16))
    if direct:
        tmpl = dict(tx=_ft(t, x.dtype), tw=tw, ty=_ft(t, out.dtype), ts=ts, nmat=1, epi=0,
                    bias=has_bias, tr="float", to=_ft(t, out.dtype))
        call = _direct_call(tmpl)
    elif ring:
        call = (f"op_gemv_ring<{_ft(t, x.dtype)}, {tw}, {_ft(t, out.dtype)}, {ts}, "
                f"{_b(has_bias)}>(AMK_ARGS)")
    elif pipe:
        call = (f"op_gemv_pipe<{_ft(t, x.dtype)}, {tw}, {_ft(t, out.dtype)}, {ts}, 1, "
                f"{_b(has_bias)}>(AMK_ARGS)")
    else:
        call = (f"op_gemv<{_ft(t, x.dtype)}, {tw}, {_ft(t, out.dtype)}, {ts}, {tz}, {qmode}, "
                f"{_b(has_bias)}, {_b(zeros is not None)}, {_b(vec)}, {mb}, {_b(w_ro)}>(AMK_ARGS)")
    e = Encoded(int(op), call, group="GEMV", direct=tmpl if direct else None)
    e.ip = dict(M=M, K=Kd, N=N, N_OFF=n_off, N_TILE=n_tile, LDW=ldw, GROUP=group,
                NGROUPS=ngroups)
    if pipe:
        e.ip.update(PIPE=1, NMAT=1, NV=Kd * w.esize // 16, RB=row_bytes)
    if ring:
        rpc = max(1, min(n_tile, chunk // row_bytes))
        e.ip["RPC"] = rpc
        e.chunks = [(w.ref, (n_off + r) * row_bytes, min(rpc, n_tile - r) * row_bytes)
                    for r in range(0, n_tile, rpc)]
    if direct and knobs.l2_prefetch() == 3:   # the first round's rows, a task ahead (NOTES v9)
        _first_round_prefetch(w, n_off, n_tile, row_bytes, Kd * w.esize // 16, e)
    elif not ring:   # streamed tiles are not L2-prefetched: the prefetch shares the SM's bulk-
        _weight_prefetch(w, n_off * row_bytes, n_tile * row_bytes, e)   # copy unit (NOTES v4)
    if quant:
        sb = ngroups * ins[2].esize
        _weight_prefetch(ins[2], n_off * sb, n_tile * sb, e)
        if zeros is not None:
            _weight_prefetch(zeros, n_off * sb, n_tile * sb, e)
    elif has_bias:
        _weight_prefetch(ins[2], n_off * ins[2].esize, n_tile * ins[2].esize, e)
    return e


def _first_round_prefetch(w: View, n_off: int, n_tile: int, row_bytes: int, nv: int, e: Encoded) -> None:
    """The rows op_gemv_direct's warps load first (one item each: two rows x one K segment of
    256 vectors) into L2 before the task's wait: the scheduler prefetches the NEXT task's ranges
    before it waits on its own task's counters, so they land a task ahead. Not the whole tile:
    one stage of whole tiles is more than the L2 holds (NOTES v8)."""
    if w.kind not in (BufferKind.WEIGHT, BufferKind.CONST):
        return
    warps = launch_shape(knobs.ctas_per_sm())[0] // 32
    rows = min(n_tile, 2 * -(-warps // -(-nv // 256)))
    e.prefetch.append((w.ref, n_off * row_bytes, rows * row_bytes))


def _preload(steps) -> tuple[list[tuple[tuple[int, int], int, int]], Encoded | None]:
    """The weight ranges of a task that starts with a split-KV combine (the o projection) that
    the CTA copies into shared memory while the task before it in the queue runs: from the
    staged attention right after it has issued its own loads (op_attention_smem), else when
    that task ends. The combine's wait for the attention is the layer's long idle of the HBM
    and of the SM's ingress, so the rows land before any of the task's own loads (a copy issued
    at the task's start delays the combine's loads behind it: NOTES v11). They are the first PRE
    rows of each matrix of the task's op_gemv_direct step (as many as AMK_PRELOAD bytes hold;
    whole row pairs for one matrix), which reads them from shared memory (ip PRE). Only with the
    ring area free (the preload area is its top). -> (the ranges, that GEMV step) or ([], None)."""
    cap = knobs.preload_bytes()
    if (not cap or knobs.ctas_per_sm() != 1 or knobs.gemv_ring() or knobs.gemv_pipe()[0]
            or not steps or steps[0][0].op != int(K.ATTENTION_COMBINE)):
        return [], None
    enc, args = next(((e, a) for e, a, _ in steps if e.direct is not None), (None, None))
    if enc is None:
        return [], None
    ws = args[1:1 + enc.direct["nmat"]]
    if any(w.kind not in (BufferKind.WEIGHT, BufferKind.CONST) for w in ws):
        return [], None
    rb, n_tile = enc.ip["LDW"] * ws[0].esize, enc.ip["N_TILE"]
    pr = min(n_tile, cap // (len(ws) * rb))
    if len(ws) == 1 and pr < n_tile:
        pr -= pr % 2
    if pr <= 0:
        return [], None
    enc.ip = dict(enc.ip, PRE=pr)         # its own: _attach_preloads may reset it
    return [(w.ref, enc.ip["N_OFF"] * rb, pr * rb) for w in ws], enc


def _attach_preloads(queues, pre_of, rows, ranges) -> None:
    """Give each preload to the task before its task in the queue (n_pre ranges right after that
    task's own prefetch ranges); a task first in its queue has nobody to copy its rows: no
    preload (PRE = 0)."""
    for q in queues:
        for k, j in enumerate(q):
            if j not in pre_of:
                continue
            pre, gemv = pre_of[j]
            if k == 0:
                gemv.ip["PRE"] = 0
                continue
            d = rows[q[k - 1]]
            own = ranges[d["pf_begin"]:d["pf_begin"] + d["n_pf"]]
            d["pf_begin"], d["n_pre"] = len(ranges), len(pre)
            ranges.extend(own + pre)


def _direct_call(a: dict[str, Any]) -> str:
    """Every template argument of op_gemv_direct, in its order: NORM's row types and its row
    elements a thread (RN: _norm_into_gemv), PRE (some task of the variant reads preloaded
    rows: lower_program)."""
    return (f"op_gemv_direct<{a['tx']}, {a['tw']}, {a['ty']}, {a['ts']}, {a['nmat']}, {a['epi']}, "
            f"{_b(a['bias'])}, {a['tr']}, {a['to']}, {_b(a.get('norm', False))}, {a.get('nx', 'float')}, "
            f"{a.get('nw', 'float')}, {_b(a.get('pre', False))}, {a.get('rn', RMS_RN)}>(AMK_ARGS)")


def _direct_fits(Kd: int, n_tile: int, nv: int) -> bool:
    """x (fp32) and op_gemv_direct's sums (one per row and K segment of 256 vectors) fit in the
    work area, also once the tile is paired with another (_pair_gemvs)."""
    return -(-Kd // 4) * 4 + 2 * n_tile * -(-nv // 256) <= XS_MAX


def _pipe_on() -> bool:
    """amk.knobs.gemv_pipe() is on and the pipe's stages have their smem (one CTA per SM)."""
    return knobs.gemv_pipe()[0] > 0 and knobs.ctas_per_sm() == 1


def _pipe_pair_fits(Kd: int, n_tile: int, nv: int) -> bool:
    """x (fp32) and one fp32 sum per item of a tile fit in the work area even when the tile is
    later paired with another (_pair_pipe_gemvs: two matrices' items; gemv_pipe.cuh)."""
    v, _ = knobs.gemv_pipe()
    nseg = -(-nv // (32 * v))
    return -(-Kd // 4) * 4 + 2 * n_tile * nseg <= XS_MAX


def _enc_norm(t, op, ins, outs, p) -> Encoded:
    x, w, out = ins[0], ins[1], outs[0]
    H = int(p.get("hidden", w.numel)) if op == K.LAYERNORM else w.numel
    if x.numel % H or out.numel != x.numel:
        _fail(t, f"x {x.shape} / out {out.shape} are not rows of H={H}")
    if op == K.RMSNORM:
        call = f"op_rmsnorm<{_ft(t, x.dtype)}, {_ft(t, w.dtype)}, {_ft(t, out.dtype)}>(AMK_ARGS)"
        eps = float(p.get("eps", 1e-6))
    else:
        hb = len(ins) > 2
        tb = _ft(t, ins[2].dtype) if hb else "float"
        call = (f"op_layernorm<{_ft(t, x.dtype)}, {_ft(t, w.dtype)}, {tb}, {_ft(t, out.dtype)}, "
                f"{_b(hb)}>(AMK_ARGS)")
        eps = float(p.get("eps", 1e-5))
    e = Encoded(int(op), call, group="NORM")
    e.ip = dict(ROWS=x.numel // H, H=H)
    e.fp = dict(EPS=eps)
    for v in ins[1:]:
        _weight_prefetch(v, 0, v.numel * v.esize, e)
    return e


def _int_input(t, v: View, what: str) -> int:
    if v.dtype not in (DType.I32, DType.I64):
        _fail(t, f"{what} must be int32 or int64, got {v.dtype.name}")
    return int(v.dtype == DType.I64)


def _enc_rope(t, op, ins, outs, p) -> Encoded:
    x, pos, out = ins[0], ins[1], outs[0]
    hd = int(p["head_dim"])
    if hd % 2 or out.numel % hd or x.numel != out.numel:
        _fail(t, f"rope: x {x.shape} / out {out.shape} are not rows of head_dim={hd}")
    c0, c1 = _col_range(t, p, out)
    if (c0, c1) != (0, out.cols) and (c0 % hd or (c1 - c0) % hd):
        _fail(t, f"rope column tile [{c0}, {c1}) must cover whole heads of {hd}")
    heads = out.numel // hd
    if heads % pos.numel:
        _fail(t, f"rope: {pos.numel} positions do not divide {heads} heads")
    has_inv = len(ins) > 2
    tf = _ft(t, ins[2].dtype) if has_inv else "float"
    e = Encoded(int(op), f"op_rope<{_ft(t, x.dtype)}, {_ft(t, out.dtype)}, {tf}>(AMK_ARGS)", group="ROPE")
    e.ip = dict(ROWS=out.numel // out.cols, COLS=out.cols, C0=c0, C1=c1, HD=hd, NPOS=pos.numel,
                POS64=_int_input(t, pos, "rope pos"), HAS_INV=int(has_inv))
    e.fp = dict(THETA=float(p.get("theta", 10000.0)))
    return e


def _attn_smem_on() -> bool:
    """amk.knobs.attn_smem(): attention stages K/V in smem by cp.async (op_attention_smem)."""
    return knobs.attn_smem()


def _enc_attention(t, op, ins, outs, p) -> Encoded:
    q, kc, vc, out = ins[0], ins[1], ins[2], outs[0]
    hd = int(p["head_dim"])
    nh = int(p.get("n_heads", q.shape[-2] if len(q.shape) >= 2 and q.cols == hd
                   else q.cols // hd))
    nkv = int(p.get("n_kv_heads", nh))
    if nkv <= 0 or nh % nkv:
        _fail(t, f"n_heads={nh} is not a multiple of n_kv_heads={nkv}")
    rep = nh // nkv
    if len(kc.shape) == 4:
        B, max_seq = kc.shape[0], kc.shape[1]
    elif len(kc.shape) == 3 and tuple(kc.shape[-2:]) == (nkv, hd):
        B, max_seq = 1, kc.shape[0]
    else:
        B, max_seq = 1, kc.numel // (nkv * hd)
    if B * max_seq * nkv * hd != kc.numel or vc.numel != kc.numel:
        _fail(t, f"caches {kc.shape}/{vc.shape} are not [B?, max_seq, {nkv}, {hd}]")
    if q.numel != B * nh * hd:
        _fail(t, f"q {q.shape} is not [{B}, {nh}*{hd}]")
    if hd > HD_MAX or hd % 2:
        _fail(t, f"head_dim={hd} must be even and at most {HD_MAX}")
    h_off = int(p.get("h_off", 0))
    hc = int(p.get("h_count", nh - h_off))
    if not (h_off >= 0 and hc >= 0 and h_off + hc <= nh and h_off % rep == 0 and hc % rep == 0):
        _fail(t, f"head range h_off={h_off}, h_count={hc} must cover whole kv groups of {rep}")
    flags = int(p.get("flags", 0))
    width = hd + 2 if flags & 2 else hd
    if out.numel != B * nh * width:
        _fail(t, f"output {out.shape} is not [{B}, {nh}, {width}]")
    lo = int(p.get("kv_start", 0))
    kv_len = int(p.get("kv_len", max_seq - lo))
    has_pos = len(ins) > 3
    new_kv = bool(flags & NEW_KV)
    tn = _ft(t, q.dtype)
    if new_kv:
        if len(ins) != 6 or not has_pos:
            _fail(t, "NEW_KV attention takes q, k_cache, v_cache, pos, k_new, v_new")
        if ins[4].dtype != ins[5].dtype or any(x.numel != B * nkv * hd for x in ins[4:6]):
            _fail(t, f"k_new {ins[4].shape} / v_new {ins[5].shape} must be one dtype and "
                     f"[{B}, {nkv}*{hd}]")
        tn = _ft(t, ins[4].dtype)
    # K/V rows staged in smem by 16-byte cp.async where rows are whole 16-byte vectors
    staged = (hd * kc.esize) % 16 == 0 and (hd * vc.esize) % 16 == 0 and _attn_smem_on()
    types = f"{_ft(t, q.dtype)}, {_ft(t, kc.dtype)}, {_ft(t, vc.dtype)}, {_ft(t, out.dtype)}, {tn}"
    hg = max(g for g in range(1, 9) if rep % g == 0)      # q heads a pass (registers, no predicates)
    call = (f"op_attention_smem<{types}, float, {hg}, {hd}>(AMK_ARGS)" if staged
            else f"op_attention<{types}, float>(AMK_ARGS)")
    e = Encoded(int(op), call, group="ATTN")
    e.ip = dict(HD=hd, NH=nh, NKV=nkv, KV_START=lo, KV_LEN=kv_len, FLAGS=flags, H_OFF=h_off,
                H_COUNT=hc, B=B, MAX_SEQ=max_seq,
                POS64=_int_input(t, ins[3], "attention pos") if has_pos else 0,
                HAS_POS=int(has_pos), KES=kc.esize, VES=vc.esize, NEW_KV=int(new_kv),
                KV_SHARD=int(p.get("kv_shard", 0)), KV_SHARDS=int(p.get("kv_shards", 1)))
    e.fp = dict(SCALE=float(p.get("scale", 1.0 / hd ** 0.5)))
    return e


def _enc_combine(t, op, ins, outs, p) -> Encoded:
    out = outs[0]
    hd = int(p["head_dim"])
    nh = int(p.get("n_heads", out.numel // hd if len(out.shape) <= 1 else out.cols // hd))
    B = out.numel // (nh * hd)
    h_off = int(p.get("h_off", 0))
    hc = int(p.get("h_count", nh - h_off))
    if not ins or any(x.numel != B * nh * (hd + 2) or x.dtype != ins[0].dtype for x in ins):
        _fail(t, f"combine inputs must be [{B}, {nh}, {hd}+2] partials of one dtype")
    if not (0 <= h_off and h_off + hc <= nh):
        _fail(t, f"head range h_off={h_off}, h_count={hc} outside {nh} heads")
    e = Encoded(int(op), f"op_combine<{_ft(t, ins[0].dtype)}, {_ft(t, out.dtype)}, {hd}, {len(ins)}>(AMK_ARGS)",
                group="COMB")
    e.ip = dict(HD=hd, NH=nh, H_OFF=h_off, H_COUNT=hc, B=B, P=len(ins))
    return e


def _enc_embed(t, op, ins, outs, p) -> Encoded:
    ids, table, out = ins[0], ins[1], outs[0]
    H = table.cols
    if out.numel != ids.numel * H:
        _fail(t, f"output {out.shape} is not [{ids.numel}, {H}]")
    e = Encoded(int(op), f"op_embed<{_ct(t, table.dtype)}, {_ct(t, out.dtype)}>(AMK_ARGS)", group="EMBED")
    e.ip = dict(B=ids.numel, H=H, V=table.numel // H, IDS64=_int_input(t, ids, "token ids"))
    return e


def _enc_kv_append(t, op, ins, outs, p) -> Encoded:
    new, cache = ins[0], outs[0]
    if len(cache.shape) == 4:
        B, max_seq = cache.shape[0], cache.shape[1]
        rowlen = math.prod(cache.shape[2:])
    else:
        B, max_seq = 1, cache.shape[0]
        rowlen = cache.numel // max_seq
    if new.numel % (B * rowlen):
        _fail(t, f"new rows {new.shape} are not rows of {rowlen} for a cache {cache.shape}")
    has_pos = "pos" not in p
    if has_pos and len(ins) < 2:
        _fail(t, "KV_APPEND needs a pos input (or the seed's params['pos'])")
    e = Encoded(int(op), f"op_kv_append<{_ct(t, new.dtype)}, {_ct(t, cache.dtype)}, float>(AMK_ARGS)",
                group="KV")
    e.ip = dict(ROWLEN=rowlen, NROWS=new.numel // (B * rowlen), MAX_SEQ=max_seq, B=B,
                POS64=_int_input(t, ins[1], "pos") if has_pos else 0, HAS_POS=int(has_pos),
                POS_PARAM=int(p.get("pos", 0)))
    return e


def _enc_argmax(t, op, ins, outs, p) -> Encoded:
    x, out = ins[0], outs[0]
    V = x.cols
    e = Encoded(int(op), f"op_argmax<{_ft(t, x.dtype)}>(AMK_ARGS)", group="ARGMAX")
    e.ip = dict(ROWS=x.numel // V, V=V, OUT64=_int_input(t, out, "argmax output"))
    if out.numel != x.numel // V:
        _fail(t, f"output {out.shape} has not one id per row of {x.shape}")
    return e


def _enc_softmax(t, op, ins, outs, p) -> Encoded:
    x, out = ins[0], outs[0]
    if int(p.get("dim", -1)) not in (-1, len(out.shape) - 1):
        _fail(t, "SOFTMAX over an axis other than the last is not supported")
    e = Encoded(int(op), f"op_softmax<{_ft(t, x.dtype)}, {_ft(t, out.dtype)}>(AMK_ARGS)",
                group="SOFTMAX")
    e.ip = dict(ROWS=out.numel // out.cols, H=out.cols)
    return e


def _enc_dequant(t, op, ins, outs, p) -> Encoded:
    qw, scales, out = ins[0], ins[1], outs[0]
    Kd = int(p.get("K", out.cols))
    qd = int(p.get("qdtype", int(DType.I8)))
    packed = qd == int(DType.I4) and qw.dtype == DType.U8 and qw.cols * 2 >= Kd > qw.cols
    N = qw.numel // qw.cols
    if out.numel != N * Kd:
        _fail(t, f"output {out.shape} is not [{N}, {Kd}]")
    zeros = ins[2] if len(ins) > 2 else None
    tz = _ft(t, zeros.dtype) if zeros is not None else "float"
    call = (f"op_dequant<{_ct(t, qw.dtype)}, {_ft(t, scales.dtype)}, {tz}, {_ft(t, out.dtype)}, "
            f"{_b(zeros is not None)}>(AMK_ARGS)")
    e = Encoded(int(op), call, group="DEQ")
    e.ip = dict(N=N, K=Kd, LDQ=qw.cols, GROUP=int(p.get("group", Kd)),
                NGROUPS=scales.numel // N, PACKED=int(packed))
    return e


ENCODERS = {
    K.COPY: _enc_elementwise, K.ADD: _enc_elementwise, K.MUL: _enc_elementwise,
    K.SILU_MUL: _enc_elementwise, K.GELU: _enc_elementwise,
    K.ALLREDUCE_SHARD: _enc_allreduce,
    K.GEMV_TILE: _enc_gemv, K.GEMM_TILE: _enc_gemv,
    K.RMSNORM: _enc_norm, K.LAYERNORM: _enc_norm,
    K.ROPE: _enc_rope,
    K.ATTENTION_TILE: _enc_attention, K.ATTENTION_COMBINE: _enc_combine,
    K.EMBED: _enc_embed, K.KV_APPEND: _enc_kv_append,
    K.SAMPLE_ARGMAX: _enc_argmax, K.SOFTMAX: _enc_softmax, K.DEQUANT: _enc_dequant,
}


def encode_op(task, op: K, ins: list[View], outs: list[View], params) -> Encoded:
    if op == K.NOP:
        return Encoded(int(op), None)
    if op not in ENCODERS:
        _fail(task, f"opcode {op.name} has no CUDA template")
    if not outs:
        _fail(task, f"{op.name} has no output")
    return ENCODERS[op](task, op, ins, outs, params)


# ---------------------------------------------------------------------------------------------
# FUSED: steps become sub-descriptors over a per-task scratch region of the arena
# ---------------------------------------------------------------------------------------------
_FULL_WRITE = {K.RMSNORM, K.LAYERNORM, K.EMBED, K.SOFTMAX, K.ALLREDUCE_SHARD, K.DEQUANT,
               K.SAMPLE_ARGMAX}


def _writes_whole(op: K, p, out: View) -> bool:
    if op in _FULL_WRITE:
        return True
    if op in (K.COPY, K.ADD, K.MUL, K.SILU_MUL, K.GELU, K.ROPE):
        return "n_off" not in p and "N_tile" not in p
    return False


def _check_recipe(task, recipe, n_in, n_out) -> None:
    try:
        from amk.backends.reference.semantics_fused import validate_recipe
    except ImportError:          # the oracle module is optional for the backend itself
        return
    errs = validate_recipe(recipe, n_in, n_out)
    if errs:
        _fail(task, "malformed FUSED recipe: " + "; ".join(errs))


def _lower_fused(task, ins: list[View], outs: list[View], scratch_base: int):
    """-> (steps [(Encoded, in views, out views)], zero ranges [(off, bytes)], bytes used)."""
    recipe = task.params.get("recipe")
    _check_recipe(task, recipe, len(ins), len(outs))
    slots: dict[int, View] = {}
    off = scratch_base
    steps, zero = [], []
    for i, st in enumerate(recipe["steps"]):
        op = K(int(st["op"]))
        args = [ins[a["in"]] if "in" in a else slots[a["s"]] for a in st.get("args", [])]
        out = st["out"]
        sp = st.get("params", {}) or {}
        if out == "final" or out == -1:
            target = outs[0]
        elif isinstance(out, dict):
            target = outs[out["o"]]
        else:
            od = st.get("out_dtype")
            if od is not None and od not in RECIPE_DTYPES:
                _fail(task, f"step {i}: scratch dtype {od!r} is not supported on CUDA")
            dt = RECIPE_DTYPES[od] if od else args[0].dtype
            shape = tuple(st["out_shape"]) if st.get("out_shape") is not None else args[0].shape
            old = slots.get(out)
            if old is not None and old.shape == shape and old.dtype == dt:
                target = old
            else:
                off = -(-off // SCRATCH_ALIGN) * SCRATCH_ALIGN
                target = View(shape, dt, (REF_SCRATCH, off), None)
                nbytes = math.prod(shape) * dt.itemsize
                if not _writes_whole(op, sp, target):
                    zero.append((off, nbytes))
                off += nbytes
                slots[out] = target
        enc = encode_op(task, op, args, [target], sp)
        steps.append((enc, args, [target]))
    zero = [(o, n) for o, n in zero if not _tile_reads_only(steps, (REF_SCRATCH, o))]
    _norm_into_smem(steps)
    in_smem = {outs[0].ref for enc, _, outs in steps if enc.ip.get("TO_SMEM")}
    zero = [(o, n) for o, n in zero if (REF_SCRATCH, o) not in in_smem]   # never in global memory
    steps = _rope_into_append(_rope_into_attention(_k_rope_into_attention(steps)))
    return _norm_into_gemv(_fold_add(_pair_gemvs(_pair_pipe_gemvs(steps)))), zero, off - scratch_base


_EW_OPS = {int(K.COPY), int(K.ADD), int(K.MUL), int(K.SILU_MUL), int(K.GELU)}


def _written_cols(enc: Encoded) -> tuple[int, int] | None:
    """Columns [lo, hi) a column-tile step writes in every row of its output, else None."""
    if enc.op in (int(K.GEMV_TILE), int(K.GEMM_TILE)):
        return enc.ip["N_OFF"], enc.ip["N_OFF"] + enc.ip["N_TILE"]
    if enc.op in _EW_OPS or enc.op == int(K.ROPE):
        return enc.ip["C0"], enc.ip["C1"]
    return None


def _read_cols(enc: Encoded, args: list[View], out: View, ref) -> tuple[int, int] | None:
    """Columns [lo, hi) a step reads of scratch `ref` (one of its args), else None (unknown)."""
    idx = [i for i, a in enumerate(args) if a.ref == ref]
    v = args[idx[0]]
    if enc.op in _EW_OPS and v.numel == out.numel and v.cols == out.cols:
        return enc.ip["C0"], enc.ip["C1"]        # read at the output's own (row, column)
    if enc.op == int(K.ATTENTION_TILE) and idx == [0] and enc.ip["B"] == 1 and v.cols == v.numel:
        hd = enc.ip["HD"]                         # q of the tile's heads only
        return enc.ip["H_OFF"] * hd, (enc.ip["H_OFF"] + enc.ip["H_COUNT"]) * hd
    return None


def _tile_reads_only(steps, ref) -> bool:
    """True when scratch `ref` needs no zeroing: one step writes a column tile of it and every
    step that reads it reads only inside that tile (o+add, gate/up+silu, rope+attention)."""
    writers = [i for i, (_, _, outs) in enumerate(steps) if outs[0].ref == ref]
    if len(writers) != 1:
        return False
    w = writers[0]
    cols = _written_cols(steps[w][0])
    if cols is None or any(a.ref == ref for a in steps[w][1]):
        return False
    for i, (enc, args, outs) in enumerate(steps):
        if i == w or not any(a.ref == ref for a in args):
            continue
        if i < w:
            return False
        r = _read_cols(enc, args, outs[0], ref)
        if r is None or not (cols[0] <= r[0] <= r[1] <= cols[1]):
            return False
    return True


def _x_width(enc: Encoded) -> int | None:
    """Elements of a one-row norm / whole-output batch-1 combine (x producers), else None."""
    if enc.op in (int(K.RMSNORM), int(K.LAYERNORM)) and enc.ip["ROWS"] == 1:
        return enc.ip["H"]
    if (enc.op == int(K.ATTENTION_COMBINE) and enc.ip["B"] == 1 and enc.ip["H_OFF"] == 0
            and enc.ip["H_COUNT"] == enc.ip["NH"]):
        return enc.ip["NH"] * enc.ip["HD"]
    return None


def _norm_into_smem(steps) -> None:
    """A one-row norm (or a whole batch-1 combine) whose scratch output only the GEMV steps
    right after it read as x: it writes x into the GEMVs' shared-memory staging area (fp32,
    rounded through the scratch dtype as before) and the GEMVs skip staging it, so x never
    goes through global memory."""
    for i, (enc, _, outs) in enumerate(steps):
        H = _x_width(enc)
        if H is None:
            continue
        ref = outs[0].ref
        if ref[0] != REF_SCRATCH or H > XS_MAX:
            continue
        readers = [j for j, (_, a, _) in enumerate(steps) if any(v.ref == ref for v in a)]
        writers = [j for j, (_, _, o) in enumerate(steps) if o[0].ref == ref]
        if not readers or writers != [i] or readers != list(range(i + 1, i + 1 + len(readers))):
            continue
        if all(steps[j][0].op in (int(K.GEMV_TILE), int(K.GEMM_TILE))
               and steps[j][1][0].ref == ref and all(v.ref != ref for v in steps[j][1][1:])
               and steps[j][0].ip["M"] == 1 and steps[j][0].ip["K"] == H
               for j in readers):
            enc.ip["TO_SMEM"] = 1
            for j in readers:
                steps[j][0].ip["XS_READY"] = 1


def _fold_windows(steps, n: int, fold):
    """Walk the steps; where fold(window of n steps, the steps after it) returns a step, that
    step replaces the window."""
    out, i = [], 0
    while i < len(steps):
        new = fold(steps[i:i + n], steps[i + n:]) if i + n <= len(steps) else None
        if new is not None:
            out.append(new)
            i += n
        else:
            out.append(steps[i])
            i += 1
    return out


def _read_later(ref, later) -> bool:
    return any(v.ref == ref for _, args, _ in later for v in args)


def _rope_fold(r, ra, ro, a, aa, later, consumer: int) -> bool:
    """The shared conditions of the two rope folds: a one-position ROPE into a scratch that
    only the next step (a `consumer` step) reads, as its first argument, with the same pos."""
    return (r.op == int(K.ROPE) and a.op == consumer and aa[0].ref == ro[0].ref
            and ro[0].ref[0] == REF_SCRATCH and not _read_later(ro[0].ref, later)
            and r.ip["NPOS"] == 1 and ra[0].dtype == ro[0].dtype)


def _with_inv(call: str, inv) -> str:
    """A call whose inverse-frequency type (its last type argument, float, before its integer
    ones) becomes inv's."""
    if not inv:
        return call
    return re.sub(r", float((?:, \d+)*)>\(AMK_ARGS\)$",
                  lambda m: f", {_ft(None, inv[0].dtype)}{m.group(1)}>(AMK_ARGS)", call)


def _rope_joins(r, ra, a, aa) -> bool:
    """A staged batch-1 attention with pos can take this one-position ROPE's rotation: same pos,
    head_dim and row count, and (if it already rotates the new k row) the same frequencies."""
    if not (a.call.startswith("op_attention_smem<") and a.ip["B"] == 1 and a.ip["HAS_POS"]
            and len(aa) > 3 and ra[1].ref == aa[3].ref and r.ip["POS64"] == a.ip["POS64"]
            and r.ip["ROWS"] == 1 and r.ip["HD"] == a.ip["HD"]):
        return False
    if a.ip.get("K_ROPE"):              # one set of frequencies for q and the new k row
        inv = ra[2:3]
        return (r.fp["THETA"] == a.fp["THETA"] and bool(inv) == bool(a.ip["ROPE_INV"])
                and (not inv or inv[0].ref == aa[-1].ref))
    return True


def _rotated(a: Encoded, aa, r: Encoded, ra, flag: str):
    """(the attention's Encoded with `flag` set, inverse frequencies it gains as an input)."""
    inv = [] if a.ip.get("Q_ROPE") or a.ip.get("K_ROPE") else list(ra[2:3])
    e = Encoded(a.op, _with_inv(a.call, inv), dict(a.ip, **{flag: 1}, ROPE_INV=int(bool(ra[2:3]))),
                dict(a.fp, THETA=r.fp["THETA"]), a.group, r.prefetch + a.prefetch)
    return e, inv


def _rope_into_attention(steps):
    """A ROPE of exactly one staged attention's q heads (batch 1, one position, the attention's
    own pos) into a scratch only that attention reads: the attention rotates q itself while it
    stages it (op_attention_smem's Q_ROPE), so q skips the scratch round trip and the step's
    barrier."""
    def fold(window, later):
        (r, ra, ro), (a, aa, ao) = window
        if not (_rope_fold(r, ra, ro, a, aa, later, int(K.ATTENTION_TILE)) and _rope_joins(r, ra, a, aa)
                and r.ip["COLS"] == a.ip["NH"] * a.ip["HD"]
                and (r.ip["C0"], r.ip["C1"]) == (a.ip["H_OFF"] * a.ip["HD"],
                                                 (a.ip["H_OFF"] + a.ip["H_COUNT"]) * a.ip["HD"])):
            return None
        e, inv = _rotated(a, aa, r, ra, "Q_ROPE")
        return e, [ra[0]] + list(aa[1:]) + inv, ao
    return _fold_windows(steps, 2, fold)


def _k_rope_into_attention(steps):
    """The whole-tensor ROPE of a NEW_KV attention's new k row (one position, its pos) into a
    scratch only that attention reads, as k_new: the attention rotates its kv head's row itself
    (op_attention_smem's K_ROPE). The steps between may only write other scratch (the q rope)."""
    out = list(steps)
    for i, (r, ra, ro) in enumerate(steps):
        if r.op != int(K.ROPE) or ro[0].ref[0] != REF_SCRATCH:
            continue
        readers = [j for j in range(i + 1, len(steps)) if any(v.ref == ro[0].ref for v in steps[j][1])]
        if len(readers) != 1:
            continue
        j = readers[0]
        a, aa, ao = steps[j]
        between = [w.ref for _, _, wo in steps[i + 1:j] for w in wo]
        if not (a.op == int(K.ATTENTION_TILE) and a.ip.get("NEW_KV") and len(aa) >= 6
                and aa[4].ref == ro[0].ref and not any(v.ref == ro[0].ref for v in aa[:4] + aa[5:])
                and all(w[0] == REF_SCRATCH and w not in [v.ref for v in ra] for w in between)
                and _rope_joins(r, ra, a, aa) and r.ip["NPOS"] == 1
                and (r.ip["C0"], r.ip["C1"]) == (0, r.ip["COLS"])
                and ra[0].numel == ro[0].numel == a.ip["NKV"] * a.ip["HD"]
                and ra[0].dtype == ro[0].dtype == aa[5].dtype):
            continue
        e, inv = _rotated(a, aa, r, ra, "K_ROPE")
        out[j] = (e, list(aa[:4]) + [ra[0]] + list(aa[5:]) + inv, ao)
        out[i] = None
    return [s for s in out if s is not None]


def _rope_into_append(steps):
    """A whole-tensor ROPE (one position, the append's own pos) into a scratch only the next
    KV_APPEND reads: the append rotates the rows itself (op_kv_append's ROPE_HD), one pass from
    the GEMV's output to the cache instead of a scratch round trip and a barrier."""
    def fold(window, later):
        (r, ra, ro), (a, aa, ao) = window
        if not (_rope_fold(r, ra, ro, a, aa, later, int(K.KV_APPEND))
                and a.ip["HAS_POS"] and len(aa) == 2 and ra[1].ref == aa[1].ref
                and r.ip["POS64"] == a.ip["POS64"] and (r.ip["C0"], r.ip["C1"]) == (0, r.ip["COLS"])
                and ra[0].numel == ro[0].numel == aa[0].numel):
            return None
        inv = ra[2:3]
        e = Encoded(a.op, _with_inv(a.call, inv), dict(a.ip, ROPE_HD=r.ip["HD"], ROPE_INV=int(bool(inv))),
                    dict(a.fp, THETA=r.fp["THETA"]), a.group, r.prefetch + a.prefetch)
        return e, [ra[0], aa[1]] + list(inv), ao
    return _fold_windows(steps, 2, fold)


def _pair_pipe_gemvs(steps):
    """Two consecutive pipe GEMV steps over the same x and the same row tile (gate and up)
    become one op_gemv_pipe of NMAT=2: one weight stream, x staged once. Runs after the
    scratch analyses above, which look at single-output steps."""
    same = ("M", "K", "N", "N_OFF", "N_TILE", "LDW", "RB", "NV", "XS_READY")

    def fold(window, later):
        (a, aa, ao), (b, ba, bo) = window
        if not (a.ip.get("PIPE") and b.ip.get("PIPE") and len(aa) == 2 and len(ba) == 2
                and aa[0].ref == ba[0].ref and all(a.ip.get(k) == b.ip.get(k) for k in same)
                and aa[1].dtype == ba[1].dtype and ao[0].dtype == bo[0].dtype
                and ao[0].ref != ba[0].ref and ao[0].ref != bo[0].ref):
            return None
        e = Encoded(a.op, a.call.replace(", 1, false>(AMK_ARGS)", ", 2, false>(AMK_ARGS)"),
                    dict(a.ip, NMAT=2), dict(a.fp), a.group, a.prefetch + b.prefetch)
        return e, [aa[0], aa[1], ba[1]], [ao[0], bo[0]]
    return _fold_windows(steps, 2, fold)


def _pair_gemvs(steps):
    """gate GEMV, up GEMV (op_gemv_direct, same x and row tile, scratch outputs) and the
    SILU_MUL of exactly those two tiles that follows them: one op_gemv_direct of NMAT=2 that
    computes silu(gate) * up from its sums and writes the SILU_MUL's output. x is staged once,
    one item holds a row of each matrix, and neither tile goes through scratch."""
    silu = abi.EW_KINDS.index("SILU_MUL")
    same = ("M", "K", "N", "N_OFF", "N_TILE", "LDW", "XS_READY")

    def fold(window, later):
        (a, aa, ao), (b, ba, bo), (c, ca, co) = window
        ga, gb = a.direct, b.direct
        if not (ga and gb and ga["epi"] == gb["epi"] == 0 and not ga["bias"] and not gb["bias"]
                and ga["nmat"] == gb["nmat"] == 1 and ga["tw"] == gb["tw"] and ga["ty"] == gb["ty"]
                and aa[0].ref == ba[0].ref and all(a.ip.get(k) == b.ip.get(k) for k in same)
                and c.op == int(K.SILU_MUL) and c.ip.get("KIND") == silu and c.ip["ROWS"] == 1
                and sorted(v.ref for v in ca) == sorted([ao[0].ref, bo[0].ref]) and ao[0].ref != bo[0].ref
                and ao[0].ref[0] == bo[0].ref[0] == REF_SCRATCH
                and (c.ip["C0"], c.ip["C1"]) == (a.ip["N_OFF"], a.ip["N_OFF"] + a.ip["N_TILE"])
                and all(c.ip[k] == c.ip["COLS"] for k in ("A_RS", "B_RS")) and c.ip["A_CS"] == c.ip["B_CS"] == 1
                and co[0].cols == ao[0].cols == bo[0].cols == a.ip["N"] and co[0].dtype in FLOATS
                and not _read_later(ao[0].ref, later) and not _read_later(bo[0].ref, later)):
            return None
        tmpl = dict(ga, nmat=2, epi=2, to=_ft(None, co[0].dtype))
        e = Encoded(a.op, _direct_call(tmpl), dict(a.ip), dict(a.fp), a.group,
                    a.prefetch + b.prefetch, direct=tmpl)
        gate, up = (aa[1], ba[1]) if ca[0].ref == ao[0].ref else (ba[1], aa[1])
        return e, [aa[0], gate, up], [co[0]]
    return _fold_windows(steps, 3, fold)


def _fold_add(steps):
    """A batch-1 GEMV tile (op_gemv, op_gemv_direct or op_gemv_pipe) into a scratch that only
    the next step reads, an ADD of that tile and a residual at the same columns (o + h, down +
    h): the GEMV adds the residual (appended as its last input) itself and writes the ADD's
    output. Runs last, like _pair_pipe_gemvs."""
    def fold(window, later):
        (g, ga, go), (a, aa, ao) = window
        y = go[0]
        plain = g.call is not None and g.call.startswith("op_gemv<") and g.ip.get("M") == 1
        direct = g.direct is not None and g.direct["nmat"] == 1 and g.direct["epi"] == 0
        if not ((plain or direct or g.ip.get("PIPE") and g.ip["NMAT"] == 1) and a.op == int(K.ADD)
                and len(aa) == 2 and a.ip["KIND"] == abi.EW_KINDS.index("ADD") and a.ip["ROWS"] == 1
                and (a.ip["C0"], a.ip["C1"]) == (g.ip["N_OFF"], g.ip["N_OFF"] + g.ip["N_TILE"])
                and all(a.ip[k] == a.ip["COLS"] for k in ("A_RS", "B_RS")) and a.ip["A_CS"] == a.ip["B_CS"] == 1
                and ao[0].cols == y.cols == g.ip["N"] and y.ref[0] == REF_SCRATCH
                and all(v.dtype in FLOATS for v in aa + ao)
                and [v.ref for v in aa].count(y.ref) == 1 and not _read_later(y.ref, later)):
            return None
        res = aa[1] if aa[0].ref == y.ref else aa[0]
        if direct:
            tmpl = dict(g.direct, epi=1, tr=_ct(None, res.dtype), to=_ft(None, ao[0].dtype))
            call = _direct_call(tmpl)
        else:
            tmpl = None
            call = g.call.replace(">(AMK_ARGS)", f", true, {_ct(None, res.dtype)}, "
                                                 f"{_ft(None, ao[0].dtype)}>(AMK_ARGS)")
        e = Encoded(g.op, call, dict(g.ip), dict(g.fp), g.group, g.prefetch + a.prefetch, direct=tmpl)
        return e, ga + [res], [ao[0]]
    return _fold_windows(steps, 2, fold)


def _norm_into_gemv(steps):
    """A one-row RMSNorm into the GEMVs' shared-memory x (TO_SMEM) and the op_gemv_direct right
    after it: one op_gemv_direct (NORM) that normalises x itself (rms_row, the same bits), so
    the task is one step, not a FUSED pair (the step boundary cost ~1 us a task on an H200:
    q/k/v and gate/up tasks, NOTES v12). Its args: the norm's input row in place of x, the
    norm's weight appended last (never with the ADD epilogue, whose residual is last); the
    GEMVs after it still read x from shared memory. Runs after _fold_add."""
    nt = launch_shape(knobs.ctas_per_sm())[0]

    def fold(window, later):
        (n, na, no), (g, ga, go) = window
        if not (n.op == int(K.RMSNORM) and n.ip.get("TO_SMEM") and n.ip["ROWS"] == 1
                and n.ip["H"] <= RMS_RN * nt and g.direct is not None and g.ip.get("XS_READY")
                and g.direct["epi"] != 1 and not g.direct.get("norm") and ga[0].ref == no[0].ref
                and na[0].dtype in FLOATS and na[1].dtype in FLOATS):
            return None
        tmpl = dict(g.direct, norm=True, nx=_ft(None, na[0].dtype), nw=_ft(None, na[1].dtype),
                    rn=-(-n.ip["H"] // nt))        # the row elements a thread holds, no more
        e = Encoded(g.op, _direct_call(tmpl), dict(g.ip, XS_READY=0), dict(g.fp, EPS=n.fp["EPS"]),
                    g.group, n.prefetch + g.prefetch, direct=tmpl)
        return e, [na[0]] + ga[1:] + [na[1]], go
    return _fold_windows(steps, 2, fold)


# ---------------------------------------------------------------------------------------------
def _argmax_folds(program: Program) -> tuple[dict[int, tuple[int, list[int]]], int]:
    """Argmaxes of one row whose every column is written by one GEMV tile (plain, or the final
    step of a FUSED task: the LM head): ({argmax task: (scratch offset of its partials, the tile
    tasks by column)}, scratch bytes of all partials). Each tile reduces the logits it writes
    to a (value, index) partial in its epilogue (op_gemv_direct EPI 3) and the argmax task
    reduces the partials (op_argmax_parts): no single SM reads the whole row again (22 us for
    128K bf16 logits, NOTES v10). Same order (am_better) at both levels: op_argmax's token."""
    writers: dict[int, list[Task]] = {}
    for t in program.tasks:
        for b in t.outputs:
            writers.setdefault(b, []).append(t)
    folds, off = {}, 0
    for t in program.tasks:
        if t.op != K.SAMPLE_ARGMAX or not t.inputs:
            continue
        logits = program.buffers[t.inputs[0]]
        V = logits.shape[-1] if logits.shape else 1
        tiles = sorted((_gemv_cols(w), w.id) for w in writers.get(logits.id, []))
        if logits.numel != V or not tiles or None in (c for c, _ in tiles):
            continue
        ends = [0] + [lo + n for (lo, n), _ in tiles]
        if [lo for (lo, _), _ in tiles] != ends[:-1] or ends[-1] != V:
            continue
        folds[t.id] = (off, [tid for _, tid in tiles])
        off += -(-8 * len(tiles) // SCRATCH_ALIGN) * SCRATCH_ALIGN
    return folds, off


def _gemv_cols(t: Task) -> tuple[int, int] | None:
    """(n_off, N_tile) of a task that is one GEMV tile or ends in one writing its output."""
    p = t.params
    if t.op == K.FUSED:
        steps = p.get("recipe", {}).get("steps", [])
        if not steps or int(steps[-1]["op"]) != int(K.GEMV_TILE) or steps[-1]["out"] not in ("final", -1):
            return None
        p = steps[-1].get("params", {}) or {}
    elif t.op != K.GEMV_TILE:
        return None
    return (int(p["n_off"]), int(p["N_tile"])) if "n_off" in p and "N_tile" in p else None


class _ArgmaxFolds:
    """lower_program's side of _argmax_folds: tiles patched so far, and the steps to run."""

    def __init__(self, program: Program):
        self.folds, self.scratch_bytes = _argmax_folds(program)
        self.slots = {tid: (slot, off, len(tiles), program.tasks[am].inputs[0])
                      for am, (off, tiles) in self.folds.items() for slot, tid in enumerate(tiles)}
        self.patched: set[int] = set()

    def steps(self, t: Task, steps, outs: list[View]):
        """A logits tile: its GEMV step with EPI 3 (when it is a plain batch-1 direct GEMV). The
        argmax, once every tile writes a partial: op_argmax_parts over them (else op_argmax)."""
        if t.id in self.slots:
            slot, off, n, logits = self.slots[t.id]
            parts = View((2 * n,), DType.F32, (REF_SCRATCH, off), None)
            for i, (e, a, o) in enumerate(steps):
                if (e.direct is not None and e.direct["nmat"] == 1 and e.direct["epi"] == 0
                        and len(o) == 1 and o[0].ref == (REF_BUFFER, logits)):
                    tmpl = dict(e.direct, epi=3)
                    pe = Encoded(e.op, _direct_call(tmpl), dict(e.ip, ARG_SLOT=slot), dict(e.fp),
                                 e.group, e.prefetch, direct=tmpl)
                    self.patched.add(t.id)
                    return steps[:i] + [(pe, a, o + [parts])] + steps[i + 1:]
        if t.id in self.folds and all(w in self.patched for w in self.folds[t.id][1]):
            off, tiles = self.folds[t.id]
            parts = View((2 * len(tiles),), DType.F32, (REF_SCRATCH, off), None)
            e = Encoded(int(t.op), "op_argmax_parts(AMK_ARGS)", group="ARGMAX")
            e.ip = dict(ROWS=1, V=len(tiles), OUT64=_int_input(t, outs[0], "argmax output"))
            return [(e, [parts], outs)]
        return steps


def _view(b: Buffer) -> View:
    return View(tuple(b.shape), b.dtype, (REF_BUFFER, b.id), b.kind)


def _queues(program: Program, n_ctas: int) -> list[list[int]]:
    if program.queues:
        qs = [list(q) for q in program.queues]
        seen = sorted(t for q in qs for t in q)
        if seen != list(range(len(program.tasks))):
            _fail(None, "program.queues must hold every task exactly once")
        return qs
    n = max(1, min(n_ctas, len(program.tasks)))
    return [list(range(i, len(program.tasks), n)) for i in range(n)]


def lower_program(program: Program, n_ctas: int = 132) -> Lowered:
    """Encode every task. ``n_ctas`` only matters when the program has no queues."""
    variants: dict[str, int] = {}
    n_inc = np.zeros(len(program.counters), dtype=np.int64)
    for t in program.tasks:
        if t.out_counter is not None and t.out_counter >= 0:
            n_inc[t.out_counter] += 1
    rows: list[dict[str, Any]] = []
    subs: list[dict[str, Any]] = []
    waits: list[tuple[int, int, int]] = []
    refs: list[tuple[int, int]] = []
    ranges: list[tuple[tuple[int, int], int, int]] = []
    argmax = _ArgmaxFolds(program)
    scratch = argmax.scratch_bytes        # the argmax partials first, then the FUSED scratch
    pre_of: dict[int, tuple[list, Encoded]] = {}   # task -> (its preload ranges, its GEMV step)

    direct_of: dict[int, dict[str, Any]] = {}     # variant -> op_gemv_direct's template arguments

    def desc(enc: Encoded, ins: list[View], outs: list[View]) -> dict[str, Any]:
        var = -1
        if enc.call is not None:
            var = variants.setdefault(enc.call, len(variants))
            if enc.direct is not None:
                direct_of[var] = enc.direct
        d = dict(op=enc.op, variant=var, ptr_begin=len(refs), n_in=len(ins), n_out=len(outs),
                 pf_begin=len(ranges), n_pf=len(enc.prefetch), ip=enc.ip, fp=enc.fp,
                 group=enc.group)
        refs.extend(v.ref for v in ins + outs)
        ranges.extend(enc.prefetch)
        return d

    def chunk_list(encs: list[Encoded]) -> tuple[int, int]:
        """Append the task's stream chunks (in step order: the order its GEMVs consume them)."""
        begin, n = len(ranges), 0
        for enc in encs:
            ranges.extend(enc.chunks)
            n += len(enc.chunks)
        return begin, n

    for t in program.tasks:
        ins = [_view(program.buffers[b]) for b in t.inputs]
        outs = [_view(program.buffers[b]) for b in t.outputs]
        steps, zero, used = _lower_fused(t, ins, outs, scratch) if t.op == K.FUSED else ([], [], 0)
        if t.op != K.FUSED:
            steps = [(encode_op(t, t.op, ins, outs, t.params), ins, outs)]
        steps = argmax.steps(t, steps, outs)
        pre, gemv = _preload(steps)
        if pre:
            pre_of[t.id] = (pre, gemv)
        one = (len(steps) == 1 and not zero       # folded into one instruction: a plain task
               and all(v.ref[0] == REF_BUFFER for v in steps[0][1] + steps[0][2]))
        if t.op == K.FUSED and not one:
            ck = chunk_list([enc for enc, _, _ in steps])
            d = desc(Encoded(int(t.op), None), ins, outs)
            d["sub_begin"], d["n_sub"] = len(subs), len(steps)
            pf = [r for enc, _, _ in steps for r in enc.prefetch]
            d["pf_begin"], d["n_pf"] = len(ranges), len(pf)
            ranges.extend(pf)
            d["zero_begin"], d["n_zero"] = len(ranges), len(zero)
            ranges.extend(((REF_SCRATCH, o), 0, n) for o, n in zero)
            for enc, sins, souts in steps:
                sd = desc(enc, sins, souts)
                sd["n_pf"] = 0
                sd["task_id"] = t.id
                sd["ck_begin"], sd["n_ck"] = ck
                subs.append(sd)
            scratch += -(-used // SCRATCH_ALIGN) * SCRATCH_ALIGN
            d["ck_begin"], d["n_ck"] = ck
            d["n_ptr_all"] = len(refs) - d["ptr_begin"]      # its steps' pointers follow its own
        else:
            enc, sins, souts = steps[0]
            ck = chunk_list([enc])
            d = desc(enc, sins, souts)
            d["ck_begin"], d["n_ck"] = ck
            d["n_ptr_all"] = d["n_in"] + d["n_out"]
        d["task_id"] = t.id
        d["wait_begin"], d["n_waits"] = len(waits), len(t.waits)
        for w in t.waits:
            if not 0 <= w.counter < len(program.counters):
                _fail(t, f"waits on counter {w.counter}, which does not exist")
            waits.append((w.counter, w.threshold, int(n_inc[w.counter])))
        d["out_counter"] = t.out_counter if t.out_counter is not None else -1
        rows.append(d)

    queues = _queues(program, n_ctas)
    _attach_preloads(queues, pre_of, rows, ranges)
    n_prog = len(rows)
    for s in subs:
        s["wait_begin"], s["n_waits"], s["out_counter"] = 0, 0, -1
    for d in rows:
        if d.get("n_sub"):
            d["sub_begin"] += n_prog
    table = np.zeros(n_prog + len(subs), dtype=abi.TASK_DTYPE)
    for i, d in enumerate(rows + subs):
        rec = table[i]
        for f in ("op", "variant", "wait_begin", "n_waits", "out_counter", "ptr_begin", "n_in",
                  "n_out", "sub_begin", "n_sub", "pf_begin", "n_pf", "zero_begin", "n_zero",
                  "task_id", "ck_begin", "n_ck", "n_ptr_all", "n_pre"):
            rec[f] = d.get(f, 0)
        g = d["group"]
        for name, v in d["ip"].items():
            rec["ip"][abi.ip_index(g, name)] = int(v)
        first = waits[d["wait_begin"]:d["wait_begin"] + min(d["n_waits"], abi.INLINE_WAITS)]
        for k, (c, th, st) in enumerate(first):      # the waits the scheduler polls from smem
            rec["wait_c"][k], rec["wait_t"][k], rec["wait_s"][k] = c, th & 0xFFFFFFFF, st
        for name, v in d["fp"].items():
            rec["fp"][abi.fp_index(g, name)] = float(v)
    wt = np.zeros(len(waits), dtype=abi.WAIT_DTYPE)
    for i, (c, th, st) in enumerate(waits):
        wt[i]["counter"], wt[i]["threshold"], wt[i]["stride"] = c, th & 0xFFFFFFFF, st
    stream, stream_off = _weight_streams(table, queues)
    # the preloaded-rows path only in the op_gemv_direct variants some task of which uses it
    # (the o tiles after a combine): never-run code in a hot function costs time (NOTES v16)
    calls = list(variants)
    pre = table["ip"][:, abi.ip_index("GEMV", "PRE")] > 0
    for var, tmpl in direct_of.items():
        if pre[table["variant"] == var].any():
            calls[var] = _direct_call(dict(tmpl, pre=True))
    return Lowered(variants=calls, tasks=table, n_program_tasks=n_prog, waits=wt,
                   ptr_refs=np.array(refs, dtype=np.int64).reshape(-1, 2), ranges=ranges,
                   scratch_bytes=scratch, queues=queues, stream=stream, stream_off=stream_off)


def _weight_streams(table: np.ndarray, queues: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Per CTA, its tasks' weight chunks in queue order: the order its GEMVs consume them, so
    the device can copy any number of chunks ahead without looking at the tasks."""
    idx: list[int] = []
    off = [0]
    for q in queues:
        for tid in q:
            b, n = int(table[tid]["ck_begin"]), int(table[tid]["n_ck"])
            idx.extend(range(b, b + n))
        off.append(len(idx))
    if off[-1] >= 2 ** 31:
        _fail(None, f"{off[-1]} weight-stream chunks overflow the 32-bit stream offsets")
    return np.array(idx, dtype=np.int64), np.array(off, dtype=np.int32)
