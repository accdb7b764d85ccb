"""Tracing: run the user's function on abstract values and record the graph IR.

Only shapes and dtypes flow through a trace, never data. Every `amk.ops` call checks its
arguments (amk/ops/rules.py), then records one equation. Identical equations are recorded once
(hash-consing), so tracing the same subexpression twice costs nothing downstream.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Sequence

import torch

from amk import pytree
from amk.buffer_kinds import BufferKind
from amk.dtypes import DType
from amk.errors import TraceError
from amk.graph import Aval, Eqn, Graph, Var, verify_graph

_AMK_DIR = os.path.dirname(os.path.abspath(__file__))
_INTERNAL = (os.path.join(_AMK_DIR, "ops"), os.path.join(_AMK_DIR, "trace.py"))


class Tracer:
    """Stands in for a tensor during tracing. Has .shape and .dtype like a tensor."""
    __slots__ = ("var", "ctx")

    def __init__(self, var: Var, ctx: "TraceContext"):
        self.var = var
        self.ctx = ctx

    @property
    def aval(self) -> Aval:
        return self.var.aval

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.var.aval.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.var.aval.dtype.torch

    @property
    def ndim(self) -> int:
        return len(self.var.aval.shape)

    def dim(self) -> int:
        return self.ndim

    def numel(self) -> int:
        return self.var.aval.numel

    def __repr__(self) -> str:
        return f"Tracer(%{self.var.id}: {self.var.aval})"

    def __bool__(self):
        raise TraceError(f"{self!r} has no value during tracing: Python control flow cannot "
                         f"depend on traced data ({user_source_line()})")

    # A few operators for convenience; they record the same equations as amk.ops.
    def __add__(self, other):
        from amk import ops
        return ops.add(self, other)

    def __mul__(self, other):
        from amk import ops
        return ops.mul(self, other)


class ArgDict(dict):
    """A dict argument as the traced function sees it: a missing key is an AMK error naming the
    argument path and the keys that exist (a missing weight, most often)."""
    __slots__ = ("path",)

    def __missing__(self, key):
        raise TraceError(f"{self.path}[{key!r}] does not exist ({user_source_line()}); "
                         f"{self.path} has {sorted(self.keys())}")


def _wrap_dicts(x, path: str):
    if isinstance(x, dict):
        d = ArgDict((k, _wrap_dicts(v, f"{path}.{k}")) for k, v in x.items())
        d.path = path
        return d
    if isinstance(x, list):
        return [_wrap_dicts(v, f"{path}.{i}") for i, v in enumerate(x)]
    if isinstance(x, tuple):
        return tuple(_wrap_dicts(v, f"{path}.{i}") for i, v in enumerate(x))
    return x


_STACK: list["TraceContext"] = []


def current() -> "TraceContext | None":
    return _STACK[-1] if _STACK else None


# co_filename -> its base name when it is user code, "" when it is AMK's (abspath per frame
# per op was a third of a warm trace)
_USER_FILE: dict[str, str] = {}


def user_source_line() -> str:
    """file:line of the innermost frame outside AMK's op/trace machinery."""
    f = sys._getframe(1)
    while f is not None:
        name = _USER_FILE.get(f.f_code.co_filename)
        if name is None:
            fn = os.path.abspath(f.f_code.co_filename)
            name = _USER_FILE[f.f_code.co_filename] = (
                "" if fn.startswith(_INTERNAL) else os.path.basename(fn))
        if name:
            return f"{name}:{f.f_lineno}"
        f = f.f_back
    return "?"


