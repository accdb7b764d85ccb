"""The CUDA lowering's folds of a FUSED task's steps: each merges steps the templates can run as
one (a rope into the attention that reads it, gate/up/silu into one GEMV, a residual add into
its GEMV, a norm into the GEMV's x staging ...), so a step's output skips a scratch round trip
and a barrier. Every fold is Fused -> Fused and keeps the bits of the unfolded steps. FOLDS is
the ordered list, like passes/pipeline.PIPELINE; the program-level folds (argmax partials,
preloads) are argmax_fold.py and preload.py.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from amk.program.ir import DType, InstructionKind as K
from amk.backends.cuda import abi, encoders, gemv_batch, gemv_quant
from amk.backends.cuda.smem import NTHREADS, XS_MAX
from amk.backends.cuda.steps import (FLOATS, REF_SCRATCH, RMS_RN, STAGED_ATTENTION, Encoded, Fused,
                                     Variant, ctype, ftype)


def _x_width(enc: Encoded) -> int | None:
    """Elements of a one-row norm / whole-output batch-1 combine (x producers), else None."""
    if enc.op in (int(K.RMSNORM), int(K.LAYERNORM)) and enc.ip["ROWS"] == 1:
        return enc.ip["H"]
    if (enc.op == int(K.ATTENTION_COMBINE) and enc.ip["B"] == 1 and enc.ip["H_OFF"] == 0
            and enc.ip["H_COUNT"] == enc.ip["NH"]):
        return enc.ip["NH"] * enc.ip["HD"]
    return None


def norm_into_smem(f: Fused) -> Fused:
    """A one-row norm (or a whole batch-1 combine) whose scratch output only the GEMV steps
    right after it read as x: it writes x into the GEMVs' shared-memory staging area (fp32,
    rounded through the scratch dtype as before) and the GEMVs skip staging it, so x never
    goes through global memory (so it is never zeroed either)."""
    steps, zero = list(f.steps), f.zero
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
               and not steps[j][0].is_fn("op_gemv_mma")          # stages bf16 x itself
               and steps[j][1][0].ref == ref and all(v.ref != ref for v in steps[j][1][1:])
               and steps[j][0].ip["M"] == 1 and steps[j][0].ip["K"] == H
               for j in readers):
            steps[i] = (_with_ip(enc, TO_SMEM=1),) + tuple(steps[i][1:])
            for j in readers:
                steps[j] = (_with_ip(steps[j][0], XS_READY=1),) + tuple(steps[j][1:])
            zero = [(o, n) for o, n in zero if (REF_SCRATCH, o) != ref]
    return Fused(steps, zero)


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


def _same_positions(r, a) -> bool:
    """The ROPE rotates a row where step `a` (an attention or append with POS_SEQ) puts it:
    every row at pos[0] (one position, a not POS_SEQ), or row b at pos[b] (a position a row,
    a POS_SEQ: sequence b at pos[b])."""
    if a.ip["POS_SEQ"]:
        return r.ip["NPOS"] == r.ip["ROWS"] > 1
    return r.ip["NPOS"] == 1


def _rope_fold(r, ra, ro, a, aa, later, consumer: int) -> bool:
    """The shared conditions of the two rope folds: a ROPE into a scratch that only the next
    step (a `consumer` step) reads, as its first argument, with the same pos, a row's position
    where the consumer puts it."""
    return (r.op == int(K.ROPE) and a.op == consumer and aa[0].ref == ro[0].ref
            and ro[0].ref[0] == REF_SCRATCH and not _read_later(ro[0].ref, later)
            and _same_positions(r, a) and ra[0].dtype == ro[0].dtype)


def _rope_joins(r, ra, a, aa) -> bool:
    """A staged attention with pos can take this ROPE's rotation: same pos (a row's position
    where the attention puts its sequence) and head_dim, and (if it already rotates the new k
    row) the same frequencies. A batch's attention rotates its own sequences' rows only."""
    if not (a.is_fn(*STAGED_ATTENTION) and a.ip["HAS_POS"]
            and len(aa) > 3 and ra[1].ref == aa[3].ref and r.ip["POS64"] == a.ip["POS64"]
            and _same_positions(r, a) and r.ip["HD"] == a.ip["HD"]):
        return False
    if a.ip.get("K_ROPE"):              # one set of frequencies for q and the new k row
        inv = ra[2:3]
        return (r.fp["THETA"] == a.fp["THETA"] and bool(inv) == bool(a.ip["ROPE_INV"])
                and (not inv or inv[0].ref == aa[-1].ref))
    return True


def _rotated(a: Encoded, aa, r: Encoded, ra, flag: str):
    """(the attention's Encoded with `flag` set, inverse frequencies it gains as an input)."""
    inv = [] if a.ip.get("Q_ROPE") or a.ip.get("K_ROPE") else list(ra[2:3])
    e = Encoded(a.op, _with_inv(a.variant, inv), dict(a.ip, **{flag: 1}, ROPE_INV=int(bool(ra[2:3]))),
                dict(a.fp, THETA=r.fp["THETA"]), a.group)
    return e, inv


def rope_into_attention(f: Fused) -> Fused:
    """A ROPE of exactly one staged attention's q heads (the attention's own pos; at a batch
    every row's, each attention task rotating only its sequences' rows) into a scratch only
    that attention reads: the attention rotates q itself while it stages it (op_attention_smem's
    Q_ROPE), so q skips the scratch round trip and the step's barrier."""
    def fold(window, later):
        (r, ra, ro), (a, aa, ao) = window
        if not (_rope_fold(r, ra, ro, a, aa, later, int(K.ATTENTION_TILE)) and _rope_joins(r, ra, a, aa)
                and r.ip["COLS"] == a.ip["NH"] * a.ip["HD"]
                and (r.ip["C0"], r.ip["C1"]) == (a.ip["H_OFF"] * a.ip["HD"],
                                                 (a.ip["H_OFF"] + a.ip["H_COUNT"]) * a.ip["HD"])):
            return None
        e, inv = _rotated(a, aa, r, ra, "Q_ROPE")
        return e, [ra[0]] + list(aa[1:]) + inv, ao
    return Fused(_fold_windows(f.steps, 2, fold), f.zero)


def k_rope_into_attention(f: Fused) -> Fused:
    """The whole-tensor ROPE of a NEW_KV attention's new k rows (one a sequence, at its pos)
    into a scratch only that attention reads, as k_new: the attention rotates its kv head's
    row of each of its sequences itself (op_attention_smem's K_ROPE). The steps between may
    only write other scratch (the q rope)."""
    steps = f.steps
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
                and _rope_joins(r, ra, a, aa) and (r.ip["C0"], r.ip["C1"]) == (0, r.ip["COLS"])
                and r.ip["COLS"] == a.ip["NKV"] * a.ip["HD"]
                and ra[0].numel == ro[0].numel == r.ip["ROWS"] * r.ip["COLS"]
                and ra[0].dtype == ro[0].dtype == aa[5].dtype):
            continue
        e, inv = _rotated(a, aa, r, ra, "K_ROPE")
        out[j] = (e, list(aa[:4]) + [ra[0]] + list(aa[5:]) + inv, ao)
        out[i] = None
    return Fused([s for s in out if s is not None], f.zero)


