"""Shape and dtype rules: each primitive's abstract evaluation, with errors that name the op,
the argument, the shapes and the user's source line."""
from __future__ import annotations

from amk.errors import TraceError
from amk.graph import Aval
from amk.program.ir import DType

FLOATS = (DType.F32, DType.F16, DType.BF16)


class Checker:
    """Collects the context of one op call so every error reads the same way."""

    def __init__(self, op: str, src: str):
        self.op = op
        self.src = src

    def fail(self, arg: str, msg: str) -> None:
        raise TraceError(f"amk.ops.{self.op}: argument '{arg}' {msg} (at {self.src})")

    def rank(self, arg: str, a: Aval, *ranks: int) -> None:
        if len(a.shape) not in ranks:
            want = " or ".join(str(r) for r in ranks)
            self.fail(arg, f"must have rank {want}, got shape {list(a.shape)}")

    def floating(self, arg: str, a: Aval) -> None:
        if a.dtype not in FLOATS:
            self.fail(arg, f"must be a float tensor (f32/f16/bf16), got {a.dtype.short}")

    def dtype(self, arg: str, a: Aval, *dts: DType) -> None:
        if a.dtype not in dts:
            want = "/".join(d.short for d in dts)
            self.fail(arg, f"must have dtype {want}, got {a.dtype.short}")

    def same_shape(self, names: tuple[str, str], a: Aval, b: Aval) -> None:
        if a.shape != b.shape:
            self.fail(names[1], f"shape {list(b.shape)} does not match '{names[0]}' shape {list(a.shape)}")

    def same_dtype(self, names: tuple[str, str], a: Aval, b: Aval) -> None:
        if a.dtype != b.dtype:
            self.fail(names[1], f"dtype {b.dtype.short} does not match '{names[0]}' dtype {a.dtype.short}")

    def pos(self, a: Aval, rows: int | None = None, cache: Aval | None = None) -> None:
        """pos is int32 [1] (every row at one position) or int32 [R], one position per row:
        rows of a T-token block of one sequence (prefill: a rank-3 cache [max_seq, ...]) or the
        B sequences of a batch, each at its own position in its own cache (rank 4, [B, ...])."""
        self.dtype("pos", a, DType.I32)
        if a.shape == (1,):
            return
        block = rows is not None and rows > 1 and a.shape == (rows,)
        per_seq = cache is not None and len(cache.shape) == 4 and cache.shape[0] == rows
        if block and cache is not None and len(cache.shape) != 3 and not per_seq:
            self.fail("pos", f"of shape {list(a.shape)} (one position per row) needs a "
                             f"single-sequence cache [max_seq, n_kv, head_dim] or one cache row "
                             f"per sequence [{rows}, max_seq, n_kv, head_dim], got {list(cache.shape)}")
        if not block:
            self.fail("pos", f"must be int32 of shape [1] (one decode position) or [{rows}] (one "
                             f"position per row of x), got {list(a.shape)}")

    def activation(self, arg: str, a: Aval) -> None:
        self.rank(arg, a, 2)
        self.floating(arg, a)


def embed(c: Checker, table: Aval, ids: Aval) -> Aval:
    c.rank("table", table, 2)
    c.floating("table", table)
    c.rank("ids", ids, 1)
    c.dtype("ids", ids, DType.I32)
    return Aval((ids.shape[0], table.shape[1]), table.dtype)


def norm(c: Checker, x: Aval, w: Aval, b: Aval | None) -> Aval:
    c.activation("x", x)
    c.rank("weight", w, 1)
    c.floating("weight", w)
    if x.shape[-1] % w.shape[0]:
        c.fail("weight", f"size {w.shape[0]} must divide x's last dim {x.shape[-1]} (x {list(x.shape)})")
    if b is not None:
        c.same_shape(("weight", "bias"), w, b)
    return x


