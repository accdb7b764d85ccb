"""Which tasks read a block of positions (a prompt chunk: int32 pos [T], row t at pos[t]).

A backend that implements only one position per sequence (the CUDA megakernel: pos[0], or
pos[b] for sequence b of a batch with a cache per sequence) must refuse a prompt chunk rather
than run it wrong; `prompt_block_tasks` finds the tasks that read or write one sequence's cache
at several positions, FUSED recipes included.
"""
from __future__ import annotations

from amk.program.ir import InstructionKind as K, Program, Task
from amk.program.recipe import INPUT, OUTPUT, RecipeError, parse_recipe

POS_ARG = {K.ROPE: 1, K.KV_APPEND: 1, K.ATTENTION_TILE: 3}   # input index of the position


def _pos_reads(task: Task) -> list[tuple[int, int | None]]:
    """(position buffer id, cache buffer id or None) of every runtime position this task (or
    its recipe's steps) reads: the cache a KV_APPEND writes or an ATTENTION_TILE reads (None
    for a ROPE, or a cache in scratch)."""
    if task.op in POS_ARG:
        i = POS_ARG[task.op]
        seed_pos = task.op is K.KV_APPEND and "pos" in task.params    # the seed's static pos
        if len(task.inputs) <= i or seed_pos:
            return []
        cache = {K.KV_APPEND: task.outputs[0] if task.outputs else None,
                 K.ATTENTION_TILE: task.inputs[1]}.get(task.op)
        return [(task.inputs[i], cache)]
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
            cache = None
            if st.op is K.KV_APPEND and st.out.kind == OUTPUT:
                cache = task.outputs[st.out.index]
            elif st.op is K.ATTENTION_TILE and st.args[1].kind == INPUT:
                cache = task.inputs[st.args[1].index]
            found.append((task.inputs[st.args[i].index], cache))
    return found


def prompt_block_tasks(program: Program) -> list[Task]:
    """The tasks that append to or attend over one cache at several positions: a position
    input of n > 1 elements with a cache that is not one per position ([n, max_seq, ...])."""
    bufs = program.buffers

    def one_sequence(pos: int, cache: int | None) -> bool:
        n = bufs[pos].numel
        return n > 1 and cache is not None and not (
            len(bufs[cache].shape) == 4 and bufs[cache].shape[0] == n)
    return [t for t in program.tasks if any(one_sequence(p, c) for p, c in _pos_reads(t))]
