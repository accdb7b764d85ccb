"""FUSED: a recipe of primitive steps over transient scratch, bit-identical to the unfused ops.

The recipe (amk/program/recipe.py) is run step by step with the primitive ops' semantics.
Scratch is zero-initialised, so even a partial write is deterministic; bit-identity with the
unfused sequence holds when each scratch has the shape and dtype of the unfused intermediate
buffer (that is why the recipe carries them). A step that writes an existing scratch slot of the
same shape and dtype writes into it (ext: sibling column tiles can fill one scratch); otherwise
the slot gets a fresh zeroed tensor, as in the seed. Every output must be written by some step.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from amk.program.recipe import INPUT, OUTPUT, Recipe, checked_recipe


def check_recipe(obj: Any, n_inputs: int, n_outputs: int, ctx=None) -> Recipe:
    """The parsed recipe, or a RecipeError (a ValidationError) listing every problem; a recipe
    checked once is remembered in ``ctx.validated``."""
    cache = getattr(ctx, "validated", None)
    key = (id(obj), n_inputs, n_outputs)
    if cache is not None and key in cache and cache[key][0] is obj:
        return cache[key][1]
    recipe = checked_recipe(obj, n_inputs, n_outputs)
    if cache is not None:
        cache[key] = (obj, recipe)        # holding the object keeps its id from being reused
    return recipe


def run_recipe(obj, inputs, outputs, ctx, semantics_for: Callable) -> None:
    recipe = check_recipe(obj, len(inputs), len(outputs), ctx)
    scratch: dict[int, torch.Tensor] = {}
    for st in recipe.steps:
        args = [inputs[a.index] if a.kind == INPUT else scratch[a.index] for a in st.args]
        if st.out.kind == OUTPUT:
            target = outputs[st.out.index]
        else:
            dtype = st.out_dtype.torch if st.out_dtype is not None else args[0].dtype
            shape = st.out_shape if st.out_shape is not None else tuple(args[0].shape)
            device = args[0].device if args else outputs[0].device
            target = scratch.get(st.out.index)
            if target is None or tuple(target.shape) != shape or target.dtype != dtype:
                target = torch.zeros(shape, dtype=dtype, device=device)
                scratch[st.out.index] = target
        semantics_for(st.op)(args, [target], st.params, ctx)
