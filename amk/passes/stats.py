"""program_stats: the numbers `amk ir --stats` prints (and tests and benchmarks compare)."""
from __future__ import annotations

from collections import Counter as Tally

from amk.passes.options import H200, Target
from amk.passes.place import placement_balance
from amk.program.ir import BufferKind, Program


def program_stats(program: Program, target: Target = H200) -> dict:
    acts = [b for b in program.buffers if b.kind is BufferKind.ACTIVATION]
    ops = Tally(t.op.name for t in program.tasks)
    return {
        "tasks": len(program.tasks),
        "counters": len(program.counters),
        "buffers": len(program.buffers),
        "activation_buffers": len(acts),
        "activation_bytes": sum(b.nbytes for b in acts),
        "waits": sum(len(t.waits) for t in program.tasks),
        "queues": len(program.queues),
        "balance": round(placement_balance(program, target), 4) if program.queues else None,
        "ops": dict(sorted(ops.items())),
    }


def stats_line(program: Program, target: Target = H200) -> str:
    s = program_stats(program, target)
    bal = f" balance={s['balance']:.3f}" if s["balance"] is not None else ""
    ops = ",".join(f"{k.lower()}:{v}" for k, v in s["ops"].items())
    return (f"{program.name}: tasks={s['tasks']} counters={s['counters']} buffers={s['buffers']} "
            f"activations={s['activation_bytes'] / 1024:.1f}KiB waits={s['waits']} "
            f"queues={s['queues']}{bal} ops[{ops}]")