def linear(c: Checker, x: Aval, w: Aval, bias: Aval | None) -> Aval:
    c.activation("x", x)
    c.rank("weight", w, 2)
    c.floating("weight", w)
    if w.shape[1] != x.shape[1]:
        c.fail("weight", f"shape {list(w.shape)} ([N_out, K_in], nn.Linear layout) does not fit "
                         f"x {list(x.shape)}: K_in {w.shape[1]} != {x.shape[1]}")
    if bias is not None:
        c.floating("bias", bias)
        if bias.shape != (w.shape[0],):
            c.fail("bias", f"must have shape [{w.shape[0]}], got {list(bias.shape)}")
    return Aval((x.shape[0], w.shape[0]), x.dtype)


def qlinear(c: Checker, x: Aval, q: Aval, scales: Aval, zeros: Aval | None,
            bits: int, group: int, bias: Aval | None = None) -> Aval:
    c.activation("x", x)
    if bits not in (4, 8):
        c.fail("weight", f"QuantizedWeight.bits must be 4 or 8, got {bits}")
    c.rank("weight.q", q, 2)
    c.dtype("weight.q", q, *((DType.U8,) if bits == 4 else (DType.I8, DType.F8E4M3)))
    if q.dtype is DType.F8E4M3 and zeros is not None:
        c.fail("weight.zeros", "an fp8 weight is symmetric: it takes no zeros")
    n = q.shape[0]
    k = q.shape[1] * (2 if bits == 4 else 1)
    if k != x.shape[1]:
        c.fail("weight", f"K_in {k} (q {list(q.shape)}, {bits}-bit) != x's last dim {x.shape[1]}")
    if group <= 0:
        c.fail("weight", f"group must be positive, got {group}")
    ng = (k + group - 1) // group
    c.floating("weight.scales", scales)
    if scales.shape != (n, ng):
        c.fail("weight.scales", f"must have shape [{n}, {ng}] (N, ceil(K/group)), got {list(scales.shape)}")
    if zeros is not None:
        c.same_shape(("weight.scales", "weight.zeros"), scales, zeros)
    if bias is not None:
        c.floating("bias", bias)
        if bias.shape != (n,):
            c.fail("bias", f"must have shape [{n}], got {list(bias.shape)}")
    return Aval((x.shape[0], n), x.dtype)