def rope_into_append(f: Fused) -> Fused:
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
        e = Encoded(a.op, _with_inv(a.variant, inv), dict(a.ip, ROPE_HD=r.ip["HD"], ROPE_INV=int(bool(inv))),
                    dict(a.fp, THETA=r.fp["THETA"]), a.group)
        return e, [ra[0], aa[1]] + list(inv), ao
    return Fused(_fold_windows(f.steps, 2, fold), f.zero)


def norm_into_attention(f: Fused) -> Fused:
    """A per-head RMSNORM (rows of head_dim; input, output and weight of one dtype) into a
    scratch that only one staged batch-1 attention reads, as q or as NEW_KV's new k row: the
    attention normalises those rows itself as it stages them (op_attention_smem's QKN, after
    the rope folds), so the norm loses its scratch round trip and its barrier (Qwen3's q/k norm:
    two ~2 us steps in every attention task, NOTES v22). The weight becomes an input before the
    inverse frequencies (the attention reads those at its last input); both norms share one eps."""
    out = list(f.steps)
    for i, (nrm, na, no) in enumerate(f.steps):
        if nrm.op != int(K.RMSNORM) or no[0].ref[0] != REF_SCRATCH or nrm.ip.get("TO_SMEM"):
            continue
        readers = [j for j in range(i + 1, len(out))
                   if out[j] is not None and any(v.ref == no[0].ref for v in out[j][1])]
        if len(readers) != 1:
            continue
        j = readers[0]
        a, aa, ao = out[j]
        slot = next((k for k in (0, 4) if k < len(aa) and aa[k].ref == no[0].ref), None)
        shift = {0: 0, 4: 8}.get(slot)                 # QKN_ARGS: q's weight & 255, k's >> 8
        have = a.ip.get("QKN_ARGS", 0)
        x, w = na[0], na[1]
        eps = a.fp.get("QKN_EPS", nrm.fp["EPS"])
        between = [v.ref for st in out[i + 1:j] if st is not None for v in st[2]]
        if not (shift is not None and a.is_fn(*STAGED_ATTENTION) and not (have >> shift) & 255
                and (slot == 0 or a.ip.get("NEW_KV")) and nrm.ip["H"] == a.ip["HD"]
                and aa[0].numel == a.ip["NH"] * a.ip["HD"]          # batch 1 (GPU-tested so)
                and sum(v.ref == no[0].ref for v in aa) == 1
                and x.dtype == no[0].dtype == w.dtype and x.numel == no[0].numel
                and w.numel == a.ip["HD"] and eps == nrm.fp["EPS"]
                and all(r[0] == REF_SCRATCH and r not in (x.ref, w.ref) for r in between)):
            continue
        args = list(aa)
        args[slot] = x
        at = len(args) - 1 if a.ip.get("ROPE_INV") else len(args)
        args.insert(at, w)
        assert at < 256
        e = Encoded(a.op, a.variant.with_(qkn=True), dict(a.ip, QKN_ARGS=have | at << shift),
                    dict(a.fp, QKN_EPS=eps), a.group)
        out[j] = (e, args, ao)
        out[i] = None
    return Fused([s for s in out if s is not None], f.zero)


