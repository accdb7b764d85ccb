"""Hypothesis strategies for random AMK decode steps and pass options, and the few helpers that
run one on the reference VM. Shared by tests/property (CPU) and tests/gpu (CUDA conformance).

A drawn decode step is a `Case`, a (fn, args, donate) triple for
`amk.jit(fn, donate=donate, backend=...)`, with `fn(params, token, pos, kv)`. Its structure is a
`Plan` (plain data: what `describe` prints); its tensors are made from a drawn seed. Everything
shrinks towards the smallest program: one f32 batch-1 `linear` on an input activation.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Sequence

import torch
from hypothesis import strategies as st

import amk
from amk import ops, pytree
from amk.graph import Graph
from amk.program.ir import BufferKind, Program
from amk.trace import trace

ARG_NAMES = ("params", "token", "pos", "kv")

# Block kinds, simplest first (Hypothesis shrinks a sampled_from towards the first entry).
BLOCKS = ("linear", "norm_linear", "residual", "swiglu", "gelu_mlp", "attention", "scale",
          "softmax", "layernorm", "reshape_norm", "allreduce", "dequant_linear", "cast")
TAILS = ("none", "lm_head", "lm_head_argmax", "tied_argmax")


# ---------------------------------------------------------------------------------------------
# the plan: structure as data
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Dims:
    batch: int
    dtype: torch.dtype
    hidden: int
    head_dim: int
    n_kv_heads: int
    n_heads: int
    ffn: int
    vocab: int
    max_seq: int
    pos: int
    cache_4d: bool          # batch 1 only: [1, S, kv, hd] instead of [S, kv, hd]
    positions: tuple[int, ...] = ()   # batch > 1: sequence b at positions[b]; (): all at pos


@dataclasses.dataclass(frozen=True)
class LinearSpec:
    quant: tuple[int, int] | None = None    # (bits, group)
    bias: bool = False


@dataclasses.dataclass(frozen=True)
class Block:
    kind: str
    linears: tuple[LinearSpec, ...] = ()
    rope: bool = False                      # attention: rotate q and k
    inv_freq: bool = False                  # attention: rope with an inv_freq table
    ln_bias: bool = False                   # layernorm: with a bias


@dataclasses.dataclass(frozen=True)
class Plan:
    dims: Dims
    embed: bool                             # x = embed(table, token), else token is x itself
    layers: tuple[tuple[Block, ...], ...]
    tied_layers: bool                       # every layer uses layers[0]'s weights (shared buffers)
    tail: str
    seed: int

    def describe(self) -> str:
        d = self.dims
        dt = "bf16" if d.dtype == torch.bfloat16 else "f32"
        lines = [f"B={d.batch} {dt} H={d.hidden} heads={d.n_heads}/{d.n_kv_heads}x{d.head_dim} "
                 f"F={d.ffn} V={d.vocab} S={d.max_seq} pos={list(d.positions) or d.pos} "
                 f"embed={self.embed} "
                 f"tail={self.tail} tied={self.tied_layers} seed={self.seed}"]
        for i, layer in enumerate(self.layers):
            lines.append(f"  layer {i}: " + ", ".join(_block_text(b) for b in layer))
        return "\n".join(lines)


def _block_text(b: Block) -> str:
    extras = [f"q{l.quant[0]}g{l.quant[1]}" if l.quant else "" for l in b.linears]
    extras += ["bias"] * sum(l.bias for l in b.linears)
    extras += [n for n, on in (("rope", b.rope), ("inv_freq", b.inv_freq), ("ln_bias", b.ln_bias)) if on]
    extras = [e for e in extras if e]
    return b.kind + (f"[{' '.join(extras)}]" if extras else "")


class Case(NamedTuple):
    """(fn, args, donate): `amk.jit(fn, donate=donate)(*args)`; fn.plan holds the Plan."""
    fn: Callable
    args: tuple
    donate: tuple[str, ...]

    @property
    def plan(self) -> Plan:
        return self.fn.plan

    def describe(self) -> str:
        return self.plan.describe() + f"\n  donate={self.donate}"

    def to(self, device) -> "Case":
        """The same case with fresh copies of every tensor on `device` (a donated cache is
        written in place, so every run wants its own)."""
        args = []
        for name, val in zip(ARG_NAMES, self.args):
            leaves, _, td = pytree.flatten(val, name)
            args.append(pytree.unflatten(td, [t.detach().clone().to(device) for t in leaves]))
        return Case(self.fn, tuple(args), self.donate)

    def __repr__(self) -> str:              # what Hypothesis prints for a falsifying example
        return f"Case(<{self.describe()}>)"


# ---------------------------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------------------------
@st.composite
def dims(draw, batches: Sequence[int] = (1, 2, 3), dtypes=(torch.float32, torch.bfloat16)) -> Dims:
    """Small shapes: hidden 8-64, GQA ratio 1/2/4, a few cache rows, a decode position."""
    head_dim = draw(st.sampled_from([8, 4, 16]))
    n_kv = draw(st.sampled_from([1, 2]))
    ratio = draw(st.sampled_from([1, 2, 4]))
    max_seq = draw(st.sampled_from([4, 8, 5]))
    batch = draw(st.sampled_from(list(batches)))
    return Dims(batch=batch, dtype=draw(st.sampled_from(list(dtypes))),
                hidden=draw(st.sampled_from([16, 8, 32, 64])), head_dim=head_dim,
                n_kv_heads=n_kv, n_heads=n_kv * ratio, ffn=draw(st.sampled_from([16, 32, 24])),
                vocab=draw(st.sampled_from([16, 32, 11])), max_seq=max_seq,
                pos=draw(st.integers(0, max_seq - 1)),
                cache_4d=batch == 1 and draw(st.booleans()),
                positions=tuple(draw(st.lists(st.integers(0, max_seq - 1), min_size=batch,
                                              max_size=batch)))
                if batch > 1 and draw(st.booleans()) else ())


def linear_specs(quantized: bool = True, bias: bool = True) -> st.SearchStrategy[LinearSpec]:
    """A plain linear, or an int8/int4 group-quantized one (groups need not divide K)."""
    quant = st.none()
    if quantized:
        quant = st.none() | st.tuples(st.sampled_from([8, 4]), st.sampled_from([8, 16, 32, 6]))
    # ops.linear takes no bias with a QuantizedWeight (the op API says: add it with ops.add)
    return st.builds(LinearSpec, quant=quant, bias=st.booleans() if bias else st.just(False)
                     ).map(lambda s: dataclasses.replace(s, bias=False) if s.quant else s)


_N_LINEARS = {"linear": 1, "norm_linear": 1, "residual": 1, "swiglu": 3, "gelu_mlp": 2,
              "attention": 4, "allreduce": 2, "dequant_linear": 1}


@st.composite
def blocks(draw, kinds: Sequence[str] = BLOCKS, quantized: bool = True) -> Block:
    kind = draw(st.sampled_from(list(kinds)))
    n = _N_LINEARS.get(kind, 0)
    if kind == "dequant_linear":      # the weight is a QuantizedWeight, dequantized in the graph
        q = draw(st.tuples(st.sampled_from([8, 4]), st.sampled_from([8, 16, 6])))
        return Block(kind, (LinearSpec(quant=q),))
    lin = tuple(draw(linear_specs(quantized, bias=kind != "residual")) for _ in range(n))
    rope = kind == "attention" and draw(st.booleans())
    return Block(kind, lin, rope=rope, inv_freq=rope and draw(st.booleans()),
                 ln_bias=kind == "layernorm" and draw(st.booleans()))


@st.composite
def plans(draw, max_layers: int = 2, max_blocks: int = 3, kinds: Sequence[str] = BLOCKS,
          quantized: bool = True, batches: Sequence[int] = (1, 2, 3),
          dtypes=(torch.float32, torch.bfloat16), tails: Sequence[str] = TAILS) -> Plan:
    d = draw(dims(batches, dtypes))
    n_layers = draw(st.integers(1, max_layers))
    tied = n_layers > 1 and draw(st.booleans())
    first = tuple(draw(st.lists(blocks(kinds, quantized), min_size=1, max_size=max_blocks)))
    layers = [first]
    for _ in range(n_layers - 1):
        layers.append(first if tied else
                      tuple(draw(st.lists(blocks(kinds, quantized), min_size=1, max_size=max_blocks))))
    return Plan(d, embed=draw(st.booleans()), layers=tuple(layers), tied_layers=tied,
                tail=draw(st.sampled_from(list(tails))), seed=draw(st.integers(0, 2 ** 16)))


@st.composite
def decode_steps(draw, donate: bool | None = None, **plan_kw) -> Case:
    """A random decode step as a (fn, args, donate) Case; plan_kw go to `plans`."""
    plan = draw(plans(**plan_kw))
    don = draw(st.booleans()) if donate is None else donate
    return build_case(plan, ("kv",) if don else ())


def fusable_chains() -> st.SearchStrategy[Case]:
    """Steps made of the chains the fusion pass targets: rmsnorm->linear, linear->add and
    gate/up->silu_mul, stacked in one or two layers."""
    return decode_steps(kinds=("norm_linear", "residual", "swiglu"), tails=("none", "lm_head"))


@st.composite
def targets(draw):
    """A CPU- or H200-shaped target with a random SM count and small tile limits, so tiny
    programs still get several tiles, queues and shards."""
    from amk.passes.options import CPU, H200
    base = draw(st.sampled_from([CPU, H200]))
    return base.with_(num_sms=draw(st.sampled_from([base.num_sms, 1, 2, 3, 8])),
                      min_tile_cols=draw(st.sampled_from([base.min_tile_cols, 8, 4, 1])),
                      max_tile_bytes=draw(st.sampled_from([base.max_tile_bytes, 64, 256, 1024])))


@st.composite
def pass_options(draw, backend: str = "reference"):
    """Random `amk.passes.options.PassOptions` (None until that module exists): target shape and
    SM count, tile width, split-KV shard count, deferred KV appends, fusion on/off and which
    rules, memory planning and placement on/off. Shrinks towards the backend's defaults."""
    try:
        from amk.passes.options import DEFAULT_FUSE_RULES, PassOptions
    except ImportError:
        return None
    base = PassOptions.for_backend(backend, torch.device("cpu"))
    fields = {f.name for f in dataclasses.fields(PassOptions)}
    kw: dict[str, Any] = {}

    def maybe(name: str, strategy: st.SearchStrategy) -> None:
        if name in fields:                 # options grow; draw only the fields this one has
            kw[name] = draw(strategy)

    maybe("target", st.just(base.target) | targets())
    maybe("tile_n", st.sampled_from([None, 8, 16, 4, 32, 1, 5, 24]))
    maybe("attn_splits", st.sampled_from([None, 1, 2, 3, 4, 8]))
    maybe("kv_shard_min", st.sampled_from([getattr(base, "kv_shard_min", 128), 1, 2, 3]))
    maybe("fuse", st.sampled_from([True, False]))
    maybe("defer_kv_append", st.sampled_from([getattr(base, "defer_kv_append", False),
                                              not getattr(base, "defer_kv_append", False)]))
    rules = list(DEFAULT_FUSE_RULES)
    maybe("fuse_rules", st.none() | st.lists(st.sampled_from(rules), unique=True).map(tuple))
    maybe("plan_memory", st.sampled_from([True, False]))
    maybe("place", st.sampled_from([True, False]))
    return dataclasses.replace(base, **kw)


