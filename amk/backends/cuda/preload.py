"""The preload fold: the first weight rows of a batch-1 GEMV tile (q/k/v, o, gate/up, down,
the LM head: a task whose first step, or the step after its split-KV combine, is an
op_gemv_direct of read-only float weights) are copied into shared memory by the task before it
in the queue. The quantized op_gemv_qdirect reads none: its preload lost (NOTES v35).

The copy starts from the staged attention right after it has issued its own loads
(op_attention_smem), else when that task ends (after its release). The hand-off to the next
stage (the release, the poll, x and its norm) leaves the HBM and the SM's ingress idle, so the
rows land while the task waits rather than after its x is staged (a copy issued at the task's
own start delays its loads behind it: NOTES v11). Before v35 only the o tiles preloaded.
"""
from __future__ import annotations

from dataclasses import replace

from amk.identity_memo import IdentityMemo
from amk.program.ir import BufferKind, InstructionKind as K
from amk.backends.cuda.steps import FoldedTask


def preload(ft: FoldedTask, cap: int, memo: IdentityMemo | None = None) -> FoldedTask:
    """The first PRE rows of each matrix of the task's op_gemv_direct step (as many as `cap`
    bytes hold; whole row pairs for one matrix), which then reads them from shared memory (ip
    PRE), when that step is the task's first or follows its combine (the steps before it stay
    below AMK_PRE_OFF) and its weights are read-only: ft.preload holds their ranges (ref, byte
    offset, bytes). Nothing to preload: ft unchanged. memo: one PRE step's Encoded per encoded
    step and row count, shared by the tasks of a kind (the tables memoise by its ip dict)."""
    steps = ft.steps
    if not cap or not steps:
        return ft
    i = 1 if steps[0][0].op == int(K.ATTENTION_COMBINE) else 0
    if i >= len(steps) or not steps[i][0].is_fn("op_gemv_direct"):
        return ft
    enc, args, outs = steps[i]
    ws = args[1:1 + enc.variant.arg("nmat")]
    if any(w.kind not in (BufferKind.WEIGHT, BufferKind.CONST) for w in ws):
        return ft
    rb, n_tile = enc.ip["LDW"] * ws[0].esize, enc.ip["N_TILE"]
    pr = min(n_tile, cap // (len(ws) * rb))
    if len(ws) == 1 and pr < n_tile:
        pr -= pr % 2
    if pr <= 0:
        return ft
    with_pre = (lambda: replace(enc, ip=dict(enc.ip, PRE=pr)))
    pre_step = (with_pre() if memo is None else memo.get(enc, pr, with_pre), args, outs)
    return replace(ft, steps=steps[:i] + [pre_step] + steps[i + 1:],
                   preload=[(w.ref, enc.ip["N_OFF"] * rb, pr * rb) for w in ws], preload_step=i)


def drop_unissued_preloads(tasks: list[FoldedTask], queues: list[list[int]]) -> None:
    """A task first in its queue has nobody to copy its rows: no preload (its PRE = 0)."""
    for q in queues:
        if q and tasks[q[0]].preload:
            ft = tasks[q[0]]
            enc, args, outs = ft.steps[ft.preload_step]
            ft.steps[ft.preload_step] = (replace(enc, ip=dict(enc.ip, PRE=0)), args, outs)
            ft.preload = []