def pair_gemvs(f: Fused) -> Fused:
    """gate GEMV, up GEMV (one op_gemv_direct, op_gemv_qdirect or op_gemv_mma variant, same x
    and row tile, scratch outputs) and the SILU_MUL of exactly those two tiles that follows them: one GEMV of
    NMAT=2 that computes silu(gate) * up from its sums and writes the SILU_MUL's output. x is
    staged once and neither tile goes through scratch. op_gemv_mma: its plan for twice the sums,
    quantized matrices' scales (and zeros) after the weights."""
    silu = abi.EW_KINDS.index("SILU_MUL")
    same = ("M", "K", "N", "N_OFF", "N_TILE", "LDW", "XS_READY", "GROUP", "NGROUPS", "BIAS_AT", "KLO", "KHI")

    def fold(window, later):
        (a, aa, ao), (b, ba, bo), (c, ca, co) = window
        ga, gb = _direct(a) or _mma(a), _direct(b) or _mma(b)
        if not (ga and ga == gb and ga.arg("epi") == 0 and not ga.arg("bias") and ga.arg("nmat") == 1
                and len(aa) == len(ba) and aa[0].ref == ba[0].ref and all(a.ip.get(k) == b.ip.get(k) for k in same)
                and c.op == int(K.SILU_MUL) and c.ip.get("KIND") == silu and c.ip["ROWS"] == a.ip["M"]
                and sorted(v.ref for v in ca) == sorted([ao[0].ref, bo[0].ref]) and ao[0].ref != bo[0].ref
                and ao[0].ref[0] == bo[0].ref[0] == REF_SCRATCH
                and (c.ip["C0"], c.ip["C1"]) == (a.ip["N_OFF"], a.ip["N_OFF"] + a.ip["N_TILE"])
                and all(c.ip[k] == c.ip["COLS"] for k in ("A_RS", "B_RS")) and c.ip["A_CS"] == c.ip["B_CS"] == 1
                and co[0].cols == ao[0].cols == bo[0].cols == a.ip["N"] and co[0].dtype in FLOATS
                and not _read_later(ao[0].ref, later) and not _read_later(bo[0].ref, later)):
            return None
        ip = dict(a.ip)
        if ga.fn == "op_gemv_mma":         # twice the sums: the plan may change, or not fit
            p = gemv_batch.replan(ga, ip, nmat=2)
            if p is None or p.nb < ga.arg("nb"):      # not at the cost of a pass over the weights
                return None
            ga, ip = gemv_batch.planned(ga, ip, p)
        elif ga.fn == "op_gemv_qdirect":   # an item's rows: half of them from each matrix
            ga = gemv_quant.replan(ga, ip, nmat=2)
        else:                              # twice the row groups: an item may take more
            ga = ga.with_(sr=encoders.direct_sr(2, ip["N_TILE"], ip["K"] * aa[1].esize))
        e = Encoded(a.op, ga.with_(nmat=2, epi=2, to=ftype(None, co[0].dtype)), ip, dict(a.fp), a.group)
        gate, up = (aa, ba) if ca[0].ref == ao[0].ref else (ba, aa)
        # quantized: x, the weights, their scales, their zeros (op_gemv_mma's P order)
        return e, [aa[0]] + [v for i in range(1, len(aa)) for v in (gate[i], up[i])], [co[0]]
    return Fused(_fold_windows(f.steps, 3, fold), f.zero)


