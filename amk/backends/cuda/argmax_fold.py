"""The argmax fold: an argmax of one row whose every column one GEMV tile writes (the LM head)
becomes a (value, index) partial in each tile's epilogue and a reduction of the partials, so
no single SM reads the whole row of logits again."""
from __future__ import annotations

from amk.program.ir import DType, InstructionKind as K, Program, Task
from amk.program.recipe import OUTPUT, Operand, recipe_of
from amk.backends.cuda.steps import (REF_BUFFER, REF_SCRATCH, SCRATCH_ALIGN, Encoded, Variant, View,
                                     int_input)


def _argmax_folds(program: Program) -> tuple[dict[int, tuple[int, list[int]]], int]:
    """Argmaxes of one row whose every column is written by one GEMV tile (plain, or the final
    step of a FUSED task: the LM head): ({argmax task: (scratch offset of its partials, the tile
    tasks by column)}, scratch bytes of all partials). Each tile reduces the logits it writes
    to a (value, index) partial in its epilogue (op_gemv_direct / op_gemv_qdirect EPI 3) and
    the argmax task reduces the partials (op_argmax_parts): no single SM reads the whole row again (22 us for
    128K bf16 logits, NOTES v10). Same order (am_better) at both levels: op_argmax's token.
    A batch's rows (op_gemv_mma tiles): a partial per row and tile, [row][tile]; the value is
    (scratch offset, tiles, rows)."""
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
        rows = logits.numel // V
        tiles = sorted((_gemv_cols(w), w.id) for w in writers.get(logits.id, []))
        if logits.numel != rows * V or not tiles or None in (c for c, _ in tiles):
            continue
        ends = [0] + [lo + n for (lo, n), _ in tiles]
        if [lo for (lo, _), _ in tiles] != ends[:-1] or ends[-1] != V:
            continue
        folds[t.id] = (off, [tid for _, tid in tiles], rows)
        off += -(-8 * rows * len(tiles) // SCRATCH_ALIGN) * SCRATCH_ALIGN
    return folds, off


def _gemv_cols(t: Task) -> tuple[int, int] | None:
    """(n_off, N_tile) of a task that is one GEMV / GEMM tile or ends in one writing its output."""
    p = t.params
    if t.op == K.FUSED:
        steps = recipe_of(t).steps
        if steps[-1].op not in (K.GEMV_TILE, K.GEMM_TILE) or steps[-1].out != Operand(OUTPUT, 0):
            return None
        p = steps[-1].params
    elif t.op not in (K.GEMV_TILE, K.GEMM_TILE):
        return None
    return (int(p["n_off"]), int(p["N_tile"])) if "n_off" in p and "N_tile" in p else None


class ArgmaxFolds:
    """The argmax fold, task by task (lower.fold_program): tiles patched so far, and the
    steps each task runs."""

    def __init__(self, program: Program):
        self.folds, self.scratch_bytes = _argmax_folds(program)
        self.slots = {tid: (slot, off, len(tiles), rows, program.tasks[am].inputs[0])
                      for am, (off, tiles, rows) in self.folds.items() for slot, tid in enumerate(tiles)}
        self.patched: set[int] = set()

    def touches(self, t: Task) -> bool:
        """Whether steps() may change t's steps (a logits tile, an argmax)."""
        return t.id in self.slots or t.id in self.folds

    def steps(self, t: Task, steps, outs: list[View]):
        """A logits tile: its GEMV step with EPI 3 (when it is a plain batch-1 direct GEMV). The
        argmax, once every tile writes a partial: op_argmax_parts over them (else op_argmax)."""
        if t.id in self.slots:
            slot, off, n, rows, logits = self.slots[t.id]
            parts = View((2 * n * rows,), DType.F32, (REF_SCRATCH, off), None)
            for i, (e, a, o) in enumerate(steps):
                batch1 = e.is_fn("op_gemv_direct") or e.is_fn("op_gemv_qdirect")
                fn_ok = (batch1 and rows == 1) or e.is_fn("op_gemv_mma")
                if (fn_ok and e.variant.arg("nmat") == 1
                        and e.variant.arg("epi") == 0 and len(o) == 1
                        and o[0].ref == (REF_BUFFER, logits)):
                    pe = Encoded(e.op, e.variant.with_(epi=3), dict(e.ip, ARG_SLOT=slot, ARG_SLOTS=n),
                                 dict(e.fp), e.group)
                    self.patched.add(t.id)
                    return steps[:i] + [(pe, a, o + [parts])] + steps[i + 1:]
        if t.id in self.folds and all(w in self.patched for w in self.folds[t.id][1]):
            off, tiles, rows = self.folds[t.id]
            parts = View((2 * len(tiles) * rows,), DType.F32, (REF_SCRATCH, off), None)
            e = Encoded(int(t.op), Variant.of("op_argmax_parts"), group="ARGMAX")
            e.ip = dict(ROWS=rows, V=len(tiles), OUT64=int_input(t, outs[0], "argmax output"))
            return [(e, [parts], outs)]
        return steps
