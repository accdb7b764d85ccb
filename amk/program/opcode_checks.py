"""Per-opcode checks for `validate`: arity, params, shapes and dtypes of one task.

Each check gets a `_Ctx` over the task's operands and raises `_Bad` or records messages;
`check_opcode(task, buffers)` returns every message for one task (docs/PROGRAM.md is the table
these checks enforce).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from amk.identity_memo import IdentityMemo
from amk.program.ir import Buffer, BufferKind, DType, InstructionKind as K, Task
from amk.program.recipe import parse_recipe, recipe_errors
from amk.program.regions import NEW_KV, PARTIAL_WRITE, combine_partials

READ_ONLY = (BufferKind.WEIGHT, BufferKind.CONST, BufferKind.IO_INPUT)
FLOATS = (DType.F32, DType.F16, DType.BF16, DType.F8E4M3, DType.F8E5M2)
INTS = (DType.I32, DType.I64)


def _t(task: Task) -> str:
    return f"t{task.id} {task.op.name}" + (f" ({task.name})" if task.name else "")


def _b(buf: Buffer) -> str:
    return f"b{buf.id} '{buf.name}'"


class _Bad(Exception):
    pass


class _Ctx:
    """One task's operands and params, with helpers that record what is wrong."""

    def __init__(self, task: Task, buffers: Sequence[Buffer]):
        self.task, self.p = task, task.params
        self.ins = [buffers[i] for i in task.inputs]
        self.outs = [buffers[o] for o in task.outputs]
        self.msgs: list[str] = []

    def bad(self, msg: str) -> None:
        self.msgs.append(msg)

    def int_(self, name: str, default: Any = None, lo: int | None = None) -> int:
        v = self.p.get(name, default)
        if v is None:
            self.bad(f"needs int param '{name}'")
            raise _Bad
        if isinstance(v, bool) or not isinstance(v, int):
            self.bad(f"param '{name}' must be an int, got {v!r}")
            raise _Bad
        if lo is not None and v < lo:
            self.bad(f"param '{name}'={v} must be >= {lo}")
            raise _Bad
        return v

    def dtype(self, buf: Buffer, allowed: Sequence[DType], role: str) -> None:
        if buf.dtype not in allowed:
            names = "/".join(d.short for d in allowed)
            self.bad(f"{role} {_b(buf)} has dtype {buf.dtype.short}, needs {names}")

    def numel(self, buf: Buffer, n: int, role: str) -> None:
        if buf.numel != n:
            self.bad(f"{role} {_b(buf)} has {buf.numel} elements {list(buf.shape)}, needs {n}")

    def tile(self, width: int | None = None) -> None:
        """n_off/N_tile (if given) lie inside the output's columns."""
        if "n_off" not in self.p and "N_tile" not in self.p:
            return
        cols = self.outs[0].cols if width is None else width
        n_off = self.int_("n_off", 0, lo=0)
        n_tile = self.int_("N_tile", cols - n_off, lo=1)
        if n_off + n_tile > cols:
            self.bad(f"tile n_off={n_off} + N_tile={n_tile} exceeds {cols} output columns")


def _same_numel(c: _Ctx, *idx: int) -> None:
    for i in idx:
        c.numel(c.ins[i], c.outs[0].numel, f"input {i}")


