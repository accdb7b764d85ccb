"""Two small decode-like programs, a few tasks each, for the per-pass golden texts: every line of
a pass's output on them can be checked by hand."""
from __future__ import annotations

from amk import ops
from amk.graph import Aval
from amk.passes.lower import lower
from amk.passes.options import PassOptions, Target
from amk.program.ir import BufferKind, DType, Program
from amk.trace import trace


# Two "SMs", GEMV tiles of 8 columns, two split-KV shards: small enough to read every line.
TWO_SMS = PassOptions(target=Target("two", num_sms=2, smem_bytes=1 << 16, max_tile_bytes=2048),
                      tile_n=8, attn_splits=2)


def mlp_step(params, token):
    x = ops.embed(params["embed"], token)                         # [1, 8]
    h = ops.rmsnorm(x, params["norm"], 1e-5)
    y = ops.add(ops.linear(h, params["w"]), params["b"])          # [1, 16]
    return ops.argmax(y)


def attention_step(new, pos, kv):
    k = ops.kv_update(kv["k"], new["k"], pos)
    v = ops.kv_update(kv["v"], new["v"], pos)
    return ops.attention(new["q"], k, v, pos, n_heads=2, n_kv_heads=1, head_dim=4)


def _f32(*shape: int) -> Aval:
    return Aval(shape, DType.F32)


def mlp_program() -> Program:
    """embed [12 x 8] -> rmsnorm -> linear [16 x 8] -> add a bias row -> argmax."""
    params = {"embed": _f32(12, 8), "norm": _f32(8), "w": _f32(16, 8), "b": _f32(1, 16)}
    g, _ = trace(mlp_step, [params, Aval((1,), DType.I32)], ["params", "token"],
                 [BufferKind.WEIGHT, BufferKind.IO_INPUT], name="mlp")
    return lower(g)


def attention_program() -> Program:
    """The new k and v rows appended to 8-row caches, then attention of 2 q heads on 1 kv head
    of 4 dims."""
    new = {"q": _f32(1, 8), "k": _f32(1, 4), "v": _f32(1, 4)}
    kv = {"k": _f32(8, 1, 4), "v": _f32(8, 1, 4)}
    g, _ = trace(attention_step, [new, Aval((1,), DType.I32), kv], ["new", "pos", "kv"],
                 [BufferKind.IO_INPUT, BufferKind.IO_INPUT, BufferKind.KV_CACHE], name="attn")
    return lower(g)


def chain_step(x):
    return ops.gelu(ops.gelu(ops.gelu(ops.gelu(x))))


def chain_program() -> Program:
    """Four gelus in a row over [1, 8]: three activations, of which the first two die early."""
    g, _ = trace(chain_step, [_f32(1, 8)], ["x"], [BufferKind.IO_INPUT], name="chain")
    return lower(g)