class TraceContext:
    def __init__(self):
        self.eqns: list[Eqn] = []
        self._next = 0
        self._memo: dict[tuple, tuple[Var, ...]] = {}

    def new_var(self, aval: Aval) -> Var:
        v = Var(self._next, aval)
        self._next += 1
        return v

    def bind(self, prim: str, inputs: Sequence[Tracer], params: dict[str, Any],
             out_avals: Sequence[Aval], src: str) -> list[Tracer]:
        for t in inputs:
            if t.ctx is not self:
                raise TraceError(f"{prim} at {src}: a tracer from another trace leaked in "
                                 f"(a value captured from an outer jitted function?)")
        ps = tuple(sorted(params.items()))
        key = (prim, tuple(t.var.id for t in inputs), ps)
        outs = self._memo.get(key)
        if outs is None:
            outs = tuple(self.new_var(a) for a in out_avals)
            self.eqns.append(Eqn(prim, tuple(t.var for t in inputs), outs, ps, src))
            self._memo[key] = outs
        return [Tracer(v, self) for v in outs]


def _dtype_or_none(dt) -> DType | None:
    try:
        return DType.of(dt)
    except TypeError:
        return None


def _unsupported_dtype(g_eqns, bad: dict, fn_name: str) -> TraceError:
    """The error for leaves of a dtype AMK has no code for, naming the first op that reads one."""
    for e in g_eqns:
        for v in e.inputs:
            if v.id in bad:
                path, dt = bad[v.id]
                return _dtype_error(fn_name, path, dt, f" (read by amk.ops.{e.prim} at {e.src})")
    path, dt = next(iter(bad.values()))
    return _dtype_error(fn_name, path, dt, "")


def _dtype_error(fn_name: str, path: str, dt, where: str) -> TraceError:
    hint = " (cast it: .float() or .to(torch.bfloat16))" if dt == torch.float64 else ""
    return TraceError(f"{fn_name}: argument {path} has dtype {dt}{where}, which AMK does not run"
                      f"{hint}; floats are float32/float16/bfloat16, ids and positions int32")


def trace(fn: Callable, args: Sequence[Any], arg_names: Sequence[str],
          arg_kinds: Sequence[BufferKind], name: str = "fn") -> tuple[Graph, Any]:
    """Trace fn(*args) where each argument is a pytree of tensors (or Avals).

    Returns the graph and the output treedef. Input leaves become graph inputs, named by their
    pytree path (the argument name first: "params.layers.0.wq")."""
    ctx = TraceContext()
    in_vars: list[Var] = []
    in_paths: list[str] = []
    in_kinds: list[BufferKind] = []
    traced_args = []
    bad: dict[int, tuple[str, Any]] = {}
    for a, an, kind in zip(args, arg_names, arg_kinds):
        leaves, paths, td = pytree.flatten(a, an, is_leaf=lambda x: isinstance(x, Aval))
        tracers = []
        for leaf, p in zip(leaves, paths):
            dt = leaf.dtype if isinstance(leaf, Aval) else _dtype_or_none(leaf.dtype)
            # an unsupported dtype is traced as f32 and reported with the op that reads it
            v = ctx.new_var(leaf if isinstance(leaf, Aval) else Aval(tuple(leaf.shape), dt or DType.F32))
            if dt is None:
                bad[v.id] = (p, leaf.dtype)
            in_vars.append(v)
            in_paths.append(p)
            in_kinds.append(kind)
            tracers.append(Tracer(v, ctx))
        traced_args.append(_wrap_dicts(pytree.unflatten(td, tracers), an))

    _STACK.append(ctx)
    try:
        result = fn(*traced_args)
    finally:
        _STACK.pop()
    if bad:
        raise _unsupported_dtype(ctx.eqns, bad, name)

    out_leaves, out_paths, out_td = pytree.flatten(
        result, "output", is_leaf=lambda x: isinstance(x, Tracer))
    for leaf, p in zip(out_leaves, out_paths):
        if not isinstance(leaf, Tracer):
            raise TraceError(f"{name} returned {p} = {type(leaf).__name__}; a jitted function "
                             f"must return values computed with amk.ops (or its inputs)")
        if leaf.ctx is not ctx:
            raise TraceError(f"{name} returned {p}, a value from another trace")
    g = Graph(tuple(in_vars), tuple(in_paths), tuple(in_kinds), tuple(ctx.eqns),
              tuple(t.var for t in out_leaves), name)
    verify_graph(g)
    return g, out_td