def rope(c: Checker, x: Aval, pos: Aval, inv_freq: Aval | None, head_dim: int) -> Aval:
    c.activation("x", x)
    c.pos(pos, x.shape[0])
    if head_dim <= 0 or head_dim % 2 or x.shape[-1] % head_dim:
        c.fail("head_dim", f"{head_dim} must be even and divide x's last dim {x.shape[-1]}")
    if inv_freq is not None:
        c.dtype("inv_freq", inv_freq, DType.F32)
        if inv_freq.shape != (head_dim // 2,):
            c.fail("inv_freq", f"must have shape [{head_dim // 2}], got {list(inv_freq.shape)}")
    return x


def _cache(c: Checker, name: str, cache: Aval, batch: int, n_kv: int, hd: int,
           block: bool = False) -> None:
    c.floating(name, cache)
    want = (n_kv, hd)
    if len(cache.shape) == 3 and (batch == 1 or block) and tuple(cache.shape[1:]) == want:
        return
    if len(cache.shape) == 4 and cache.shape[0] == batch and tuple(cache.shape[2:]) == want:
        return
    c.fail(name, f"must be [max_seq, {n_kv}, {hd}] (batch 1) or [{batch}, max_seq, {n_kv}, {hd}], "
                 f"got {list(cache.shape)}")


def attention(c: Checker, q: Aval, k: Aval, v: Aval, pos: Aval,
              n_heads: int, n_kv_heads: int, head_dim: int) -> Aval:
    c.activation("q", q)
    c.pos(pos, q.shape[0], k)
    if n_kv_heads <= 0 or n_heads % n_kv_heads:
        c.fail("n_kv_heads", f"{n_kv_heads} must divide n_heads {n_heads}")
    if q.shape[1] != n_heads * head_dim:
        c.fail("q", f"last dim {q.shape[1]} != n_heads*head_dim = {n_heads}*{head_dim}")
    _cache(c, "k_cache", k, q.shape[0], n_kv_heads, head_dim, block=pos.shape[0] > 1)
    c.same_shape(("k_cache", "v_cache"), k, v)
    c.same_dtype(("k_cache", "v_cache"), k, v)
    return q


def kv_update(c: Checker, cache: Aval, new: Aval, pos: Aval) -> Aval:
    c.activation("new", new)
    c.pos(pos, new.shape[0], cache)
    c.floating("cache", cache)
    b = new.shape[0]
    row = cache.shape[-2] * cache.shape[-1] if len(cache.shape) >= 3 else -1
    block = pos.shape[0] > 1             # row t of new goes to cache row pos[t]
    ok = (len(cache.shape) == 3 and (b == 1 or block)) or (len(cache.shape) == 4 and cache.shape[0] == b)
    if not ok or row != new.shape[1]:
        c.fail("new", f"shape {list(new.shape)} does not fit cache {list(cache.shape)}: want "
                      f"[B, n_kv*head_dim] with cache [max_seq, n_kv, head_dim] (B=1) or "
                      f"[B, max_seq, n_kv, head_dim]")
    return cache


def elementwise(c: Checker, names: tuple[str, ...], *xs: Aval) -> Aval:
    for n, x in zip(names, xs):
        c.floating(n, x)
    for n, x in zip(names[1:], xs[1:]):
        c.same_shape((names[0], n), xs[0], x)
        c.same_dtype((names[0], n), xs[0], x)
    return xs[0]


def broadcast_binary(c: Checker, names: tuple[str, str], a: Aval, b: Aval) -> Aval:
    """a and b of one shape, or one of them a vector [N] / [1, N] over the other's rows [B, N]."""
    c.floating(names[0], a)
    c.floating(names[1], b)
    c.same_dtype(names, a, b)
    if a.shape == b.shape:
        return a

    def is_row(v: Aval, full: Aval) -> bool:
        return len(full.shape) == 2 and v.shape in ((full.shape[1],), (1, full.shape[1]))

    if is_row(b, a):
        return a
    if is_row(a, b):
        return b
    c.fail(names[1], f"shape {list(b.shape)} neither matches '{names[0]}' shape {list(a.shape)} "
                     f"nor broadcasts over it (a vector [N] or [1, N] over [B, N])")
    return a


def column_slice(c: Checker, x: Aval, start: int, stop: int) -> Aval:
    c.activation("x", x)
    n = x.shape[1]
    if not 0 <= start < stop <= n:
        c.fail("start/stop", f"[{start}, {stop}) must be a non-empty range inside x's {n} columns "
                             f"(x {list(x.shape)})")
    return Aval((x.shape[0], stop - start), x.dtype)


def concat(c: Checker, names: tuple[str, ...], xs: list[Aval]) -> Aval:
    if len(xs) < 2:
        c.fail("xs", f"needs at least two tensors, got {len(xs)}")
    for n, x in zip(names, xs):
        c.activation(n, x)
    for n, x in zip(names[1:], xs[1:]):
        c.same_dtype((names[0], n), xs[0], x)
        if x.shape[0] != xs[0].shape[0]:
            c.fail(n, f"has {x.shape[0]} rows, '{names[0]}' has {xs[0].shape[0]} (concat joins columns)")
    return Aval((xs[0].shape[0], sum(x.shape[1] for x in xs)), xs[0].dtype)


def argmax(c: Checker, logits: Aval) -> Aval:
    c.activation("logits", logits)
    return Aval((logits.shape[0],), DType.I32)


def reshape(c: Checker, x: Aval, shape: tuple[int, ...]) -> Aval:
    n = 1
    for s in shape:
        if s <= 0:
            c.fail("shape", f"{list(shape)} must be positive")
        n *= s
    if n != x.numel:
        c.fail("shape", f"{list(shape)} has {n} elements, x {list(x.shape)} has {x.numel}")
    return Aval(tuple(shape), x.dtype)


def allreduce(c: Checker, shards: list[Aval]) -> Aval:
    if not shards:
        c.fail("shards", "must be a non-empty list")
    return elementwise(c, tuple(f"shards[{i}]" for i in range(len(shards))), *shards)
