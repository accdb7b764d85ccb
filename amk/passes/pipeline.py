"""The pass pipeline: one ordered list of named passes, graph -> Program.

Every pass is a pure function of (IR, options). At debug >= 1 (AMK_DEBUG, read by amk/jit.py
and handed down) the validator runs after every pass (and timings go to stderr); it always runs
at the end. Each stage's IR can be printed or dumped (passes/dump.py) or read back from
`Lowered.stages`. Nothing here reads the environment.
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


def check(program: Program, after: str) -> None:
    from amk.program.validate import validate
    res = validate(program)
    if not res.ok:
        raise ValidationError(f"the program after pass '{after}' is invalid "
                              f"(an AMK bug: please report it with AMK_DUMP_IR output):\n"
                              f"{res.report()}", res)


def run_pipeline(graph: Graph, opts: PassOptions | None = None,
                 stop_after: str | None = None, debug: int = 0,
                 ahead: Callable[[Program], None] | None = None) -> dict[str, Program]:
    """Run the passes; returns {pass name: program after it}, in pipeline order. debug: the
    AMK_DEBUG level (1 verify and time every pass, 2 print the schedule summary). ahead: called
    with the final program before its final proof (a backend starts its compile there, to run
    beside the proof); the program is refused all the same if the proof fails."""
    opts = opts or PassOptions()
    try:
        return _run(graph, opts, stop_after, debug, ahead)
    finally:
        forget()                         # the passes' memos serve only this run


def _run(graph: Graph, opts: PassOptions, stop_after: str | None, debug: int,
         ahead: Callable[[Program], None] | None = None) -> dict[str, Program]:
    stages: dict[str, Program] = {}
    ir = graph
    for name, fn in PIPELINE:
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
                        ) -> tuple[Program, dict[str, Program] | None]:
    """(final program, every stage) — or (final program, None) when the disk cache in
    `cache_dir` had it (None: no disk cache). ahead: as run_pipeline's, on a cache miss."""
    from amk.passes import cache
    opts = opts or PassOptions()
    key = cache.cache_key(graph, opts, PIPELINE)
    program = cache.load(cache_dir, key) if cache_dir is not None else None
    if program is not None:
        remember_digest(program, "passes:" + key)
        return program, None
    def digested(program: Program) -> Program:
        if cache_dir is not None:        # the digest the disk caches key this program by
            remember_digest(program, "passes:" + key)
        return program

    stages = run_pipeline(graph, opts, debug=debug,
                          ahead=None if ahead is None else lambda p: ahead(digested(p)))
    program = digested(stages[PIPELINE[-1][0]])
    if cache_dir is not None:
        cache.store(cache_dir, key, program)
    return program, stages