def _gemv(c: _Ctx) -> None:
    K_ = c.int_("K", lo=1)
    qdtype = c.int_("qdtype", 0)
    x, w, out = c.ins[0], c.ins[1], c.outs[0]
    if len(w.shape) != 2:
        c.bad(f"weight {_b(w)} must be 2-d [N, K], got {list(w.shape)}")
        raise _Bad
    N = w.shape[0]
    if qdtype in (DType.I8, DType.I4, DType.F8E4M3):
        if len(c.ins) < 3:
            c.bad(f"quantized (qdtype={qdtype}) needs inputs x, qW, scales[, zeros]")
            raise _Bad
        group = c.int_("group", lo=1)
        packed = (K_ + 1) // 2 if qdtype == DType.I4 else K_
        c.dtype(w, {DType.I4: (DType.U8,), DType.I8: (DType.I8,),
                    DType.F8E4M3: (DType.F8E4M3,)}[DType(qdtype)], "quantized weight")
        if w.shape[1] != packed:
            c.bad(f"quantized weight {_b(w)} has {w.shape[1]} columns, needs {packed} for K={K_}")
        n_groups = -(-K_ // group)
        biased = bool(c.p.get("bias"))                # ext: the last input is a bias [N]
        n_q = len(c.ins) - biased                     # x, qW, scales[, zeros]
        if biased:
            c.numel(c.ins[-1], N, "bias")
            c.dtype(c.ins[-1], FLOATS, "bias")
        if n_q > 4:
            c.bad(f"quantized GEMV takes x, qW, scales[, zeros][, bias (params bias=1)]; got {len(c.ins)} inputs")
        if qdtype == DType.F8E4M3 and n_q > 3:
            c.bad("an F8E4M3 weight is symmetric: it takes no zeros")
        for i, role in ((2, "scales"), (3, "zeros")):
            if i < n_q:
                c.dtype(c.ins[i], FLOATS, role)
                if tuple(c.ins[i].shape) != (N, n_groups):
                    c.bad(f"{role} {_b(c.ins[i])} is {list(c.ins[i].shape)}, needs [{N}, {n_groups}]")
    elif qdtype == 0:
        if len(c.ins) > 3:
            c.bad("unquantized GEMV takes x, W[, bias]")
        c.dtype(w, FLOATS, "weight")
        if w.shape[1] != K_:
            c.bad(f"weight {_b(w)} is {list(w.shape)}, needs [N, K={K_}]")
        if len(c.ins) == 3:
            c.numel(c.ins[2], N, "bias")
    else:
        c.bad(f"qdtype={qdtype} is not 0, {int(DType.I8)} (I8), {int(DType.I4)} (I4) or "
              f"{int(DType.F8E4M3)} (F8E4M3)")
    c.dtype(x, FLOATS, "x")
    c.dtype(out, FLOATS, "output")
    if "k_off" in c.p or "K_tile" in c.p:         # one K slice of a split GEMV (ext)
        k_off = c.int_("k_off", 0, lo=0)
        k_tile = c.int_("K_tile", K_ - k_off, lo=1)
        if k_off + k_tile > K_:
            c.bad(f"K slice k_off={k_off} + K_tile={k_tile} exceeds K={K_}")
        if c.p.get("bias") or (qdtype == 0 and len(c.ins) == 3):
            c.bad("a K slice takes no bias (its partial sums are added by a SUM)")
    if x.cols != K_:
        c.bad(f"x {_b(x)} has {x.cols} columns, K={K_}")
    if out.cols != N:
        c.bad(f"output {_b(out)} has {out.cols} columns, weight has N={N} rows")
    elif x.cols == K_ and x.numel // K_ != out.numel // N:
        c.bad(f"x has {x.numel // K_} rows, output has {out.numel // N}")
    c.int_("n_off", lo=0)
    c.int_("N_tile", lo=1)
    c.tile(N)


def _heads(c: _Ctx, row: int, buf: Buffer, role: str, n_heads: int) -> int:
    """The batch size B of a buffer holding B x n_heads rows of `row` elements."""
    if buf.numel % (n_heads * row):
        c.bad(f"{role} {_b(buf)} has {buf.numel} elements, not a multiple of "
              f"n_heads*{row}={n_heads * row}")
        raise _Bad
    return buf.numel // (n_heads * row)


def _head_range(c: _Ctx, n_heads: int, group: int, flat: Sequence[tuple[Buffer, int]]) -> None:
    if "h_off" not in c.p and "h_count" not in c.p:
        return
    h_off = c.int_("h_off", lo=0)
    h_count = c.int_("h_count", lo=1)
    if h_off + h_count > n_heads:
        c.bad(f"heads [{h_off}, {h_off + h_count}) exceed n_heads={n_heads}")
    if h_off % group or h_count % group:
        c.bad(f"heads [{h_off}, {h_off + h_count}) split a kv group of {group} q heads")
    for buf, row in flat:    # a head range is a column range only on a flat view
        seq_major = buf.cols == buf.numel and buf.cols % (n_heads * row) == 0   # regions.py
        if buf.cols != n_heads * row and not seq_major:
            c.bad(f"h_off/h_count need {_b(buf)} flat with {n_heads}*{row} columns (or one row "
                  f"of sequences' heads), got shape {list(buf.shape)}")


def _seq_range(c: _Ctx, B: int) -> None:
    """b_off/b_count (ext): sequences [b_off, b_off+b_count) of the B query rows, both given."""
    if "b_off" not in c.p and "b_count" not in c.p:
        return
    if "b_off" not in c.p or "b_count" not in c.p:
        c.bad("b_off and b_count go together (the sequences [b_off, b_off+b_count))")
        return
    b_off = c.int_("b_off", lo=0)
    b_count = c.int_("b_count", lo=1)
    if b_off + b_count > B:
        c.bad(f"sequences [{b_off}, {b_off + b_count}) exceed the {B} query rows")


def _attention(c: _Ctx) -> None:
    hd = c.int_("head_dim", lo=1)
    n_heads = c.int_("n_heads", lo=1)
    n_kv = c.int_("n_kv_heads", lo=1)
    c.int_("kv_start", 0, lo=0)
    c.int_("kv_len", 0, lo=0)
    shards = c.int_("kv_shards", 1, lo=1)
    shard = c.int_("kv_shard", 0, lo=0)
    flags = c.int_("flags", 0, lo=0)
    if c.int_("kv_shard_rows", 0, lo=0) and len(c.ins) < 4:
        c.bad("kv_shard_rows (the live shard count) needs the runtime pos input")
    if shard >= shards:
        c.bad(f"kv_shard={shard} is not below kv_shards={shards}")
    if shards > 1 and not flags & PARTIAL_WRITE:
        c.bad(f"kv_shards={shards} needs PARTIAL_WRITE ({PARTIAL_WRITE}) in flags: a shard's "
              "result is a flash partial")
    if n_heads % n_kv:
        c.bad(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv}")
        raise _Bad
    q, kc, vc, out = c.ins[0], c.ins[1], c.ins[2], c.outs[0]
    B = _heads(c, hd, q, "q", n_heads)
    for buf, role in ((kc, "k_cache"), (vc, "v_cache")):
        if len(buf.shape) not in (3, 4) or tuple(buf.shape[-2:]) != (n_kv, hd):
            c.bad(f"{role} {_b(buf)} is {list(buf.shape)}, needs [(B,) max_seq, {n_kv}, {hd}]")
    if kc.shape != vc.shape:
        c.bad(f"k_cache {list(kc.shape)} and v_cache {list(vc.shape)} differ")
    if len(c.ins) > 3:
        c.dtype(c.ins[3], INTS, "pos")
        if c.ins[3].numel > 1:          # ext: row r at pos[r]: a block of one sequence, or
            c.numel(c.ins[3], B, "pos (one position per row)")   # B sequences, each its own
            if len(kc.shape) != 3 and not (len(kc.shape) == 4 and kc.shape[0] == B):
                c.bad(f"a position per row needs a single-sequence cache [max_seq, {n_kv}, "
                      f"{hd}] or a cache per row [{B}, max_seq, {n_kv}, {hd}], got {list(kc.shape)}")
            if flags & NEW_KV and len(kc.shape) != 4:
                c.bad("flags NEW_KV (one new row per sequence) does not apply to a block")
    if flags & NEW_KV:
        if len(c.ins) != 6:
            c.bad(f"flags has NEW_KV ({NEW_KV}): inputs are q, k_cache, v_cache, pos, k_new, v_new; "
                  f"got {len(c.ins)}")
        for buf, role in zip(c.ins[4:6], ("k_new", "v_new")):
            c.dtype(buf, FLOATS, role)
            c.numel(buf, B * n_kv * hd, f"{role} (one row of {n_kv}*{hd} a sequence)")
    elif len(c.ins) > 4:
        c.bad(f"inputs past pos (k_new, v_new) need flags bit NEW_KV ({NEW_KV})")
    row = hd + 2 if flags & PARTIAL_WRITE else hd
    c.numel(out, B * n_heads * row, "output" + (" (partial [acc|m|l])" if row != hd else ""))
    _head_range(c, n_heads, n_heads // n_kv, ((q, hd), (out, row)))
    _seq_range(c, B)
    if "window" in c.p:
        c.int_("window", lo=1)
    cap = c.p.get("softcap", 0.0)
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap < 0:
        c.bad(f"param 'softcap' must be a float >= 0 (0 = none), got {cap!r}")


def _combine(c: _Ctx) -> None:
    hd = c.int_("head_dim", lo=1)
    parts = c.ins[:combine_partials(c.p, len(c.ins))]
    if not parts:
        c.bad("a combine needs at least one partial")
        raise _Bad
    first = parts[0]
    n_heads = c.int_("n_heads", first.numel // (hd + 2) or 1, lo=1)
    B = _heads(c, hd + 2, first, "partial 0", n_heads)
    for i, p in enumerate(parts[1:], 1):
        c.numel(p, first.numel, f"partial {i}")
    if len(parts) < len(c.ins):           # ext: the live count: kv_shard_rows, pos last
        c.int_("kv_start", 0, lo=0)
        c.int_("kv_len", lo=0)
        c.int_("window", 0, lo=0)
        pos = c.ins[-1]
        c.dtype(pos, INTS, "pos")
        if pos.numel not in (1, B):
            c.bad(f"pos {_b(pos)} has {pos.numel} elements: one, or one per row ({B})")
    c.numel(c.outs[0], B * n_heads * hd, "output")
    _head_range(c, n_heads, 1, [(p, hd + 2) for p in parts] + [(c.outs[0], hd)])


def _rope(c: _Ctx) -> None:
    hd = c.int_("head_dim", lo=2)
    if hd % 2:
        c.bad(f"head_dim={hd} must be even")
    x = c.ins[0]
    if x.numel % hd:
        c.bad(f"x {_b(x)} has {x.numel} elements, not a multiple of head_dim={hd}")
    _same_numel(c, 0)
    c.dtype(c.ins[1], INTS, "pos")
    if len(c.ins) > 2:
        c.numel(c.ins[2], hd // 2, "inv_freq")
    c.tile()
    if ("n_off" in c.p or "N_tile" in c.p) and (c.p.get("n_off", 0) % hd or
                                                  c.p.get("N_tile", hd) % hd):
        c.bad(f"a rope tile must cover whole heads (multiples of head_dim={hd})")


def _column_move(c: _Ctx) -> None:
    """COPY with x_off (ext, slice / concat): out[..., n_off:+N_tile] = x[..., x_off:+N_tile]."""
    x, out = c.ins[0], c.outs[0]
    x_off = c.int_("x_off", lo=0)
    n_off = c.int_("n_off", 0, lo=0)
    n_tile = c.int_("N_tile", out.cols - n_off, lo=1)
    if n_off + n_tile > out.cols:
        c.bad(f"tile n_off={n_off} + N_tile={n_tile} exceeds {out.cols} output columns")
    if x_off + n_tile > x.cols:
        c.bad(f"x_off={x_off} + N_tile={n_tile} exceeds input {_b(x)}'s {x.cols} columns")
    if x.numel // max(x.cols, 1) != out.numel // max(out.cols, 1):
        c.bad(f"input {_b(x)} {list(x.shape)} and output {_b(out)} {list(out.shape)} differ in rows")


def _elementwise(c: _Ctx) -> None:
    if c.task.op is K.COPY and "x_off" in c.p:
        return _column_move(c)
    if c.task.op is K.SOFTCAP:
        cap = c.p.get("cap")
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
            c.bad(f"needs a positive float param 'cap', got {cap!r}")
    binary = c.task.op in (K.MUL, K.ADD) and len(c.ins) == 2    # b may broadcast
    _same_numel(c, *((0,) if binary or c.task.op is K.MUL else range(len(c.ins))))
    if binary:
        b, out = c.ins[1], c.outs[0]
        if b.numel not in (1, out.numel, out.cols):
            c.bad(f"input 1 {_b(b)} has {b.numel} elements: needs 1, {out.cols} or {out.numel}")
    if c.task.op is K.MUL and len(c.ins) == 1 and "scale" not in c.p:
        c.bad("MUL with one input needs param 'scale'")
    c.tile()


def _sum(c: _Ctx) -> None:
    _same_numel(c, *range(len(c.ins)))
    c.tile()


def _norm(c: _Ctx) -> None:
    x, w = c.ins[0], c.ins[1]
    H = w.numel
    if H == 0 or x.numel % H:
        c.bad(f"x {_b(x)} ({x.numel} elements) is not rows of H={H} (the weight's size)")
    if len(c.ins) > 2:
        c.numel(c.ins[2], H, "bias")
    _same_numel(c, 0)
    eps = c.p.get("eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        c.bad(f"eps must be a positive number, got {eps!r}")


def _embed(c: _Ctx) -> None:
    ids, table, out = c.ins[0], c.ins[1], c.outs[0]
    c.dtype(ids, INTS, "ids")
    if len(table.shape) != 2:
        c.bad(f"table {_b(table)} must be [V, H], got {list(table.shape)}")
        raise _Bad
    c.numel(out, ids.numel * table.shape[1], "output")


def _kv_append(c: _Ctx) -> None:
    new, pos, cache = c.ins[0], c.ins[1], c.outs[0]
    c.dtype(pos, INTS, "pos")
    rows = pos.numel if "pos" not in c.p else 1    # ext: row t at pos[t] (a block, or a batch)
    per_seq = len(cache.shape) == 4 and cache.shape[0] == rows     # sequence t in cache t
    if rows > 1 and len(cache.shape) != 3 and not per_seq:
        c.bad(f"{rows} positions need a single-sequence cache [max_seq, n_kv, head_dim] or a "
              f"cache per position [{rows}, max_seq, n_kv, head_dim], got {list(cache.shape)}")
    if cache.kind in READ_ONLY:
        c.bad(f"output {_b(cache)} is a read-only {cache.kind.name} buffer; KV_APPEND writes a cache "
              f"in place (a KV_CACHE, or the copy a non-donated cache gets)")
    if len(cache.shape) not in (3, 4):
        c.bad(f"cache {_b(cache)} must be [(B,) max_seq, n_kv, head_dim], got {list(cache.shape)}")
        raise _Bad
    c.numel(new, (1 if per_seq else rows) * cache.numel // cache.shape[-3], "new")


def _argmax(c: _Ctx) -> None:
    c.dtype(c.outs[0], INTS, "output")
    c.numel(c.outs[0], c.ins[0].numel // c.ins[0].cols, "output")


def _allreduce(c: _Ctx) -> None:
    if "world" not in c.p and "rank" not in c.p and "reduce" not in c.p:
        _all_same(c)                       # the seed's single-device sum of shards
        return
    # a cross-rank collective (amk/program/collectives.py): one input, this rank's part
    world = c.int_("world", lo=1)
    rank = c.int_("rank", lo=0)
    if rank >= world:
        c.bad(f"param 'rank'={rank} must be < world={world}")
    if len(c.ins) != 1:
        c.bad(f"a cross-rank all-reduce takes one input (this rank's part), got {len(c.ins)}")
        raise _Bad
    reduce = c.p.get("reduce", "sum")
    if reduce == "maxloc":
        _argmax(c)
    elif reduce == "sum":
        _same_numel(c, 0)
    else:
        c.bad(f"param 'reduce'={reduce!r} must be 'sum' or 'maxloc'")


def _dequant(c: _Ctx) -> None:
    c.int_("group", lo=1)
    c.int_("K", c.outs[0].cols, lo=1)
    c.dtype(c.ins[1], FLOATS, "scales")
    c.dtype(c.outs[0], FLOATS, "output")


def _fused(c: _Ctx) -> None:
    msgs = recipe_errors(c.p.get("recipe"), len(c.ins), len(c.outs))
    for msg in msgs:
        c.bad(f"malformed recipe: {msg}")
    # a cross-rank collective must stay its own task: peers match collective tasks by order
    if not msgs and any(st.op == K.ALLREDUCE_SHARD and "world" in st.params
                        for st in parse_recipe(c.p.get("recipe")).steps):
        c.bad("a cross-rank ALLREDUCE_SHARD (rank/world params) cannot be a recipe step")


def _nothing(c: _Ctx) -> None:
    pass


def _all_same(c: _Ctx) -> None:
    _same_numel(c, *range(len(c.ins)))


ANY = 1 << 30
# op -> ((min inputs, max inputs), (min outputs, max outputs), check)
OPCODES: dict[K, tuple[tuple[int, int], tuple[int, int], Callable[[_Ctx], None]]] = {
    K.NOP: ((0, 0), (0, 0), _nothing),
    K.COPY: ((1, 1), (1, 1), _elementwise),
    K.EMBED: ((2, 2), (1, 1), _embed),
    K.RMSNORM: ((2, 2), (1, 1), _norm),
    K.LAYERNORM: ((2, 3), (1, 1), _norm),
    K.GEMV_TILE: ((2, 4), (1, 1), _gemv),
    K.GEMM_TILE: ((2, 4), (1, 1), _gemv),
    K.ATTENTION_TILE: ((3, 6), (1, 1), _attention),
    K.ATTENTION_COMBINE: ((1, ANY), (1, 1), _combine),
    K.ROPE: ((2, 3), (1, 1), _rope),
    K.SILU_MUL: ((2, 2), (1, 1), _elementwise),
    K.GELU: ((1, 1), (1, 1), _elementwise),
    K.ADD: ((2, 2), (1, 1), _elementwise),
    K.MUL: ((1, 2), (1, 1), _elementwise),
    K.SOFTCAP: ((1, 1), (1, 1), _elementwise),
    K.SUM: ((1, ANY), (1, 1), _sum),
    K.DEQUANT: ((2, 3), (1, 1), _dequant),
    K.SOFTMAX: ((1, 1), (1, 1), _all_same),
    K.KV_APPEND: ((2, 2), (1, 1), _kv_append),
    K.SAMPLE_ARGMAX: ((1, 1), (1, 1), _argmax),
    K.ALLREDUCE_SHARD: ((1, ANY), (1, 1), _allreduce),
    K.FUSED: ((0, ANY), (1, ANY), _fused),
}


def check_opcode(task: Task, buffers: Sequence[Buffer],
                 memo: IdentityMemo | None = None) -> list[str]:
    """Every message for one task. memo: one the caller keeps for one program; a FUSED task's
    messages depend only on its recipe object and operand counts (a decoder's layers repeat
    each recipe), so they are computed once per (recipe, counts)."""
    if memo is not None and task.op is K.FUSED and isinstance(task.params, Mapping):
        return memo.get(task.params.get("recipe"), (len(task.inputs), len(task.outputs)),
                        lambda: _check_opcode(task, buffers))
    return _check_opcode(task, buffers)


def _check_opcode(task: Task, buffers: Sequence[Buffer]) -> list[str]:
    (imin, imax), (omin, omax), check = OPCODES[task.op]
    n_in, n_out = len(task.inputs), len(task.outputs)
    msgs = []
    if not imin <= n_in <= imax:
        msgs.append(f"takes {imin}{'' if imax == imin else '+' if imax == ANY else f'..{imax}'} "
                    f"inputs, got {n_in}")
    if not omin <= n_out <= omax:
        msgs.append(f"takes {omin}{'' if omax == omin else '+' if omax == ANY else f'..{omax}'} "
                    f"outputs, got {n_out}")
    if msgs:
        return msgs
    if not isinstance(task.params, Mapping):
        return [f"params must be a mapping, got {type(task.params).__name__}"]
    c = _Ctx(task, buffers)
    try:
        check(c)
    except _Bad:
        pass
    return c.msgs
