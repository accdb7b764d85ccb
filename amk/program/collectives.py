"""Cross-rank collectives in a Program: ALLREDUCE_SHARD tasks with rank/world params.

ALLREDUCE_SHARD without them is the seed's single-device sum of its input shards. With
``rank`` and ``world`` (**ext**, tensor parallelism) it has ONE input, this rank's part, and
every one of the ``world`` ranks' programs holds a matching task (the k-th collective of each
program pairs with the k-th of every other). ``reduce`` says what they compute:

  "sum"    (default) out = x_0 + x_1 + ... + x_{world-1}, in fp32, in rank order, cast once;
  "maxloc" x is rank r's vocab slice [B, N] of logits [B, world*N]; out int32 [B] = the global
           argmax, the lowest index on ties (each rank's local max and index, then the max
           over ranks, the lowest rank on ties: MPI's MAXLOC).
"""
from __future__ import annotations

from amk.program.ir import InstructionKind as K, Program, Task

SUM, MAXLOC = "sum", "maxloc"
REDUCTIONS = (SUM, MAXLOC)


def is_collective(task: Task) -> bool:
    return task.op == K.ALLREDUCE_SHARD and "world" in task.params


def reduction(task: Task) -> str:
    return task.params.get("reduce", SUM)


def collective_tasks(program: Program) -> list[Task]:
    """The program's cross-rank collectives in task order (the order ranks match them in)."""
    return [t for t in program.tasks if is_collective(t)]
