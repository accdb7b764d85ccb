"""One encoder per opcode: (task for errors, opcode, input views, output views, params) ->
Encoded (the device-function variant, its integer and float descriptor parameters). Shapes the
templates cannot run are clear errors here."""
from __future__ import annotations

import math

from amk.program.ir import BufferKind, DType, InstructionKind as K
from amk.passes.tile import SPLIT_K_ALIGN
from amk.program.regions import NEW_KV, combine_partials, k_range, seq_range
from amk.backends.cuda import abi, gemv_batch, gemv_quant
from amk.backends.cuda.smem import GEMV_X_MAX, NWARPS, XS_MAX
from amk.backends.cuda.steps import (RMS_RN, Encoded, Variant, View, ctype, fail, ftype,
                                     int_input)

HD_MAX = 256            # largest attention head_dim the templates handle
SEG_BYTES = 4096        # a row's K segment an op_gemv_direct item reads: 32 lanes x GU 8 x 16 B
QMODES = {int(DType.I8): 1, int(DType.I4): 2, int(DType.F8E4M3): 3}   # qdtype -> op_gemv's QMODE


def gemv_direct(*, tx, tw, ty, ts, nmat, epi, bias, tr, to, norm=False, nx="float", nw="float",
                pre=False, rn=RMS_RN, sr=1) -> Variant:
    """op_gemv_direct with every template argument, in its order: NORM's row types and its row
    elements a thread (RN: folds.norm_into_gemv), PRE (some task of the variant reads preloaded
    rows: tables.pack), SR (row groups an item: direct_sr)."""
    return Variant.of("op_gemv_direct", tx=tx, tw=tw, ty=ty, ts=ts, nmat=nmat, epi=epi, bias=bias,
                      tr=tr, to=to, norm=norm, nx=nx, nw=nw, pre=pre, rn=rn, sr=sr)


