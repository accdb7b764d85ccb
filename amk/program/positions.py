"""Which tasks read a block of positions (a prompt chunk: int32 pos [T], row t at pos[t]).

A backend that implements only one position per step (the CUDA megakernel reads pos[0]) must
refuse such a program rather than run it wrong; `block_position_tasks` finds them, FUSED
recipes included.
"""
from __future__ import annotations

from amk.program.ir import InstructionKind as K, Program, Task

POS_ARG = {K.ROPE: 1, K.KV_APPEND: 1, K.ATTENTION_TILE: 3}   # input index of the position


def _reads_block(op: K, pos_buffer: int | None, program: Program) -> bool:
    return pos_buffer is not None and program.buffers[pos_buffer].numel > 1


def _pos_inputs(task: Task) -> list[tuple[K, int]]:
    """(op, input buffer id) of every position this task (or its recipe's steps) reads."""
    if task.op in POS_ARG:
        i = POS_ARG[task.op]
        return [(task.op, task.inputs[i])] if len(task.inputs) > i else []
    if task.op is not K.FUSED:
        return []
    found = []
    for st in (task.params.get("recipe") or {}).get("steps", ()):
        try:
            op = K(int(st.get("op")))
        except (TypeError, ValueError):
            continue
        args = st.get("args") or ()
        i = POS_ARG.get(op)
        if i is not None and len(args) > i and "in" in args[i]:
            found.append((op, task.inputs[args[i]["in"]]))
    return found


def block_position_tasks(program: Program) -> list[Task]:
    """The tasks that read a position input of more than one element."""
    return [t for t in program.tasks
            if any(_reads_block(op, b, program) for op, b in _pos_inputs(t))]