# ---------------------------------------------------------------------------------------------
# building the function and its tensors
# ---------------------------------------------------------------------------------------------
def build_case(plan: Plan, donate: tuple[str, ...]) -> Case:
    d = plan.dims
    g = torch.Generator().manual_seed(plan.seed)

    def rand(*shape, scale=1.0, dtype=None):
        return (torch.randn(*shape, generator=g) * scale).to(dtype or d.dtype)

    def weight(spec: LinearSpec, n: int, k: int):
        w = rand(n, k, scale=1.0 / math.sqrt(k))
        p: dict[str, Any] = {"w": amk.quantize(w, *spec.quant) if spec.quant else w}
        if spec.bias:
            p["b"] = rand(n, scale=0.1)
        return p

    H, F = d.hidden, d.ffn
    qd, kvd = d.n_heads * d.head_dim, d.n_kv_heads * d.head_dim
    shapes = {"linear": [(H, H)], "norm_linear": [(H, H)], "residual": [(H, H)],
              "swiglu": [(F, H), (F, H), (H, F)], "gelu_mlp": [(F, H), (H, F)],
              "attention": [(qd, H), (kvd, H), (kvd, H), (H, qd)], "allreduce": [(H, H), (H, H)],
              "dequant_linear": [(H, H)]}

    def block_params(b: Block) -> dict:
        p: dict[str, Any] = {"lin": [weight(s, n, k) for s, (n, k) in zip(b.linears, shapes.get(b.kind, []))]}
        if b.kind in ("norm_linear", "residual", "swiglu", "attention", "layernorm"):
            p["norm"] = 1.0 + rand(H, scale=0.1)
        if b.kind == "reshape_norm":
            p["norm"] = 1.0 + rand(H // 2, scale=0.1)
        if b.kind == "layernorm" and b.ln_bias:
            p["ln_b"] = rand(H, scale=0.1)
        if b.inv_freq:
            p["inv_freq"] = 1.0 / (500.0 ** (torch.arange(0, d.head_dim, 2).float() / d.head_dim))
        return p

    n_param_layers = 1 if plan.tied_layers else len(plan.layers)
    params: dict[str, Any] = {"layers": [[block_params(b) for b in plan.layers[i]]
                                         for i in range(n_param_layers)]}
    if plan.embed or plan.tail == "tied_argmax":
        params["embed"] = rand(d.vocab, H)
    if plan.tail in ("lm_head", "lm_head_argmax"):
        params["lm_head"] = rand(d.vocab, H, scale=1.0 / math.sqrt(H))
    if plan.tail != "none":
        params["final_norm"] = 1.0 + rand(H, scale=0.1)

    token = (torch.randint(0, d.vocab, (d.batch,), generator=g, dtype=torch.int32) if plan.embed
             else rand(d.batch, H))
    pos = torch.tensor(list(d.positions) or [d.pos], dtype=torch.int32)
    cache_shape = ((d.max_seq, d.n_kv_heads, d.head_dim) if d.batch == 1 and not d.cache_4d
                   else (d.batch, d.max_seq, d.n_kv_heads, d.head_dim))
    kv = {}
    for li, layer in enumerate(plan.layers):
        for bi, b in enumerate(layer):
            if b.kind == "attention":
                kv[f"l{li}b{bi}"] = {"k": rand(*cache_shape), "v": rand(*cache_shape)}

    fn = _make_fn(plan)
    return Case(fn, (params, token, pos, kv), tuple(donate))


def _make_fn(plan: Plan) -> Callable:
    d = plan.dims

    def lin(x, p):
        return ops.linear(x, p["w"], p.get("b"))

    def block(b: Block, p: dict, x, pos, kv: dict, key: str):
        L = p["lin"]
        if b.kind == "linear":
            return lin(x, L[0])
        if b.kind == "norm_linear":
            return lin(ops.rmsnorm(x, p["norm"], 1e-5), L[0])
        if b.kind == "residual":
            return ops.add(x, lin(ops.rmsnorm(x, p["norm"], 1e-5), L[0]))
        if b.kind == "swiglu":
            h = ops.rmsnorm(x, p["norm"], 1e-5)
            return ops.add(x, lin(ops.silu_mul(lin(h, L[0]), lin(h, L[1])), L[2]))
        if b.kind == "gelu_mlp":
            return ops.add(x, lin(ops.gelu(lin(x, L[0])), L[1]))
        if b.kind == "attention":
            h = ops.rmsnorm(x, p["norm"], 1e-5)
            q, k, v = lin(h, L[0]), lin(h, L[1]), lin(h, L[2])
            if b.rope:
                q = ops.rope(q, pos, d.head_dim, inv_freq=p.get("inv_freq"))
                k = ops.rope(k, pos, d.head_dim, inv_freq=p.get("inv_freq"))
            kc = ops.kv_update(kv[key]["k"], k, pos)
            vc = ops.kv_update(kv[key]["v"], v, pos)
            kv[key] = {"k": kc, "v": vc}
            a = ops.attention(q, kc, vc, pos, d.n_heads, d.n_kv_heads, d.head_dim)
            return ops.add(x, lin(a, L[3]))
        if b.kind == "scale":
            return ops.mul(x, scale=0.5)
        if b.kind == "softmax":
            return ops.softmax(x)
        if b.kind == "layernorm":
            return ops.layernorm(x, p["norm"], p.get("ln_b"))
        if b.kind == "reshape_norm":
            y = ops.rmsnorm(ops.reshape(x, (d.batch * 2, d.hidden // 2)), p["norm"], 1e-5)
            return ops.reshape(y, (d.batch, d.hidden))
        if b.kind == "allreduce":
            return ops.allreduce([lin(x, L[0]), lin(x, L[1])])
        if b.kind == "dequant_linear":
            return ops.linear(x, ops.dequant(L[0]["w"]))
        if b.kind == "cast":
            other = torch.float32 if d.dtype == torch.bfloat16 else torch.bfloat16
            return ops.cast(ops.cast(x, other), d.dtype)
        raise ValueError(f"unknown block kind {b.kind!r}")

    def decode_step(params, token, pos, kv):
        kv = dict(kv)
        x = ops.embed(params["embed"], token) if plan.embed else token
        for li, layer in enumerate(plan.layers):
            lp = params["layers"][0 if plan.tied_layers else li]
            for bi, b in enumerate(layer):
                x = block(b, lp[bi], x, pos, kv, f"l{li}b{bi}")
        outs: tuple = (x,)
        if plan.tail != "none":
            h = ops.rmsnorm(x, params["final_norm"], 1e-5)
            logits = ops.linear(h, params["embed" if plan.tail == "tied_argmax" else "lm_head"])
            outs = (logits,) if plan.tail == "lm_head" else (ops.argmax(logits), logits)
        return outs, kv

    decode_step.plan = plan
    return decode_step


# ---------------------------------------------------------------------------------------------
# running a case
# ---------------------------------------------------------------------------------------------
def arg_kinds(donate: Sequence[str]) -> list[BufferKind]:
    """What amk.jit makes of each argument: donated -> KV_CACHE, params -> WEIGHT, else input."""
    return [BufferKind.KV_CACHE if n in donate else BufferKind.WEIGHT if n == "params"
            else BufferKind.IO_INPUT for n in ARG_NAMES]


def trace_case(case: Case) -> Graph:
    graph, _ = trace(case.fn, case.args, ARG_NAMES, arg_kinds(case.donate), name="decode_step")
    return graph


def bindings(case: Case, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """{buffer source path: a fresh copy of the tensor} (fresh: a donated cache is written)."""
    out = {}
    for name, val in zip(ARG_NAMES, case.args):
        leaves, paths, _ = pytree.flatten(val, name)
        out.update({p: t.detach().clone().to(device) for p, t in zip(paths, leaves)})
    return out


def run_vm(program: Program, case: Case, order: str = "program", seed: int = 0,
           check: bool = True, device: str = "cpu") -> list[torch.Tensor]:
    """One step of `program` on the reference VM over fresh bindings; outputs flattened."""
    from amk.backends.reference.vm import ReferenceVM
    vm = ReferenceVM(program, device=device, order=order, seed=seed, check=check)
    return [o.detach().clone().reshape(-1) for o in vm.run(bindings(case, device))]


def interpret_case(graph: Graph, case: Case) -> list[torch.Tensor]:
    from amk.backends.reference.interp import interpret
    return [o.detach().clone().reshape(-1) for o in interpret(graph, bindings(case))]


def tolerance(dtype: torch.dtype) -> float:
    return 2e-2 if dtype == torch.bfloat16 else 1e-4


def outputs_differ(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], exact: bool,
                   tol: float = 0.0) -> str | None:
    """None if equal (bitwise when exact, else |got-want| <= tol*(1+max|want|) per output; an
    int output next to its float logits may differ only on a near-tie); else what differs."""
    if len(got) != len(want):
        return f"{len(got)} outputs, expected {len(want)}"
    for i, (a, b) in enumerate(zip(got, want)):
        a, b = a.cpu().reshape(-1), b.cpu().reshape(-1)
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"output {i}: {a.dtype}{list(a.shape)} vs expected {b.dtype}{list(b.shape)}"
        if exact or not b.dtype.is_floating_point:
            same = torch.equal(a, b) or (b.dtype.is_floating_point and
                                         torch.equal(a.isnan(), b.isnan()) and
                                         torch.equal(a.nan_to_num(), b.nan_to_num()))
            if same:
                continue
            if not exact and i + 1 < len(want) and want[i + 1].dtype.is_floating_point:
                logits = want[i + 1].cpu().float().reshape(b.numel(), -1)
                best = logits.max(-1).values
                picked = logits.gather(1, a.long().view(-1, 1)).view(-1)
                if bool(((best - picked) <= tol * (1 + best.abs())).all()):
                    continue                          # a near-tie: either token is right
            bad = (a != b).nonzero()[:4].view(-1).tolist()
            return (f"output {i} ({b.dtype}) differs{' bitwise' if exact else ''} at flat "
                    f"index {bad}: got {a[bad].tolist()} expected {b[bad].tolist()}")
        af, bf = a.float(), b.float()
        if not torch.equal(af.isnan(), bf.isnan()):
            return f"output {i}: NaN pattern differs"
        err = (af - bf).nan_to_num().abs().max().item() if af.numel() else 0.0
        bound = tol * (1 + bf.nan_to_num().abs().max().item()) if bf.numel() else 0.0
        if err > bound:
            return f"output {i} ({b.dtype}): max |diff| {err:.3g} > {bound:.3g}"
    return None
