"""Which tasks read a block of positions (a prompt chunk: int32 pos [T], row t at pos[t]).

A backend that implements only one position per step (the CUDA megakernel reads pos[0]) must
refuse such a program rather than run it wrong; `block_position_tasks` finds them, FUSED
recipes included.
"""
from __future__ import annotations

from amk.program.ir import InstructionKind as K, Program, Task

POS_ARG = {K.ROPE: 1, K.KV_APPEND: 1, K.ATTENTION_TILE: 3}   # input index of the position


def _field(x, name: str, default=None):
    """A recipe step's field, whether the recipe is plain dicts or typed objects."""
    return x.get(name, default) if isinstance(x, dict) else getattr(x, name, default)


def _pos_inputs(task: Task) -> list[int]:
    """The buffer id of every runtime position this task (or its recipe's steps) reads."""
    if task.op in POS_ARG:
        i = POS_ARG[task.op]
        seed_pos = task.op is K.KV_APPEND and "pos" in task.params    # the seed's static pos
        return [task.inputs[i]] if len(task.inputs) > i and not seed_pos else []
    if task.op is not K.FUSED:
        return []
    found = []
    for st in _field(task.params.get("recipe") or {}, "steps", ()) or ():
        try:
            op = K(int(_field(st, "op")))
        except (TypeError, ValueError):
            continue
        args = _field(st, "args") or ()
        i = POS_ARG.get(op)
        if op is K.KV_APPEND and "pos" in (_field(st, "params") or {}):
            continue
        if i is not None and len(args) > i and isinstance(args[i], dict) and "in" in args[i]:
            found.append(task.inputs[args[i]["in"]])
    return found


def block_position_tasks(program: Program) -> list[Task]:
    """The tasks that read a position input of more than one element."""
    return [t for t in program.tasks
            if any(program.buffers[b].numel > 1 for b in _pos_inputs(t))]
