"""The pass pipeline: one ordered list of named passes, graph -> Program.

Every pass is a pure function of (IR, options). At debug >= 1 (AMK_DEBUG, read by amk/jit.py
and handed down) the validator runs after every pass (and timings go to stderr); it always runs
at the end. Each stage's IR can be printed or dumped (passes/dump.py) or read back from
`Lowered.stages`. Nothing here reads the environment.

A compile (run_pipeline_cached) runs the passes up to STAMPED_UPTO on three blocks of a step
whose blocks repeat (a decoder's layers) and stamps the middle one for the others
(passes/stamp.py: the same program, in a fraction of the time); with enough blocks, it stamps
that small program for six blocks, runs the passes up to PERIODIC_UPTO there and stamps those
blocks for the others (passes/stamp_period.py); the rest on the whole program.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable

from amk.errors import ValidationError
from amk.gcpause import without_gc
from amk.graph import Graph
from amk.passes.allocate_counters import allocate_counters
from amk.passes.defer_kv_append import defer_kv_append
from amk.passes.fuse import fuse
from amk.passes.lower import lower
from amk.passes.options import PassOptions
from amk.passes.place import place
from amk.passes.plan_memory import plan_memory
from amk.passes.split_kv import split_kv
from amk.passes.stamp import stamped
from amk.passes.stamp_period import stamped_periodic
from amk.passes.sync import forget
from amk.passes.tile import tile
from amk.program.digest import remember_digest
from amk.program.ir import Program


# The whole pipeline, in order. `lower` takes the graph; every other pass takes a Program.
PIPELINE: list[tuple[str, Callable]] = [
    ("lower", lower),
    ("tile", tile),
    ("defer_kv_append", defer_kv_append),
    ("split_kv", split_kv),
    ("fuse", fuse),
    ("plan_memory", plan_memory),
    ("allocate_counters", allocate_counters),
    ("place", place),
]
# The passes up to this one decide each task from the tasks near it, never from how many blocks
# there are: stamp.py runs them on three blocks of a repeating step
STAMPED_UPTO = "fuse"
# These share buffers and counters across blocks, the same way every block or every other:
# stamp_period.py runs them on six blocks
PERIODIC_UPTO = "allocate_counters"


def check(program: Program, after: str) -> None:
    from amk.program.validate import validate
    res = validate(program)
    if not res.ok:
        raise ValidationError(f"the program after pass '{after}' is invalid "
                              f"(an AMK bug: please report it with AMK_DUMP_IR output):\n"
                              f"{res.report()}", res)


def run_pipeline(graph: Graph, opts: PassOptions | None = None,
                 stop_after: str | None = None, debug: int = 0,
                 ahead: Callable[[Program], None] | None = None,
                 stamp: bool = False) -> dict[str, Program]:
    """Run the passes; returns {pass name: program after it}, in pipeline order. debug: the
    AMK_DEBUG level (1 verify and time every pass, 2 print the schedule summary). ahead: called
    with the final program before its final proof (a backend starts its compile there, to run
    beside the proof); the program is refused all the same if the proof fails. stamp: the
    passes up to STAMPED_UPTO (PERIODIC_UPTO where they fit) stamped where the graph repeats
    (not at debug >= 1, which checks every pass); their stages are then missing from the
    result."""
    opts = opts or PassOptions()
    try:
        return _run(graph, opts, stop_after, debug, ahead, stamp and debug < 1)
    finally:
        forget()                         # the passes' memos serve only this run


def _run(graph: Graph, opts: PassOptions, stop_after: str | None, debug: int,
         ahead: Callable[[Program], None] | None = None,
         stamp: bool = False) -> dict[str, Program]:
    stages: dict[str, Program] = {}
    ir = graph
    passes = PIPELINE
    names = [n for n, _ in PIPELINE]
    local, upto = names.index(STAMPED_UPTO) + 1, names.index(PERIODIC_UPTO) + 1
    if stamp and stop_after is None:
        fns = [fn for _, fn in PIPELINE]
        small = stamped_periodic(graph, opts, fns[:local], fns[local:upto])
        if small is not None:
            ir, passes = small, PIPELINE[upto:]
        elif (small := stamped(graph, opts, fns[:local])) is not None:
            ir, passes = small, PIPELINE[local:]
    for name, fn in passes:
        t0 = time.perf_counter()
        ir = fn(ir, opts)
        dt = time.perf_counter() - t0
        stages[name] = ir
        if debug >= 1:
            check(ir, name)
            print(f"[amk] {graph.name}: {name:<18} {dt * 1e3:8.1f} ms  "
                  f"{len(ir.tasks)} tasks, {len(ir.counters)} counters, {len(ir.buffers)} buffers",
                  file=sys.stderr)
        if name == stop_after:
            break
    if ahead is not None and stop_after is None:
        ahead(ir)
    if debug < 1:
        check(ir, name)
    if debug >= 2:                       # the schedule summary
        from amk.passes.stats import stats_line
        print(f"[amk] schedule: {stats_line(ir, opts.target)}", file=sys.stderr)
    return stages


@without_gc      # between the passes too: collections over the heap they build cost seconds
def run_pipeline_cached(graph: Graph, opts: PassOptions | None = None,
                        cache_dir: Path | None = None, debug: int = 0,
                        ahead: Callable[[Program], None] | None = None
                        ) -> tuple[Program, dict[str, Program] | None, bool]:
    """(final program, every stage or None, whether the disk cache in `cache_dir` had it
    (None: no disk cache)). The stages are None after a cache hit or a stamped compile
    (Lowered.programs reruns the plain pipeline when asked). ahead: as run_pipeline's."""
    from amk.passes import cache
    opts = opts or PassOptions()
    key = cache.cache_key(graph, opts, PIPELINE)
    program = cache.load(cache_dir, key) if cache_dir is not None else None
    if program is not None:
        remember_digest(program, "passes:" + key)
        return program, None, True
    def digested(program: Program) -> Program:
        if cache_dir is not None:        # the digest the disk caches key this program by
            remember_digest(program, "passes:" + key)
        return program

    stages = run_pipeline(graph, opts, debug=debug,
                          ahead=None if ahead is None else lambda p: ahead(digested(p)), stamp=True)
    program = digested(stages[PIPELINE[-1][0]])
    if cache_dir is not None:
        cache.store(cache_dir, key, program)
    return program, (stages if len(stages) == len(PIPELINE) else None), False
