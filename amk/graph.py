"""The graph IR: what tracing produces. Immutable, hash-consed, printable, verified.

    { lambda
        params.embed:f32[64,16]
        token:i32[1] .
      %4:f32[1,16] = embed params.embed token          # model.py:12
      ...
      in (%17, %9) }

Vars compare by identity (id); equations are frozen; the graph is a tuple of equations in
trace order, which is a legal sequential execution.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from amk.buffer_kinds import BufferKind
from amk.dtypes import DType
from amk.errors import TraceError


@dataclass(frozen=True)
class Aval:
    """Abstract value: what tracing knows about a tensor (no data)."""
    shape: tuple[int, ...]
    dtype: DType

    def __str__(self) -> str:
        return f"{self.dtype.short}[{','.join(map(str, self.shape))}]"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, eq=False)
class Var:
    id: int
    aval: Aval

    def __repr__(self) -> str:
        return f"%{self.id}"


@dataclass(frozen=True)
class Eqn:
    prim: str
    inputs: tuple[Var, ...]
    outputs: tuple[Var, ...]
    params: tuple[tuple[str, Any], ...]     # sorted (name, value) pairs: hashable
    src: str = ""                           # "file.py:LINE" of the user's call

    @property
    def p(self) -> dict[str, Any]:
        return dict(self.params)


@dataclass(frozen=True)
class Graph:
    inputs: tuple[Var, ...]
    input_paths: tuple[str, ...]            # pytree path of each input leaf
    input_kinds: tuple[BufferKind, ...]     # IO_INPUT / WEIGHT / KV_CACHE
    eqns: tuple[Eqn, ...]
    outputs: tuple[Var, ...]
    name: str = "fn"

    def __str__(self) -> str:
        return graph_to_text(self)


def _fmt_param(v: Any) -> str:
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, tuple):
        return "(" + ",".join(_fmt_param(x) for x in v) + ")"
    return str(v)


def graph_to_text(g: Graph) -> str:
    names: dict[int, str] = {}
    for v, p in zip(g.inputs, g.input_paths):
        names[v.id] = p
    # one input per line: a model has hundreds of weights
    ins = [f"    {p}:{v.aval}" for v, p in zip(g.inputs, g.input_paths)]
    lines = ["{ lambda", *ins[:-1], f"{ins[-1]} ."] if ins else ["{ lambda ."]
    for e in g.eqns:
        outs = " ".join(f"%{o.id}:{o.aval}" for o in e.outputs)
        args = " ".join(names.get(v.id, f"%{v.id}") for v in e.inputs)
        ps = " ".join(f"{k}={_fmt_param(v)}" for k, v in e.params)
        line = f"  {outs} = {e.prim} {args}" + (f" {ps}" if ps else "")
        if e.src:
            line = f"{line:<72} # {e.src}"
        lines.append(line)
    outs = ", ".join(names.get(v.id, f"%{v.id}") for v in g.outputs)
    lines.append(f"  in ({outs}) }}")
    return "\n".join(lines)


def verify_graph(g: Graph) -> None:
    """Every var is defined before use, exactly once; outputs are defined."""
    defined: set[int] = set()
    for v in g.inputs:
        if v.id in defined:
            raise TraceError(f"graph {g.name}: input %{v.id} defined twice")
        defined.add(v.id)
    for i, e in enumerate(g.eqns):
        for v in e.inputs:
            if v.id not in defined:
                raise TraceError(f"graph {g.name}: eqn {i} ({e.prim}, {e.src}) uses undefined %{v.id}")
        for v in e.outputs:
            if v.id in defined:
                raise TraceError(f"graph {g.name}: eqn {i} ({e.prim}) redefines %{v.id}")
            defined.add(v.id)
    for v in g.outputs:
        if v.id not in defined:
            raise TraceError(f"graph {g.name}: output %{v.id} is undefined")
