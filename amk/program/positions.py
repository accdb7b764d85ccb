"""Which tasks read a block of positions (a prompt chunk: int32 pos [T], row t at pos[t]).

A backend that implements only one position per step (the CUDA megakernel reads pos[0]) must
refuse such a program rather than run it wrong; `block_position_tasks` finds them, FUSED
recipes included.
"""
from __future__ import annotations

from amk.program.ir import InstructionKind as K, Program, Task
from amk.program.recipe import INPUT, RecipeError, parse_recipe

POS_ARG = {K.ROPE: 1, K.KV_APPEND: 1, K.ATTENTION_TILE: 3}   # input index of the position


def _pos_inputs(task: Task) -> list[int]:
    """The buffer id of every runtime position this task (or its recipe's steps) reads."""
    if task.op in POS_ARG:
        i = POS_ARG[task.op]
        seed_pos = task.op is K.KV_APPEND and "pos" in task.params    # the seed's static pos
        return [task.inputs[i]] if len(task.inputs) > i and not seed_pos else []
    if task.op is not K.FUSED:
        return []
    try:
        steps = parse_recipe(task.params.get("recipe")).steps
    except RecipeError:      # a malformed recipe is the validator's to report
        return []
    found = []
    for st in steps:
        i = POS_ARG.get(st.op)
        if i is None or (st.op is K.KV_APPEND and "pos" in st.params) or len(st.args) <= i:
            continue
        if st.args[i].kind == INPUT:
            found.append(task.inputs[st.args[i].index])
    return found


def block_position_tasks(program: Program) -> list[Task]:
    """The tasks that read a position input of more than one element."""
    return [t for t in program.tasks
            if any(program.buffers[b].numel > 1 for b in _pos_inputs(t))]
