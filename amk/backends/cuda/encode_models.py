"""CUDA encoders for the ops issue 25 added, as one self-contained block (the lead ports it
into the encoders module): SOFTCAP, GELU with tanh=1, and COPY with x_off (slice / concat).
All run templates/ops_models.cuh's op_ewx; the sliding window and soft-cap of attention are
two more ATTN slots (WINDOW, SOFTCAP) that lower._enc_attention fills."""
from __future__ import annotations

from amk.backends.cuda import abi
from amk.program.ir import InstructionKind as K


def is_ewx(op: K, p) -> bool:
    """Whether op_ewx runs this op (not op_ew)."""
    return op == K.SOFTCAP or (op == K.GELU and int(p.get("tanh", 0)) == 1) or \
        (op == K.COPY and "x_off" in p)


def enc_ewx(t, op, ins, outs, p, *, Encoded, fail, ctype, col_range, bcast):
    """Encoded for op_ewx; the lower module passes its helpers (Encoded, _fail, _ct,
    _col_range, _bcast) so this block depends on nothing private."""
    out, a = outs[0], ins[0]
    c0, c1 = col_range(t, p, out)
    if op == K.COPY:
        kind, x_off = "COPY_COLS", int(p["x_off"])
        rows = out.numel // max(out.cols, 1)
        if x_off + (c1 - c0) > a.cols or a.numel // max(a.cols, 1) != rows:
            fail(t, f"COPY x_off={x_off}: input {a.shape} columns [{x_off}, {x_off + c1 - c0}) "
                    f"do not fit output {out.shape}")
        a_rs, shift = a.cols, x_off - c0
    else:
        kind = "SOFTCAP" if op == K.SOFTCAP else "GELU_TANH"
        a_rs, a_cs = bcast(t, a, out)
        if a_cs != 1:
            fail(t, f"{op.name}: input {a.shape} must have the output's columns {out.shape}")
        shift = 0
    e = Encoded(int(op), f"op_ewx<EWX_{kind}, {ctype(t, out.dtype)}, {ctype(t, a.dtype)}>(AMK_ARGS)",
                group="EWX")
    e.ip = dict(ROWS=out.numel // out.cols, COLS=out.cols, C0=c0, C1=c1, A_RS=a_rs, A_SHIFT=shift,
                XKIND=abi.EWX_KINDS.index(kind))
    e.fp = dict(CAP=float(p.get("cap", 1.0)))
    return e