def fold_add(f: Fused) -> Fused:
    """A batch-1 GEMV tile (op_gemv, op_gemv_direct or op_gemv_qdirect) into a scratch that only
    the next step reads, an ADD of that tile and a residual at the same columns (o + h, down +
    h): the GEMV adds the residual (appended as its last input) itself and writes the ADD's
    output. Runs after pair_gemvs."""
    def fold(window, later):
        (g, ga, go), (a, aa, ao) = window
        y = go[0]
        plain = g.is_fn("op_gemv") and g.ip.get("M") == 1
        direct = ((_direct(g) or g.is_fn("op_gemv_mma"))
                  and g.variant.arg("nmat") == 1 and g.variant.arg("epi") == 0)
        if not ((plain or direct) and a.op == int(K.ADD)
                and len(aa) == 2 and a.ip["KIND"] == abi.EW_KINDS.index("ADD")
                and a.ip["ROWS"] == g.ip.get("M")
                and (a.ip["C0"], a.ip["C1"]) == (g.ip["N_OFF"], g.ip["N_OFF"] + g.ip["N_TILE"])
                and all(a.ip[k] == a.ip["COLS"] for k in ("A_RS", "B_RS")) and a.ip["A_CS"] == a.ip["B_CS"] == 1
                and ao[0].cols == y.cols == g.ip["N"] and y.ref[0] == REF_SCRATCH
                and all(v.dtype in FLOATS for v in aa + ao)
                and [v.ref for v in aa].count(y.ref) == 1 and not _read_later(y.ref, later)):
            return None
        res = aa[1] if aa[0].ref == y.ref else aa[0]
        tr, to = ctype(None, res.dtype), ftype(None, ao[0].dtype)
        var = g.variant.with_(epi=1, tr=tr, to=to) if direct else g.variant.with_(add=True, tr=tr, to=to)
        e = Encoded(g.op, var, dict(g.ip), dict(g.fp), g.group)
        return e, ga + [res], [ao[0]]
    return Fused(_fold_windows(f.steps, 2, fold), f.zero)


