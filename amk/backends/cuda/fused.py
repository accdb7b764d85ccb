"""FUSED tasks: the typed recipe (amk/program/recipe.py) checked, and its steps lowered to
encoded steps over a per-task scratch region of the arena (folds.FOLDS then merge them)."""
from __future__ import annotations

import math

from amk.program.ir import DType, InstructionKind as K
from amk.program.recipe import INPUT, OUTPUT, Recipe, RecipeError, checked_recipe
from amk.backends.cuda.encoders import encode_op
from amk.backends.cuda.steps import REF_SCRATCH, SCRATCH_ALIGN, Encoded, Fused, View, fail

# scratch dtypes the templates take (the recipe's dtype table is wider)
SCRATCH_DTYPES = (DType.F32, DType.F16, DType.BF16, DType.I32, DType.I8, DType.U8)


_FULL_WRITE = {K.RMSNORM, K.LAYERNORM, K.EMBED, K.SOFTMAX, K.ALLREDUCE_SHARD, K.DEQUANT,
               K.SAMPLE_ARGMAX}


def _writes_whole(op: K, p, out: View) -> bool:
    if op in _FULL_WRITE:
        return True
    if op in (K.COPY, K.ADD, K.MUL, K.SILU_MUL, K.GELU, K.ROPE):
        return "n_off" not in p and "N_tile" not in p
    return False


def _check_recipe(task, n_in: int, n_out: int) -> Recipe:
    try:
        return checked_recipe(task.params.get("recipe"), n_in, n_out)
    except RecipeError as e:
        fail(task, str(e))


def lower_fused(task, ins: list[View], outs: list[View], scratch_base: int):
    """The recipe's steps encoded over scratch views from scratch_base on, and the scratch that
    needs zeroing (a step that writes part of it and is not read only inside that part).
    -> (Fused, scratch bytes used)."""
    recipe = _check_recipe(task, len(ins), len(outs))
    slots: dict[int, View] = {}
    off = scratch_base
    steps, zero = [], []
    for i, st in enumerate(recipe.steps):
        op = st.op
        args = [ins[a.index] if a.kind == INPUT else slots[a.index] for a in st.args]
        sp = st.params
        if st.out.kind == OUTPUT:
            target = outs[st.out.index]
        else:
            out = st.out.index
            if st.out_dtype is not None and st.out_dtype not in SCRATCH_DTYPES:
                fail(task, f"step {i}: scratch dtype {st.out_dtype.short!r} is not supported on CUDA")
            dt = st.out_dtype or args[0].dtype
            shape = tuple(st.out_shape) if st.out_shape is not None else args[0].shape
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
    zero = [(o, n) for o, n in zero if not tile_reads_only(steps, (REF_SCRATCH, o))]
    return Fused(steps, zero), off - scratch_base


_EW_OPS = {int(K.COPY), int(K.ADD), int(K.MUL), int(K.SILU_MUL), int(K.GELU)}


def _written_cols(enc: Encoded) -> tuple[int, int] | None:
    """Columns [lo, hi) a column-tile step writes in every row of its output, else None."""
    if enc.op in (int(K.GEMV_TILE), int(K.GEMM_TILE)):
        return enc.ip["N_OFF"], enc.ip["N_OFF"] + enc.ip["N_TILE"]
    if enc.op in _EW_OPS or enc.op in (int(K.ROPE), int(K.SUM)):
        return enc.ip["C0"], enc.ip["C1"]
    return None


def _read_cols(enc: Encoded, args: list[View], out: View, ref) -> tuple[int, int] | None:
    """Columns [lo, hi) a step reads of scratch `ref` (one of its args), else None (unknown)."""
    idx = [i for i, a in enumerate(args) if a.ref == ref]
    v = args[idx[0]]
    if enc.op in _EW_OPS and v.numel == out.numel and v.cols == out.cols:
        return enc.ip["C0"], enc.ip["C1"]        # read at the output's own (row, column)
    if enc.op == int(K.ATTENTION_TILE) and idx == [0] and v.cols == enc.ip["NH"] * enc.ip["HD"]:
        hd = enc.ip["HD"]                         # q of the tile's heads only (rows of heads)
        return enc.ip["H_OFF"] * hd, (enc.ip["H_OFF"] + enc.ip["H_COUNT"]) * hd
    return None


def tile_reads_only(steps, ref) -> bool:
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
