"""FUSED: a recipe of primitive steps over transient scratch, bit-identical to the unfused ops.

``params['recipe']`` is ``{"steps": [step, ...]}``; each step is::

    {"op": <int opcode>,                 # any opcode but FUSED
     "args": [{"in": k} | {"s": j}, ...], # inputs[k] or scratch j written by an earlier step
     "out": j | "final" | -1 | {"o": k}, # scratch j, outputs[0], or outputs[k] (ext)
     "params": {...},                    # the primitive op's params
     "out_shape": [...], "out_dtype": "bfloat16"}   # scratch shape/dtype (default: like args[0])

Scratch is zero-initialised, so even a partial write is deterministic; bit-identity with the
unfused sequence holds when each scratch has the shape and dtype of the unfused intermediate
buffer (that is why the recipe carries them). A step that writes an existing scratch slot of the
same shape and dtype writes into it (ext: sibling column tiles can fill one scratch); otherwise
the slot gets a fresh zeroed tensor, as in the seed. Every output must be written by some step.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from amk.errors import ValidationError
from amk.program.ir import DType, InstructionKind

# Recipe dtypes are data: an allowlist (seed names plus AMK's DType short names), never getattr.
RECIPE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int8": torch.int8, "int32": torch.int32,
    **{d.short: d.torch for d in (DType.F32, DType.F16, DType.BF16, DType.I32, DType.I8, DType.U8)},
}


def _output_index(out: Any) -> int | None:
    """The output a step's ``out`` names, or None for a scratch slot."""
    if out == "final" or (isinstance(out, int) and not isinstance(out, bool) and out == -1):
        return 0
    if isinstance(out, dict) and set(out) == {"o"}:
        return out["o"]
    return None


def _is_index(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate_recipe(recipe: Any, n_inputs: int, n_outputs: int = 1) -> list[str]:
    """Structural check of a FUSED recipe; returns every error found ([] when well formed)."""
    if not isinstance(recipe, dict):
        return [f"recipe must be a dict with a 'steps' list, got {type(recipe).__name__}"]
    steps = recipe.get("steps")
    if not isinstance(steps, (list, tuple)) or not steps:
        return ["recipe.steps must be a non-empty list"]
    errs: list[str] = []
    scratch: set[int] = set()
    written: set[int] = set()
    for i, st in enumerate(steps):
        if not isinstance(st, dict):
            errs.append(f"step {i}: must be a dict, got {type(st).__name__}")
            continue
        try:
            op = InstructionKind(int(st.get("op")))
        except (TypeError, ValueError):
            errs.append(f"step {i}: unknown op {st.get('op')!r}")
            op = None
        if op is InstructionKind.FUSED:
            errs.append(f"step {i}: nested FUSED is not allowed")
        args = st.get("args", [])
        if not isinstance(args, (list, tuple)):
            errs.append(f"step {i}: args must be a list, got {args!r}")
            args = []
        for a in args:
            if not (isinstance(a, dict) and len(a) == 1):
                errs.append(f"step {i}: arg must be {{'in': k}} or {{'s': j}}, got {a!r}")
            elif "in" in a:
                if not (_is_index(a["in"]) and 0 <= a["in"] < n_inputs):
                    errs.append(f"step {i}: input index {a['in']!r} out of range [0, {n_inputs})")
            elif "s" in a:
                if a["s"] not in scratch:
                    errs.append(f"step {i}: reads scratch {a['s']!r} not written by an earlier step")
            else:
                errs.append(f"step {i}: arg must be {{'in': k}} or {{'s': j}}, got {a!r}")
        out = st.get("out")
        k = _output_index(out)
        if k is not None:
            if not (_is_index(k) and 0 <= k < n_outputs):
                errs.append(f"step {i}: output index {k!r} out of range [0, {n_outputs})")
            else:
                written.add(k)
        elif _is_index(out) and out >= 0:
            if st.get("out_shape") is None and not args:
                errs.append(f"step {i}: scratch {out} needs out_shape (the step has no args)")
            scratch.add(out)
        else:
            errs.append(f"step {i}: out must be a scratch index j >= 0, 'final' or {{'o': k}}, "
                        f"got {out!r}")
        shape = st.get("out_shape")
        if shape is not None and not (isinstance(shape, (list, tuple))
                                      and all(_is_index(d) and d >= 0 for d in shape)):
            errs.append(f"step {i}: out_shape must be a list of non-negative ints, got {shape!r}")
        od = st.get("out_dtype")
        if od is not None and od not in RECIPE_DTYPES:
            errs.append(f"step {i}: out_dtype {od!r} not in the allowlist {sorted(RECIPE_DTYPES)}")
        if not isinstance(st.get("params", {}), dict):
            errs.append(f"step {i}: params must be a dict")
    missing = sorted(set(range(n_outputs)) - written)
    if missing:
        errs.append(f"recipe never writes output(s) {missing} (a step needs out 'final' or "
                    f"{{'o': k}})")
    return errs


def check_recipe(recipe: Any, n_inputs: int, n_outputs: int, ctx=None) -> None:
    """Raise ValidationError for a malformed recipe; remembers good ones in ``ctx.validated``."""
    cache = getattr(ctx, "validated", None)
    key = (id(recipe), n_inputs, n_outputs)
    if cache is not None and key in cache and cache[key] is recipe:
        return
    errs = validate_recipe(recipe, n_inputs, n_outputs)
    if errs:
        raise ValidationError("malformed FUSED recipe:\n  " + "\n  ".join(errs)
                              + "\nfix the fusion pass that built it (see semantics_fused.py)")
    if cache is not None:
        cache[key] = recipe           # holding the recipe keeps its id from being reused


def run_recipe(recipe, inputs, outputs, ctx, semantics_for: Callable) -> None:
    check_recipe(recipe, len(inputs), len(outputs), ctx)
    scratch: dict[int, torch.Tensor] = {}
    for st in recipe["steps"]:
        args = [inputs[a["in"]] if "in" in a else scratch[a["s"]] for a in st.get("args", [])]
        k = _output_index(st["out"])
        if k is not None:
            target = outputs[k]
        else:
            od = st.get("out_dtype")
            dtype = RECIPE_DTYPES[od] if od else args[0].dtype
            shape = st.get("out_shape")
            device = args[0].device if args else outputs[0].device
            shape = tuple(shape) if shape is not None else tuple(args[0].shape)
            target = scratch.get(st["out"])
            if target is None or tuple(target.shape) != shape or target.dtype != dtype:
                target = torch.zeros(shape, dtype=dtype, device=device)
                scratch[st["out"]] = target
        semantics_for(st["op"])(args, [target], st.get("params", {}), ctx)