def sum_add(f: Fused) -> Fused:
    """A SUM of a split GEMV's partials (op_sum) into a scratch that only the next step reads,
    an ADD of that tile and a residual at the same columns (down + h at a batch): the SUM adds
    the residual (appended as its last input) and writes the ADD's output."""
    def fold(window, later):
        (s, sa, so), (a, aa, ao) = window
        y = so[0]
        if not (s.is_fn("op_sum") and not s.variant.arg("res") and a.op == int(K.ADD)
                and len(aa) == 2 and a.ip["KIND"] == abi.EW_KINDS.index("ADD")
                and all(a.ip[k] == s.ip[k] for k in ("ROWS", "COLS", "C0", "C1"))
                and all(a.ip[k] == a.ip["COLS"] for k in ("A_RS", "B_RS")) and a.ip["A_CS"] == a.ip["B_CS"] == 1
                and ao[0].cols == y.cols and y.ref[0] == REF_SCRATCH
                and all(v.dtype in FLOATS for v in aa + ao)
                and [v.ref for v in aa].count(y.ref) == 1 and not _read_later(y.ref, later)):
            return None
        res = aa[1] if aa[0].ref == y.ref else aa[0]
        var = s.variant.with_(res=True, tr=ctype(None, res.dtype), to=ftype(None, ao[0].dtype))
        return Encoded(s.op, var, dict(s.ip), dict(s.fp), s.group), sa + [res], [ao[0]]
    return Fused(_fold_windows(f.steps, 2, fold), f.zero)