def direct_sr(nmat: int, n_tile: int, row_bytes: int) -> int:
    """Row groups (two rows each) an op_gemv_direct item takes: rows of at most 2 KiB (1 KiB)
    fill half (a quarter) of an item's 4 KiB segment, so 2 (4) groups share an item and a warp
    keeps its 8 KiB of loads in flight (Qwen3-0.6B's K = 1024 GEMVs: 64 KiB an SM, not 128,
    NOTES v35); the most that gives no warp more groups than one a item would (the busiest
    warp's share; the small q/k/v tiles, one group a warp, keep 1)."""
    groups = n_tile if nmat == 2 else -(-n_tile // 2)
    busiest = -(-groups // NWARPS)
    for sr in (4, 2):
        if row_bytes * sr <= SEG_BYTES and -(-groups // sr // NWARPS) * sr <= busiest:
            return sr
    return 1


def _col_range(task, params, out: View) -> tuple[int, int]:
    lo = int(params.get("n_off", 0))
    nt = params.get("N_tile")
    hi = out.cols if nt is None else lo + int(nt)
    if not 0 <= lo <= hi <= out.cols:
        fail(task, f"column tile [{lo}, {hi}) is outside the output's {out.cols} columns")
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
    fail(task, f"operand of shape {x.shape} does not broadcast to the output {out.shape}")
    return 0, 0


_EW = {K.COPY: "COPY", K.ADD: "ADD", K.MUL: "MUL", K.SILU_MUL: "SILU_MUL", K.GELU: "GELU"}


def _is_ewx(op: K, p) -> bool:
    """Whether op_ewx (templates/ops_models.cuh) runs this op, not op_ew: SOFTCAP (tanh is cap
    1), GELU with tanh=1, COPY with x_off (slice / concat on the feature axis)."""
    return op == K.SOFTCAP or (op == K.GELU and int(p.get("tanh", 0)) == 1) or \
        (op == K.COPY and "x_off" in p)


def _enc_ewx(t, op, ins, outs, p) -> Encoded:
    out, a = outs[0], ins[0]
    c0, c1 = _col_range(t, p, out)
    if op == K.COPY:
        kind, x_off = "COPY_COLS", int(p["x_off"])
        rows = out.numel // max(out.cols, 1)
        if x_off + (c1 - c0) > a.cols or a.numel // max(a.cols, 1) != rows:
            fail(t, f"COPY x_off={x_off}: input {a.shape} columns [{x_off}, {x_off + c1 - c0}) "
                    f"do not fit output {out.shape}")
        a_rs, shift = a.cols, x_off - c0
    else:
        kind = "SOFTCAP" if op == K.SOFTCAP else "GELU_TANH"
        a_rs, a_cs = _bcast(t, a, out)
        if a_cs != 1:
            fail(t, f"{op.name}: input {a.shape} must have the output's columns {out.shape}")
        shift = 0
    var = Variant.of("op_ewx", kind=f"EWX_{kind}", ty=ctype(t, out.dtype), tx=ctype(t, a.dtype))
    e = Encoded(int(op), var, group="EWX")
    e.ip = dict(ROWS=out.numel // out.cols, COLS=out.cols, C0=c0, C1=c1, A_RS=a_rs, A_SHIFT=shift,
                XKIND=abi.EWX_KINDS.index(kind))
    e.fp = dict(CAP=float(p.get("cap", 1.0)))
    return e


def _enc_elementwise(t, op, ins, outs, p) -> Encoded:
    if _is_ewx(op, p):
        return _enc_ewx(t, op, ins, outs, p)
    out = outs[0]
    kind = _EW[op]
    n_args = {"COPY": 1, "GELU": 1, "ADD": 2, "SILU_MUL": 2, "MUL": 2}[kind]
    if op == K.MUL and len(ins) == 1:
        kind, n_args = "MULS", 1
    if len(ins) < n_args:
        fail(t, f"{op.name} needs {n_args} inputs, got {len(ins)}")
    a = ins[0]
    b = ins[1] if n_args == 2 else ins[0]
    c0, c1 = _col_range(t, p, out)
    ars, acs = _bcast(t, a, out)
    brs, bcs = _bcast(t, b, out)
    ta = ctype(t, a.dtype)
    tb = ctype(t, b.dtype)
    ty = ctype(t, out.dtype)
    e = Encoded(int(op), Variant.of("op_ew", kind=f"EW_{kind}", ty=ty, ta=ta, tb=tb), group="EW")
    e.ip = dict(ROWS=out.numel // out.cols, COLS=out.cols, C0=c0, C1=c1, A_RS=ars, A_CS=acs,
                B_RS=brs, B_CS=bcs, KIND=abi.EW_KINDS.index(kind))
    e.fp = dict(SCALE=float(p.get("scale", 1.0)))
    return e


def _enc_gemv(t, op, ins, outs, p) -> Encoded:
    x, w, out = ins[0], ins[1], outs[0]
    Kd = int(p.get("K", x.cols))
    if Kd <= 0 or x.numel % Kd:
        fail(t, f"x of {x.numel} elements is not rows of K={Kd}")
    M = x.numel // Kd
    N = out.cols
    if out.numel != M * N:
        fail(t, f"output {out.shape} is not [{M}, N] for x {x.shape} and K={Kd}")
    qd = int(p.get("qdtype", 0))
    quant = qd in QMODES and len(ins) >= 3
    rows = w.shape[0] if w.shape else 1
    ldw = w.numel // max(rows, 1)
    bias_at = 0                      # the bias input's index (0: none)
    if quant:
        scales = ins[2]
        if p.get("bias"):            # a quantized GEMV's bias is its last input
            bias_at = len(ins) - 1
            if ins[-1].dtype != scales.dtype:
                fail(t, f"the bias ({ins[-1].dtype.name}) and the scales ({scales.dtype.name}) "
                        "of a quantized GEMV must share a dtype")
        zeros = ins[3] if len(ins) > 3 + bool(bias_at) else None
        n_full = scales.shape[0]
        group = int(p.get("group", Kd))
        ngroups = scales.numel // n_full
        qmode = QMODES[qd]
        if qmode == 2 and w.dtype not in (DType.U8, DType.I8):
            fail(t, f"int4 weights are packed in a U8 buffer, got {w.dtype.name}")
        if qmode in (1, 3) and w.dtype != DType(qd):
            fail(t, f"qdtype {DType(qd).name} weights must be a {DType(qd).name} buffer, got {w.dtype.name}")
        vw = 32 if qmode == 2 else 16
        vec = Kd % vw == 0 and ldw % 16 == 0
        ts = ftype(t, scales.dtype)
        tz = ftype(t, zeros.dtype) if zeros is not None else ts
        tw = "unsigned char" if qmode == 3 else ctype(t, w.dtype)   # fp8: bytes, decoded in op_gemv
    else:
        zeros = None
        n_full = rows
        group, ngroups, qmode = Kd, 1, 0
        tw = ftype(t, w.dtype)
        vw = 16 // w.esize
        vec = Kd % vw == 0 and ldw % vw == 0
        bias = ins[2] if len(ins) > 2 else None
        bias_at = 2 if bias is not None else 0
        ts = ftype(t, bias.dtype) if bias is not None else "float"
        tz = ts
    n_off = int(p.get("n_off", 0))
    n_tile = int(p.get("N_tile", n_full))
    if not (0 <= n_off and n_off + n_tile <= min(n_full, N)):
        fail(t, f"tile [{n_off}, {n_off + n_tile}) exceeds the weight's {n_full} rows / "
                 f"output's {N} columns")
    klo, khi = k_range(p, Kd)           # a K slice of a split GEMV (passes/tile.py), or all of K
    ks = (klo, khi) != (0, Kd)
    mb = max(1, min(M, 4, XS_MAX // Kd))
    # the non-coherent read-only path only for buffers nothing writes during the kernel
    w_ro = w.kind in (BufferKind.WEIGHT, BufferKind.CONST)
    has_bias = bias_at > 0
    row_bytes = ldw * w.esize
    direct = (qmode == 0 and vec and M == 1 and row_bytes % 16 == 0
              and _direct_fits(-(-Kd // 4) * 4, n_tile, -(-Kd * w.esize // 4096)))
    gshift = gemv_quant.group_shift(qmode, group, ngroups) if quant else None
    qdirect = (quant and vec and M == 1 and w_ro and gshift is not None
               and _direct_fits(gemv_quant.x_floats(Kd, qmode), n_tile, -(-Kd // gemv_quant.SEGMENT)))
    if ks:                          # only op_gemv_mma runs a K slice
        direct = qdirect = False
        if not (0 <= klo < khi <= Kd and klo % SPLIT_K_ALIGN == 0 and khi % SPLIT_K_ALIGN == 0):
            fail(t, f"K slice [{klo}, {khi}) of K={Kd}: its ends must be multiples of {SPLIT_K_ALIGN}")
    mma = (_mma_plan(x, w, out, M, khi - klo, n_tile, qmode, row_bytes, quant)
           if gemv_batch.scales_vectors(qmode, group, ngroups) and not qdirect else None)
    if ks and mma is None:
        fail(t, f"a K slice runs on the tensor-core GEMV only (bf16 x, M > 1 or quantized weights); "
                f"here x is {x.dtype.name} [{M} rows], the weights {w.dtype.name}")
    if not (direct or qdirect or mma is not None) and Kd > GEMV_X_MAX:   # op_gemv stages one row
        fail(t, f"K={Kd} exceeds the {GEMV_X_MAX} elements of x a GEMV at M={M} stages in shared memory, "
                 f"and the tensor-core GEMV, which takes x in windows, cannot run it (it takes bf16 x with "
                 f"bf16 weights, or quantized ones in groups of whole k-blocks; K a multiple of 8); "
                 f"here x is {x.dtype.name}, the weights {w.dtype.name}")
    if qdirect:
        ri, roll = gemv_quant.plan_items(qmode, 1, n_tile, Kd, zeros is not None)
        var = gemv_quant.gemv_qdirect(tx=ftype(t, x.dtype), ty=ftype(t, out.dtype), ts=ts, tz=tz, qmode=qmode,
                                      nmat=1, epi=0, bias=has_bias, zeros=zeros is not None, ri=ri, roll=roll)
    elif mma is not None and not direct:
        var = gemv_batch.gemv_mma(ty=ftype(t, out.dtype), ts=ts, tz=tz, qmode=qmode, nmat=1, epi=0,
                                  bias=has_bias, zeros=zeros is not None, nb=mma.nb, xr=mma.xr, ks=ks)
    elif direct:
        var = gemv_direct(tx=ftype(t, x.dtype), tw=tw, ty=ftype(t, out.dtype), ts=ts, nmat=1, epi=0,
                          bias=has_bias, tr="float", to=ftype(t, out.dtype),
                          sr=direct_sr(1, n_tile, Kd * w.esize))
    else:
        var = Variant.of("op_gemv", tx=ftype(t, x.dtype), tw=tw, ty=ftype(t, out.dtype), ts=ts, tz=tz,
                         qmode=qmode, bias=has_bias, zeros=zeros is not None, vec=vec, mb=mb, wro=w_ro)
    e = Encoded(int(op), var, group="GEMV")
    e.ip = dict(M=M, K=Kd, N=N, N_OFF=n_off, N_TILE=n_tile, LDW=ldw, GROUP=group,
                NGROUPS=ngroups, BIAS_AT=bias_at)
    if var.fn == "op_gemv_mma":
        e.ip.update(gemv_batch.plan_ip(mma), **(dict(KLO=klo, KHI=khi) if ks else {}))
    if qdirect:
        e.ip["GSHIFT"] = gshift
    return e


def _mma_plan(x: View, w: View, out: View, M: int, Kd: int, n_tile: int, qmode: int,
              row_bytes: int, quant: bool) -> gemv_batch.MmaPlan | None:
    """op_gemv_mma's plan for a GEMV it runs (gemv_batch.py), else None: bf16 x, whole 16-byte
    weight vectors a row, and quantized weights (any M) or bf16 weights with M > 1, or at M = 1
    with K past GEMV_X_MAX (op_gemv_direct and op_gemv stage all of x; op_gemv_mma takes it in
    windows: Qwen2.5-32B's, Llama-3-70B's down projections)."""
    vw = gemv_batch.VW[qmode]
    if x.dtype != DType.BF16 or out.dtype not in (DType.F32, DType.F16, DType.BF16):
        return None
    if Kd % vw or Kd % 8 or row_bytes % 16 or w.kind not in (BufferKind.WEIGHT, BufferKind.CONST):
        return None
    if not (quant or (w.dtype == DType.BF16 and (M > 1 or Kd > GEMV_X_MAX))):
        return None
    return gemv_batch.plan(M, Kd, n_tile, 1, qmode)


def _direct_fits(x_floats: int, n_tile: int, nseg: int) -> bool:
    """x (x_floats fp32) and op_gemv_direct's / op_gemv_qdirect's sums (one per row and K
    segment) fit below the preload / ring (smem.GEMV_X_MAX: the work area and the staging
    area), also once the tile is paired with another (pair_gemvs)."""
    return x_floats + 2 * n_tile * nseg <= GEMV_X_MAX


def _enc_norm(t, op, ins, outs, p) -> Encoded:
    x, w, out = ins[0], ins[1], outs[0]
    H = int(p.get("hidden", w.numel)) if op == K.LAYERNORM else w.numel
    if x.numel % H or out.numel != x.numel:
        fail(t, f"x {x.shape} / out {out.shape} are not rows of H={H}")
    if op == K.RMSNORM:
        var = Variant.of("op_rmsnorm", tx=ftype(t, x.dtype), tw=ftype(t, w.dtype), ty=ftype(t, out.dtype))
        eps = float(p.get("eps", 1e-6))
    else:
        hb = len(ins) > 2
        tb = ftype(t, ins[2].dtype) if hb else "float"
        var = Variant.of("op_layernorm", tx=ftype(t, x.dtype), tw=ftype(t, w.dtype), tb=tb,
                         ty=ftype(t, out.dtype), has_b=hb)
        eps = float(p.get("eps", 1e-5))
    e = Encoded(int(op), var, group="NORM")
    e.ip = dict(ROWS=x.numel // H, H=H)
    e.fp = dict(EPS=eps)
    return e


def _enc_rope(t, op, ins, outs, p) -> Encoded:
    x, pos, out = ins[0], ins[1], outs[0]
    hd = int(p["head_dim"])
    if hd % 2 or out.numel % hd or x.numel != out.numel:
        fail(t, f"rope: x {x.shape} / out {out.shape} are not rows of head_dim={hd}")
    c0, c1 = _col_range(t, p, out)
    if (c0, c1) != (0, out.cols) and (c0 % hd or (c1 - c0) % hd):
        fail(t, f"rope column tile [{c0}, {c1}) must cover whole heads of {hd}")
    heads = out.numel // hd
    if heads % pos.numel:
        fail(t, f"rope: {pos.numel} positions do not divide {heads} heads")
    has_inv = len(ins) > 2
    tf = ftype(t, ins[2].dtype) if has_inv else "float"
    e = Encoded(int(op), Variant.of("op_rope", tx=ftype(t, x.dtype), ty=ftype(t, out.dtype), tf=tf),
                group="ROPE")
    e.ip = dict(ROWS=out.numel // out.cols, COLS=out.cols, C0=c0, C1=c1, HD=hd, NPOS=pos.numel,
                POS64=int_input(t, pos, "rope pos"), HAS_INV=int(has_inv))
    e.fp = dict(THETA=float(p.get("theta", 10000.0)))
    return e


def _staged_attention(types: dict, hd: int, batch: int, shards: int) -> str:
    """The staged attention's device function: on tensor cores (op_attention_mma) for bf16 q,
    K and V of head dim 64 or 128 in a batch's task over a sequence's whole window (one shard:
    its chunk pipeline pays over long windows; on the shards of batch 1 and 4 it lost 40-46 us
    a step, NOTES v26), else on CUDA cores (op_attention_smem)."""
    bf16 = all(types[k] == "bf16" for k in ("tq", "tk", "tv"))
    mma = bf16 and hd in (64, 128) and batch > 1 and shards == 1
    return "op_attention_mma" if mma else "op_attention_smem"


def _enc_attention(t, op, ins, outs, p) -> Encoded:
    q, kc, vc, out = ins[0], ins[1], ins[2], outs[0]
    hd = int(p["head_dim"])
    nh = int(p.get("n_heads", q.shape[-2] if len(q.shape) >= 2 and q.cols == hd
                   else q.cols // hd))
    nkv = int(p.get("n_kv_heads", nh))
    if nkv <= 0 or nh % nkv:
        fail(t, f"n_heads={nh} is not a multiple of n_kv_heads={nkv}")
    rep = nh // nkv
    if len(kc.shape) == 4:
        B, max_seq = kc.shape[0], kc.shape[1]
    elif len(kc.shape) == 3 and tuple(kc.shape[-2:]) == (nkv, hd):
        B, max_seq = 1, kc.shape[0]
    else:
        B, max_seq = 1, kc.numel // (nkv * hd)
    if B * max_seq * nkv * hd != kc.numel or vc.numel != kc.numel:
        fail(t, f"caches {kc.shape}/{vc.shape} are not [B?, max_seq, {nkv}, {hd}]")
    if q.numel != B * nh * hd:
        fail(t, f"q {q.shape} is not [{B}, {nh}*{hd}]")
    if hd > HD_MAX or hd % 2:
        fail(t, f"head_dim={hd} must be even and at most {HD_MAX}")
    h_off = int(p.get("h_off", 0))
    hc = int(p.get("h_count", nh - h_off))
    if not (h_off >= 0 and hc >= 0 and h_off + hc <= nh and h_off % rep == 0 and hc % rep == 0):
        fail(t, f"head range h_off={h_off}, h_count={hc} must cover whole kv groups of {rep}")
    flags = int(p.get("flags", 0))
    width = hd + 2 if flags & 2 else hd
    if out.numel != B * nh * width:
        fail(t, f"output {out.shape} is not [{B}, {nh}, {width}]")
    lo = int(p.get("kv_start", 0))
    kv_len = int(p.get("kv_len", max_seq - lo))
    has_pos = len(ins) > 3
    b0, b1 = seq_range(p, B)
    if not 0 <= b0 < b1 <= B:
        fail(t, f"sequences [{b0}, {b1}) are not in the cache's {B}")
    pos_seq = has_pos and ins[3].numel > 1          # sequence b at pos[b]
    if pos_seq and (ins[3].numel != B or len(kc.shape) != 4):
        fail(t, f"pos {ins[3].shape}: the CUDA attention takes one position, or one for each "
                f"of the cache's {B} sequences (a prompt block runs on the triton backend)")
    new_kv = bool(flags & NEW_KV)
    tn = ftype(t, q.dtype)
    if new_kv:
        if len(ins) != 6 or not has_pos:
            fail(t, "NEW_KV attention takes q, k_cache, v_cache, pos, k_new, v_new")
        if ins[4].dtype != ins[5].dtype or any(x.numel != B * nkv * hd for x in ins[4:6]):
            fail(t, f"k_new {ins[4].shape} / v_new {ins[5].shape} must be one dtype and "
                     f"[{B}, {nkv}*{hd}]")
        tn = ftype(t, ins[4].dtype)
    # K/V rows staged in smem by 16-byte cp.async where rows are whole 16-byte vectors
    staged = (hd * kc.esize) % 16 == 0 and (hd * vc.esize) % 16 == 0
    types = dict(tq=ftype(t, q.dtype), tk=ftype(t, kc.dtype), tv=ftype(t, vc.dtype),
                 to=ftype(t, out.dtype), tn=tn, tf="float")
    hg = max(g for g in range(1, 9) if rep % g == 0)      # q heads a pass (registers, no predicates)
    cap = float(p.get("softcap", 0.0)) > 0
    fn = _staged_attention(types, hd, B, int(p.get("kv_shards", 1)))
    var = (Variant.of(fn, **types, hg=hg, hdc=hd, cap=cap) if staged
           else Variant.of("op_attention", **types, cap=cap))
    e = Encoded(int(op), var, group="ATTN")
    e.ip = dict(HD=hd, NH=nh, NKV=nkv, KV_START=lo, KV_LEN=kv_len, FLAGS=flags, H_OFF=h_off,
                H_COUNT=hc, B_OFF=b0, B_COUNT=b1 - b0, POS_SEQ=int(pos_seq), MAX_SEQ=max_seq,
                POS64=int_input(t, ins[3], "attention pos") if has_pos else 0,
                HAS_POS=int(has_pos), NEW_KV=int(new_kv),
                KV_SHARD=int(p.get("kv_shard", 0)), KV_SHARDS=int(p.get("kv_shards", 1)),
                WINDOW=int(p.get("window", 0)), SHARD_ROWS=int(p.get("kv_shard_rows", 0)))
    if (e.ip["WINDOW"] or e.ip["SHARD_ROWS"]) and not has_pos:
        fail(t, "a sliding window or a live shard count needs the runtime pos input")
    e.ip["EARLY"] = int(fn == "op_attention_smem" and staged and new_kv
                          and _early(ins, b1 - b0, hc, rep, hg))
    e.fp = dict(SCALE=float(p.get("scale", 1.0 / hd ** 0.5)), SOFTCAP=float(p.get("softcap", 0.0)))
    return e


def _early(ins: list[View], seqs: int, hc: int, rep: int, hg: int) -> bool:
    """Whether the staged attention's pos read and first K/V copies may run during its poll
    (attn_early): nothing this step writes may feed them. pos must be a runtime input (written
    before the launch) and the caches' rows other than pos are last step's; row pos, which this
    step's (deferred) append writes, is replaced by NEW_KV's new rows. One sequence and one pass
    (one kv group, all its heads at once), so the early copies are the pass's first chunk."""
    return (ins[3].kind == BufferKind.IO_INPUT
            and ins[1].kind == ins[2].kind == BufferKind.KV_CACHE
            and seqs == 1 and hc == rep and hg == rep)


def _enc_combine(t, op, ins, outs, p) -> Encoded:
    out = outs[0]
    hd = int(p["head_dim"])
    nh = int(p.get("n_heads", out.numel // hd if len(out.shape) <= 1 else out.cols // hd))
    B = out.numel // (nh * hd)
    h_off = int(p.get("h_off", 0))
    hc = int(p.get("h_count", nh - h_off))
    parts = ins[:combine_partials(p, len(ins))]
    if not parts or any(x.numel != B * nh * (hd + 2) or x.dtype != parts[0].dtype for x in parts):
        fail(t, f"combine inputs must be [{B}, {nh}, {hd}+2] partials of one dtype")
    if not (0 <= h_off and h_off + hc <= nh):
        fail(t, f"head range h_off={h_off}, h_count={hc} outside {nh} heads")
    e = Encoded(int(op), Variant.of("op_combine", tp=ftype(t, parts[0].dtype), to=ftype(t, out.dtype),
                                      hdc=hd, npc=len(parts)), group="COMB")
    e.ip = dict(HD=hd, NH=nh, H_OFF=h_off, H_COUNT=hc, B=B, P=len(parts))
    if len(parts) < len(ins):           # the live count: pos after the partials
        pos = ins[-1]
        if pos.numel not in (1, B):
            fail(t, f"pos {pos.shape}: the CUDA combine takes one position, or one a row ({B})")
        e.ip.update(SHARD_ROWS=int(p["kv_shard_rows"]), KV_START=int(p.get("kv_start", 0)),
                    KV_LEN=int(p["kv_len"]), WINDOW=int(p.get("window", 0)),
                    POS64=int_input(t, pos, "combine pos"), POS_SEQ=int(pos.numel > 1))
    return e


def _enc_embed(t, op, ins, outs, p) -> Encoded:
    ids, table, out = ins[0], ins[1], outs[0]
    H = table.cols
    if out.numel != ids.numel * H:
        fail(t, f"output {out.shape} is not [{ids.numel}, {H}]")
    e = Encoded(int(op), Variant.of("op_embed", tt=ctype(t, table.dtype), to=ctype(t, out.dtype)),
                group="EMBED")
    e.ip = dict(B=ids.numel, H=H, V=table.numel // H, IDS64=int_input(t, ids, "token ids"))
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
        fail(t, f"new rows {new.shape} are not rows of {rowlen} for a cache {cache.shape}")
    has_pos = "pos" not in p
    if has_pos and len(ins) < 2:
        fail(t, "KV_APPEND needs a pos input (or the seed's params['pos'])")
    pos_seq = has_pos and ins[1].numel > 1          # sequence b's rows at pos[b]
    if pos_seq and (ins[1].numel != B or B == 1):
        fail(t, f"pos {ins[1].shape}: the CUDA append takes one position, or one for each of "
                f"the cache's {B} sequences (a prompt block runs on the triton backend)")
    e = Encoded(int(op), Variant.of("op_kv_append", tn=ctype(t, new.dtype), tc=ctype(t, cache.dtype),
                                      tf="float"), group="KV")
    e.ip = dict(ROWLEN=rowlen, NROWS=new.numel // (B * rowlen), MAX_SEQ=max_seq, B=B,
                POS64=int_input(t, ins[1], "pos") if has_pos else 0, HAS_POS=int(has_pos),
                POS_PARAM=int(p.get("pos", 0)), POS_SEQ=int(pos_seq))
    return e


def _enc_argmax(t, op, ins, outs, p) -> Encoded:
    x, out = ins[0], outs[0]
    V = x.cols
    e = Encoded(int(op), Variant.of("op_argmax", tx=ftype(t, x.dtype)), group="ARGMAX")
    e.ip = dict(ROWS=x.numel // V, V=V, OUT64=int_input(t, out, "argmax output"))
    if out.numel != x.numel // V:
        fail(t, f"output {out.shape} has not one id per row of {x.shape}")
    return e


def _enc_softmax(t, op, ins, outs, p) -> Encoded:
    x, out = ins[0], outs[0]
    if int(p.get("dim", -1)) not in (-1, len(out.shape) - 1):
        fail(t, "SOFTMAX over an axis other than the last is not supported")
    e = Encoded(int(op), Variant.of("op_softmax", tx=ftype(t, x.dtype), ty=ftype(t, out.dtype)),
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
        fail(t, f"output {out.shape} is not [{N}, {Kd}]")
    zeros = ins[2] if len(ins) > 2 else None
    tz = ftype(t, zeros.dtype) if zeros is not None else "float"
    fp8 = qd == int(DType.F8E4M3)    # PACKED 2: E4M3 bytes, decoded in op_dequant
    var = Variant.of("op_dequant", tq="unsigned char" if fp8 else ctype(t, qw.dtype),
                     ts=ftype(t, scales.dtype), tz=tz, ty=ftype(t, out.dtype), zeros=zeros is not None)
    e = Encoded(int(op), var, group="DEQ")
    e.ip = dict(N=N, K=Kd, LDQ=qw.cols, GROUP=int(p.get("group", Kd)),
                NGROUPS=scales.numel // N, PACKED=2 if fp8 else int(packed))
    return e


def _enc_sum(t, op, ins, outs, p) -> Encoded:
    """SUM (a split GEMV's partials), and ALLREDUCE_SHARD on one device (the sum of its shards,
    in order): op_sum, over the tile's columns or the whole output."""
    out = outs[0]
    if any(v.numel != out.numel for v in ins) or len({v.dtype for v in ins}) != 1:
        fail(t, f"{op.name}'s inputs must share the output's {out.numel} elements and one dtype, got "
                f"{[(v.shape, v.dtype.name) for v in ins]}")
    c0, c1 = _col_range(t, p, out)           # ALLREDUCE_SHARD has no tile: every column
    ty = ftype(t, out.dtype)
    var = Variant.of("op_sum", ty=ty, tp=ftype(t, ins[0].dtype), np=len(ins), res=False, tr="float",
                     to=ty)
    e = Encoded(int(op), var, group="SUM")
    e.ip = dict(ROWS=out.numel // out.cols, COLS=out.cols, C0=c0, C1=c1)
    return e


ENCODERS = {
    K.COPY: _enc_elementwise, K.ADD: _enc_elementwise, K.MUL: _enc_elementwise,
    K.SILU_MUL: _enc_elementwise, K.GELU: _enc_elementwise, K.SOFTCAP: _enc_elementwise,
    K.ALLREDUCE_SHARD: _enc_sum,
    K.GEMV_TILE: _enc_gemv, K.GEMM_TILE: _enc_gemv,
    K.RMSNORM: _enc_norm, K.LAYERNORM: _enc_norm,
    K.ROPE: _enc_rope,
    K.ATTENTION_TILE: _enc_attention, K.ATTENTION_COMBINE: _enc_combine,
    K.EMBED: _enc_embed, K.KV_APPEND: _enc_kv_append,
    K.SAMPLE_ARGMAX: _enc_argmax, K.SOFTMAX: _enc_softmax, K.DEQUANT: _enc_dequant,
    K.SUM: _enc_sum,
}


def encode_op(task, op: K, ins: list[View], outs: list[View], params) -> Encoded:
    if op == K.NOP:
        return Encoded(int(op), None)
    if op not in ENCODERS:
        fail(task, f"opcode {op.name} has no CUDA template")
    if not outs:
        fail(task, f"{op.name} has no output")
    return ENCODERS[op](task, op, ins, outs, params)
