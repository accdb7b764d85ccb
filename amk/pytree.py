"""Pytrees: nested dict / list / tuple / dataclass containers of tensors, flattened to leaves.

A treedef is a hashable description of the structure (part of a jitted function's signature);
every leaf has a dotted path ("params.layers.0.wq") used in error messages and as the source of
the program buffer it binds to.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from amk.errors import TraceError

# Dataclasses whose non-tensor fields are static metadata (part of the signature, not leaves).
_STATIC_FIELDS: dict[type, tuple[str, ...]] = {}


def register_static_fields(cls: type, fields: tuple[str, ...]) -> type:
    _STATIC_FIELDS[cls] = fields
    return cls


def _is_leaf(x: Any, is_leaf: Callable[[Any], bool] | None) -> bool:
    return isinstance(x, torch.Tensor) or (is_leaf is not None and is_leaf(x))


def flatten(tree: Any, prefix: str = "", is_leaf: Callable[[Any], bool] | None = None,
            with_paths: bool = True):
    """Returns (leaves, paths, treedef). Raises TraceError on a leaf that is not a tensor.
    with_paths=False skips building the path strings (the per-call hot path of amk.jit); an
    error then re-flattens with paths to say where."""
    if not with_paths:
        try:
            return _flatten(tree, prefix, is_leaf, lambda p, k: p)
        except TraceError:
            pass
    return _flatten(tree, prefix, is_leaf, lambda p, k: f"{p}.{k}" if p else str(k))


def _flatten(tree: Any, prefix: str, is_leaf, join):
    leaves: list[Any] = []
    paths: list[str] = []

    def go(x: Any, path: str):
        if _is_leaf(x, is_leaf):
            leaves.append(x)
            paths.append(path)
            return ("leaf",)
        if x is None:
            return ("none",)
        if isinstance(x, dict):
            keys = tuple(x.keys())
            for k in keys:
                if not isinstance(k, str):
                    raise TraceError(f"{path or 'argument'}: dict keys must be strings, got {k!r}")
            return ("dict", keys, tuple(go(x[k], join(path, k)) for k in keys))
        if isinstance(x, (list, tuple)):
            kind = "list" if isinstance(x, list) else "tuple"
            return (kind, len(x), tuple(go(v, join(path, i)) for i, v in enumerate(x)))
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            cls = type(x)
            static = _STATIC_FIELDS.get(cls, ())
            names = tuple(f.name for f in dataclasses.fields(x) if f.name not in static)
            svals = tuple(getattr(x, s) for s in static)
            return ("dc", cls, static, svals, names,
                    tuple(go(getattr(x, n), join(path, n)) for n in names))
        raise TraceError(
            f"{path or 'argument'}: leaf of type {type(x).__name__} is not a tensor; AMK traces "
            f"pytrees (dict/list/tuple/dataclass) of torch tensors. Pass numbers as tensors or "
            f"mark the argument static (amk.jit(fn, static_argnames=...)).")

    treedef = go(tree, prefix)
    return leaves, paths, treedef


def unflatten(treedef, leaves: list[Any]) -> Any:
    it = iter(leaves)

    def go(td):
        tag = td[0]
        if tag == "leaf":
            return next(it)
        if tag == "none":
            return None
        if tag == "dict":
            return {k: go(c) for k, c in zip(td[1], td[2])}
        if tag == "list":
            return [go(c) for c in td[2]]
        if tag == "tuple":
            return tuple(go(c) for c in td[2])
        if tag == "dc":
            _, cls, static, svals, names, children = td
            kw = dict(zip(static, svals))
            kw.update({n: go(c) for n, c in zip(names, children)})
            return cls(**kw)
        raise AssertionError(tag)

    out = go(treedef)
    rest = list(it)
    assert not rest, f"unflatten: {len(rest)} leaves left over"
    return out


def accessor(treedefs: tuple) -> Callable[[tuple], list | None]:
    """A function args -> the leaves of args[i] flattened by treedefs[i], in flatten's order, or
    None when a container's kind, length or static fields differ (a missing key or index
    raises). Generated straight-line code: amk.jit's per-call fast path, where a Python walk of
    a model's few hundred weights cost more than the kernel launch."""
    lines, leaves, consts, n = ["def access(args):"], [], {}, [0]

    def name(prefix):
        n[0] += 1
        return f"{prefix}{n[0]}"

    def node(expr, td):
        tag = td[0]
        if tag == "leaf":
            v = name("v")
            lines.append(f"    {v} = {expr}")
            leaves.append(v)
            return
        if tag == "none":
            lines.append(f"    if {expr} is not None: return None")
            return
        v = name("n")
        lines.append(f"    {v} = {expr}")
        if tag == "dc":
            _, cls, static, svals, names, children = td
            c, s = name("C"), name("S")
            consts[c], consts[s] = cls, svals
            got = "".join(f"{v}.{f}, " for f in static)
            lines.append(f"    if type({v}) is not {c} or ({got}) != {s}: return None")
            for f, child in zip(names, children):
                node(f"{v}.{f}", child)
            return
        kind = {"dict": "dict", "list": "list", "tuple": "tuple"}[tag]
        lines.append(f"    if not isinstance({v}, {kind}) or len({v}) != {len(td[2])}: return None")
        keys = td[1] if tag == "dict" else range(td[1])
        for k, child in zip(keys, td[2]):
            node(f"{v}[{k!r}]", child)

    for i, td in enumerate(treedefs):
        node(f"args[{i}]", td)
    lines.append(f"    return [{', '.join(leaves)}]")
    ns = dict(consts)
    exec("\n".join(lines), ns)         # noqa: S102 (source built above from the treedef only)
    return ns["access"]