def norm_into_gemv(f: Fused) -> Fused:
    """A one-row RMSNorm into the GEMVs' shared-memory x (TO_SMEM) and the op_gemv_direct (or
    op_gemv_qdirect) right after it: one such GEMV (NORM) that normalises x itself (rms_row, the
    same bits), so the task is one step, not a FUSED pair (the step boundary cost ~1 us a task on an H200:
    q/k/v and gate/up tasks, NOTES v12). Its args: the norm's input row in place of x, the
    norm's weight appended last (never with the ADD epilogue, whose residual is last); the
    GEMVs after it still read x from shared memory. Runs after fold_add."""
    nt = NTHREADS

    def fold(window, later):
        (n, na, no), (g, ga, go) = window
        if not (n.op == int(K.RMSNORM) and n.ip.get("TO_SMEM") and n.ip["ROWS"] == 1
                and n.ip["H"] <= RMS_RN * nt and _direct(g) and g.ip.get("XS_READY")
                and g.variant.arg("epi") != 1 and not g.variant.arg("norm") and ga[0].ref == no[0].ref
                and na[0].dtype in FLOATS and na[1].dtype in FLOATS):
            return None
        var = g.variant.with_(norm=True, nx=ftype(None, na[0].dtype), nw=ftype(None, na[1].dtype),
                              rn=-(-n.ip["H"] // nt))     # the row elements a thread holds, no more
        e = Encoded(g.op, var, dict(g.ip, XS_READY=0), dict(g.fp, EPS=n.fp["EPS"]), g.group)
        return e, [na[0]] + ga[1:] + [na[1]], go
    return Fused(_fold_windows(f.steps, 2, fold), f.zero)


def norm_into_mma(f: Fused) -> Fused:
    """An RMSNorm of the M rows of x (bf16) into a scratch only the op_gemv_mma right after it
    reads, as x: one op_gemv_mma (NORM) that stages x times the norm weight and scales each
    row's sums by its 1 / rms in the epilogue (mma_stage_xn: within bf16 rounding of the
    unfused norm, not its bits), when its plan has as many rows of x a pass.
    Args as norm_into_gemv's. Runs after fold_add (never meets the ADD epilogue)."""
    def fold(window, later):
        (n, na, no), (g, ga, go) = window
        if not (n.op == int(K.RMSNORM) and not n.ip.get("TO_SMEM") and g.is_fn("op_gemv_mma")
                and n.ip["ROWS"] == g.ip["M"] and n.ip["H"] == g.ip["K"]
                and g.variant.arg("epi") != 1 and not g.variant.arg("norm") and ga[0].ref == no[0].ref
                and no[0].ref[0] == REF_SCRATCH and no[0].dtype == DType.BF16
                and na[0].dtype == DType.BF16 and na[1].dtype in FLOATS
                and all(v.ref != no[0].ref for v in ga[1:]) and not _read_later(no[0].ref, later)):
            return None
        p = gemv_batch.replan(g.variant, g.ip, norm=True)
        if p is None or p.nb < g.variant.arg("nb"):   # not at the cost of a pass over the weights
            return None
        var, ip = gemv_batch.planned(g.variant, g.ip, p)
        e = Encoded(g.op, var.with_(norm=True, nw=ftype(None, na[1].dtype)), ip,
                    dict(g.fp, EPS=n.fp["EPS"]), g.group)
        return e, [na[0]] + ga[1:] + [na[1]], go
    return Fused(_fold_windows(f.steps, 2, fold), f.zero)


def unpad_shared_x(f: Fused) -> Fused:
    """op_gemv_qdirect stages its x padded (xpad: int4, gemv_quant.gemv_qdirect) only where x is
    its own: one reading x another step staged (XS_READY), or staging it for the GEMVs after it
    (they read it as staged), keeps the plain layout. Last of FOLDS: XS_READY is final then."""
    steps = list(f.steps)
    for i, (e, a, o) in enumerate(steps):
        shared = e.ip.get("XS_READY") or (i + 1 < len(steps) and steps[i + 1][0].ip.get("XS_READY"))
        if e.is_fn("op_gemv_qdirect") and e.variant.arg("xpad") and shared:
            steps[i] = (replace(e, variant=e.variant.with_(xpad=False)), a, o)
    return Fused(steps, f.zero)


def _mma(e: Encoded) -> Variant | None:
    return e.variant if e.is_fn("op_gemv_mma") else None


def _with_inv(v: Variant, inv) -> Variant:
    """The variant with its inverse-frequency type (TF) that of inv's buffer, if it gains one."""
    return v.with_(tf=ftype(None, inv[0].dtype)) if inv else v


def _with_ip(e: Encoded, **ip) -> Encoded:
    return replace(e, ip=dict(e.ip, **ip))


def _direct(e: Encoded) -> Variant | None:
    """The variant of a batch-1 direct GEMV (float weights, or quantized: op_gemv_qdirect)."""
    return e.variant if e.is_fn("op_gemv_direct") or e.is_fn("op_gemv_qdirect") else None


# In this order: the scratch analyses (norm_into_smem) look at single-output steps as the
# recipe wrote them; the rope folds before the GEMV folds; norm_into_gemv after fold_add;
# unpad_shared_x once XS_READY is final.
FOLDS: list[tuple[str, Callable[[Fused], Fused]]] = [
    ("norm_into_smem", norm_into_smem),
    ("k_rope_into_attention", k_rope_into_attention),
    ("rope_into_attention", rope_into_attention),
    ("rope_into_append", rope_into_append),
    ("norm_into_attention", norm_into_attention),
    ("pair_gemvs", pair_gemvs),
    ("fold_add", fold_add),
    ("sum_add", sum_add),
    ("norm_into_gemv", norm_into_gemv),
    ("norm_into_mma", norm_into_mma),
    ("unpad_shared_x", unpad_shared_x),
]


def fold_steps(f: Fused) -> Fused:
    """Every fold of FOLDS, in order."""
    for _, fold in FOLDS:
        f = fold(f)
    return f
