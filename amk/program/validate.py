"""`validate(program)`: a structural proof that a Program is race- and deadlock-free.

What is proved, from the program's structure alone (no execution):
  1. coverage: every column a task reads of an ACTIVATION or IO_OUTPUT buffer was written by a
     task it is guaranteed to follow;
  2. no races: two tasks that touch overlapping columns, one of them writing, are ordered;
  3. every wait threshold is reachable, at every decode step;
  4. the wait graph (and the per-SM queues, if any) admit a topological order: no deadlock;
  5. ids, arities, params, shapes and dtypes fit each opcode; read-only buffers are not written.

"B is guaranteed to follow A" means B waits on A's out-counter with a threshold that only the
completion of every incrementer can reach (threshold == init + incrementers); a smaller threshold
says nothing about which incrementers ran. Happens-before is the transitive closure of that,
kept as one ancestor bitset (a Python int) per task, built in topological order.

Races are checked on the hazard edges of amk.program.deps, computed over one sequential order
that contains happens-before: each conflicting pair is joined by a chain of those edges, so
checking the edges checks every pair. The edges come in shared groups, each checked with one
bitset operation (group & ~ancestors), so all-to-all tile patterns cost no per-edge work.
Program order must also be a legal sequential execution (ir.py's convention); that is checked
separately. The per-opcode checks (5) live in amk/program/opcode_checks.py.

Steps are serialised (one launch or VM run per step) and counters are monotonic, so a hazard
between two steps cannot happen: only hazards within one step are checked.
"""
from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from amk.errors import ValidationError
from amk.gcpause import without_gc
from amk.identity_memo import IdentityMemo
from amk.program.deps import RAW, WAR, WAW, scan_all
from amk.program.ir import Buffer, BufferKind, Program, Task
from amk.program.opcode_checks import READ_ONLY, _b, _t, check_opcode
from amk.program.regions import Region, buffer_rows, task_regions


@dataclass(frozen=True)
class ValidationIssue:
    kind: str
    message: str
    task: int | None = None
    buffer: int | None = None
    counter: int | None = None

    def __str__(self) -> str:
        return f"[{self.kind}] {self.message}"


@dataclass
class ValidationResult:
    program: str = "program"
    errors: list[ValidationIssue] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def report(self) -> str:
        if self.ok:
            return f"program '{self.program}': valid"
        lines = [f"program '{self.program}': {len(self.errors)} error(s)"]
        lines += [f"  {i + 1}. {e}" for i, e in enumerate(self.errors)]
        return "\n".join(lines)

    def raise_if_invalid(self) -> None:
        if not self.ok:
            raise ValidationError(self.report() + "\nfix the pass that built this program "
                                  "(dump it with AMK_DUMP_IR=DIR to see every stage)", self)

    def __str__(self) -> str:
        return self.report()


MUST_BE_WRITTEN = (BufferKind.ACTIVATION, BufferKind.IO_OUTPUT)   # no value before the step


# ---------------------------------------------------------------------------------------------
# The proof
# ---------------------------------------------------------------------------------------------
def _check_ids(prog: Program, err) -> None:
    nb, nc, nt = len(prog.buffers), len(prog.counters), len(prog.tasks)
    for i, b in enumerate(prog.buffers):
        if b.id != i:
            err("ids", f"buffer at index {i} ('{b.name}') has id {b.id}; ids must be dense", buffer=i)
        if any(not isinstance(s, int) or s < 1 for s in b.shape):
            err("ids", f"buffer {_b(b)} has a bad shape {list(b.shape)}", buffer=i)
    for i, c in enumerate(prog.counters):
        if c.id != i:
            err("ids", f"counter at index {i} has id {c.id}; ids must be dense", counter=i)
    for i, t in enumerate(prog.tasks):
        if t.id != i:
            err("ids", f"task at index {i} ({t.op.name} {t.name}) has id {t.id}; ids must be "
                f"dense and equal to the position in program.tasks", task=i)
        for role, bids in (("input", t.inputs), ("output", t.outputs)):
            for b in bids:
                if not (isinstance(b, int) and 0 <= b < nb):
                    err("ids", f"{_t(t)} names {role} buffer {b!r}, which does not exist "
                        f"(program has {nb} buffers)", task=i)
        for w in t.waits:
            if not (isinstance(w.counter, int) and 0 <= w.counter < nc):
                err("ids", f"{_t(t)} waits on counter {w.counter!r}, which does not exist", task=i)
        if not (isinstance(t.out_counter, int) and 0 <= t.out_counter < nc):
            err("ids", f"{_t(t)} increments counter {t.out_counter!r}, which does not exist", task=i)
    for b in prog.outputs:
        if not (isinstance(b, int) and 0 <= b < nb):
            err("ids", f"program output {b!r} is not a buffer id")
    for q, queue in enumerate(prog.queues):
        for t in queue:
            if not (isinstance(t, int) and 0 <= t < nt):
                err("queue", f"queue {q} lists task {t!r}, which does not exist")


def _topological(n_tasks: int, n_counters: int, incr: list[list[int]], tasks: Sequence[Task],
                 extra_succ: dict[int, list[int]] | None = None):
    """Kahn's algorithm over tasks (0..n-1) and counters (n..n+m-1). Edges: incrementer ->
    counter -> waiter (+ extra task->task edges). Returns (order of task ids, set of stuck tasks)."""
    n = n_tasks
    indeg = [0] * (n + n_counters)
    waiters: list[list[int]] = [[] for _ in range(n_counters)]
    counters_of: dict[int, tuple] = {}      # id(waits) -> (waits, its counters): tiles share
    for t in tasks:
        got = counters_of.get(id(t.waits))
        if got is None or got[0] is not t.waits:
            got = counters_of[id(t.waits)] = (t.waits, {w.counter for w in t.waits})
        indeg[t.id] = len(got[1])
        for c in got[1]:
            waiters[c].append(t.id)
    for c in range(n_counters):
        indeg[n + c] = len(incr[c])
    for a, succs in (extra_succ or {}).items():
        for s in succs:
            indeg[s] += 1
    ready = deque(i for i in range(n + n_counters) if indeg[i] == 0)
    order: list[int] = []
    while ready:
        v = ready.popleft()
        if v < n:
            order.append(v)
            succ = [n + tasks[v].out_counter] + (extra_succ or {}).get(v, [])
        else:
            succ = waiters[v - n]
        for s in succ:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    stuck = set(range(n)) - set(order)
    return order, stuck


def _forward(tasks: Sequence[Task], incr: list[list[int]]) -> bool:
    """Every wait names a counter whose incrementers all come before the waiter in program
    order (what allocate_counters builds). Then program order is a topological order of the
    wait graph, and of the wait graph with queue edges where every queue ascends: what
    _topological would find, without its walk."""
    last = [max(ids) if ids else -1 for ids in incr]
    seen: dict[int, tuple] = {}                 # id(waits) -> (waits, its latest incrementer)
    for t in tasks:
        got = seen.get(id(t.waits))
        if got is None or got[0] is not t.waits:
            got = seen[id(t.waits)] = (t.waits, max((last[w.counter] for w in t.waits),
                                                    default=-1))
        if got[1] >= t.id:
            return False
    return True


def _cycles(stuck: set[int], tasks: Sequence[Task], incr: list[list[int]],
            extra_pred: dict[int, list[int]] | None = None) -> list[list[int]]:
    """Cycles among stuck tasks: walk back through stuck predecessors until a repeat."""
    seen: set[int] = set()
    cycles = []
    for start in sorted(stuck):
        if start in seen:
            continue
        path: list[int] = []
        on_path: dict[int, int] = {}
        v = start
        while v not in seen:
            seen.add(v)
            on_path[v] = len(path)
            path.append(v)
            preds = [u for w in tasks[v].waits for u in incr[w.counter] if u in stuck]
            preds += [u for u in (extra_pred or {}).get(v, []) if u in stuck]
            if not preds:
                break
            v = preds[0]
        if v in on_path:
            cyc = list(reversed(path[on_path[v]:]))     # in execution order: u waits for ...
            k = cyc.index(min(cyc))
            cycles.append(cyc[k:] + cyc[:k])            # start at the smallest id (stable text)
    return cycles


# Proofs already done, by program object: a Program is immutable, so the pipeline's final check
# also serves the backend that loads it (and a program read back from the disk cache, which was
# proved before it was written, is remembered as proved).
_PROVEN: dict[int, ValidationResult] = {}


def remember(program: Program, result: ValidationResult) -> None:
    key = id(program)
    if key not in _PROVEN:
        _PROVEN[key] = result
        weakref.finalize(program, _PROVEN.pop, key, None)


def validate(program: Program) -> ValidationResult:
    """Prove `program` race- and deadlock-free from its structure; every error is listed."""
    hit = _PROVEN.get(id(program))
    if hit is None:
        hit = _validate(program)
        remember(program, hit)
    return hit


@without_gc
def _validate(program: Program) -> ValidationResult:
    res = ValidationResult(program.name)

    def err(kind, message, task=None, buffer=None, counter=None):
        res.errors.append(ValidationIssue(kind, message, task, buffer, counter))

    _check_ids(program, err)
    if res.errors:      # later checks index by these ids
        err("ids", "structural analysis skipped until the ids above are fixed")
        return res
    bufs, tasks, counters = program.buffers, program.tasks, program.counters
    n, m = len(tasks), len(counters)

    # (5) opcodes, regions, read-only buffers
    regions: list[tuple[list[Region], list[Region]]] = []
    checked = IdentityMemo()                 # check_opcode's, once per FUSED recipe
    for t in tasks:
        for msg in check_opcode(t, bufs, checked):
            err("opcode", f"{_t(t)}: {msg}", task=t.id)
        try:
            rw = task_regions(t, bufs)
        except Exception as e:  # a malformed task already reported above; do not crash on it
            err("opcode", f"{_t(t)}: cannot tell which columns it touches ({e!r})", task=t.id)
            rw = ([], [])
        regions.append(rw)
        for r in rw[1]:
            b = bufs[r.buffer]
            if b.kind in READ_ONLY:
                err("readonly", f"{_t(t)} writes {b.kind.name} buffer {_b(b)}, which is read "
                    f"only", task=t.id, buffer=b.id)

    # (3) thresholds: reachable at step 1 (init + incrementers) and at every later step,
    # where the wait is counter >= threshold * epoch and the counter gains `incrementers` a step.
    incr: list[list[int]] = [[] for _ in range(m)]
    for t in tasks:
        incr[t.out_counter].append(t.id)
    for t in tasks:
        for w in t.waits:
            c, k = counters[w.counter], len(incr[w.counter])
            if w.threshold < 1:
                err("threshold", f"{_t(t)} waits c{c.id} >= {w.threshold}: thresholds must be "
                    f">= 1 (drop a wait that is always true)", task=t.id, counter=c.id)
            elif w.threshold > c.init + k:
                err("threshold", f"{_t(t)} waits c{c.id} >= {w.threshold}, but c{c.id} starts at "
                    f"{c.init} and only {k} task(s) increment it: never reached (deadlock)",
                    task=t.id, counter=c.id)
            elif w.threshold > k:
                err("threshold", f"{_t(t)} waits c{c.id} >= {w.threshold} with only {k} "
                    f"incrementer(s): reached at step 1 thanks to init={c.init}, but step e "
                    f"needs {w.threshold}*e and the counter gains only {k} a step (deadlock at "
                    f"step 2)", task=t.id, counter=c.id)

    # (4) the wait graph is acyclic
    forward = _forward(tasks, incr)
    order, stuck = (list(range(n)), set()) if forward else _topological(n, m, incr, tasks)
    cycles = _cycles(stuck, tasks, incr)
    for cyc in cycles:
        names = " -> ".join(f"t{i}" for i in cyc + cyc[:1])
        err("cycle", f"wait cycle (deadlock): {names}; "
            + "; ".join(_t(tasks[i]) for i in cyc), task=cyc[0])
    if stuck and not cycles:
        err("cycle", f"{len(stuck)} task(s) can never start: {sorted(stuck)[:16]}")

    # program order must be a legal sequential execution (the race proof below relies on it)
    order_is_legal = not stuck
    if not stuck:
        value = [c.init for c in counters]
        for t in tasks:
            for w in t.waits:
                if value[w.counter] < w.threshold <= counters[w.counter].init + len(incr[w.counter]):
                    order_is_legal = False
                    err("order", f"{_t(t)} comes before enough incrementers of c{w.counter} in "
                        f"program order (waits >= {w.threshold}, {value[w.counter]} before it): "
                        f"program order must be a legal execution", task=t.id, counter=w.counter)
            value[t.out_counter] += 1

    # per-SM queues: each task exactly once, and all queues consistent with one topological order
    if program.queues:
        _check_queues(program, incr, stuck, err, forward)

    # happens-before: ancestor bitsets in topological order (stuck tasks never run; skipped)
    anc = [0] * n
    full: list[int | None] = [None] * m     # everything that precedes c's last increment

    def counter_closure(c: int) -> int:
        v = full[c]
        if v is None:
            v = 0
            for i in incr[c]:
                v |= anc[i] | (1 << i)
            full[c] = v
        return v

    by_waits: dict[tuple, int] = {}      # the same waits, the same ancestors: one int object
    for t_id in order:
        t = tasks[t_id]
        a = by_waits.get(t.waits)
        if a is None:
            a = 0
            for w in t.waits:
                if w.threshold >= counters[w.counter].init + len(incr[w.counter]):
                    a |= counter_closure(w.counter)
            by_waits[t.waits] = a
        anc[t_id] = a

    # (1) + (2) coverage and races, over the hazard edges of a sequential order that contains
    # happens-before: program order if it is legal, else the topological order (stuck tasks
    # never run and are left out). Every conflicting pair is joined by a chain of hazard edges,
    # so if every edge is ordered by happens-before, so is every pair, whatever the order.
    scan_order = range(n) if order_is_legal else order
    scanned = [tasks[i] for i in scan_order]
    mask_cache: dict[int, tuple[object, int]] = {}     # id(shared group) -> (group, bitset)

    def mask_of(group) -> int:
        hit = mask_cache.get(id(group))
        if hit is not None and hit[0] is group:
            return hit[1]
        m = 0
        for i in group:
            m |= 1 << i
        if isinstance(group, frozenset):
            mask_cache[id(group)] = (group, m)
        return m

    conflicts, unwritten = scan_all(bufs, scanned, [regions[i] for i in scan_order])
    # the tiles of one op share their ancestors (by_waits) and the groups they conflict with:
    # one bitset operation per (ancestors, group) pair; both objects live until the end
    unordered: dict[tuple[int, int], int] = {}
    for b, found in zip(scanned, conflicts):
        a = anc[b.id]
        for kind, buffer, lo, hi, group, mask in found:
            key = (id(a), id(group))
            bad = unordered.get(key)
            if bad is None:
                bad = unordered[key] = (mask_of(group) if mask is None else mask) & ~a
            if bad:
                _report_conflict(err, b, kind, bufs[buffer], lo, hi, bad, tasks, counters, incr)
    for t_id, r in unwritten:
        buf = bufs[r.buffer]
        if buf.kind in MUST_BE_WRITTEN:
            rows = "" if r.every_row else f"row {r.r0} " if r.r1 == r.r0 + 1 else f"rows [{r.r0}, {r.r1}) "
            err("coverage", f"{_t(tasks[t_id])} reads {_b(buf)} {rows}cols [{r.lo}, {r.hi}) that "
                f"no earlier task writes ({buf.kind.name} holds nothing before the step)",
                task=t_id, buffer=buf.id)
    _check_outputs_written(program, regions, err)
    return res


def _check_outputs_written(program: Program, regions, err) -> None:
    """Every column of a returned ACTIVATION/IO_OUTPUT buffer is written by some task: the
    caller would otherwise read whatever the buffer held."""
    wanted = {b for b in program.outputs if program.buffers[b].kind in MUST_BE_WRITTEN}
    spans: dict[int, list[Region]] = {b: [] for b in wanted}
    for _, writes in regions:
        for r in writes:
            if r.buffer in spans:
                spans[r.buffer].append(r)
    for b in sorted(wanted):
        buf = program.buffers[b]
        by_row = any(not r.every_row for r in spans[b])
        for row in range(buffer_rows(buf)) if by_row else (None,):
            cols = sorted((r.lo, r.hi) for r in spans[b] if row is None or r.r0 <= row < r.r1)
            covered, gap_end = 0, None
            for lo, hi in cols:
                if lo > covered:
                    gap_end = lo
                    break
                covered = max(covered, hi)
            if covered < buf.cols:
                end = gap_end if gap_end is not None else buf.cols
                where = "" if row is None else f"row {row} "
                err("coverage", f"output {_b(buf)} {where}cols [{covered}, {end}) are never "
                    f"written: the caller would read stale memory", buffer=b)
                break


def _report_conflict(err, b: Task, kind: str, buf: Buffer, lo: int, hi: int, bad: int,
                     tasks, counters, incr) -> None:
    """One error for task b and the earlier tasks (bits of `bad`) it is not ordered after."""
    offenders = []
    rest = bad
    while rest and len(offenders) < 4:
        low = rest & -rest
        offenders.append(low.bit_length() - 1)
        rest ^= low
    more = bin(rest).count("1")
    names = ", ".join(_t(tasks[i]) for i in offenders) + (f" and {more} more" if more else "")
    a = tasks[offenders[0]]
    cols = f"cols [{lo}, {hi})"
    hint = (f"make t{b.id} wait on c{a.out_counter} with threshold "
            f"{counters[a.out_counter].init + len(incr[a.out_counter])} (all its incrementers) "
            f"or on something that does")
    if kind == RAW and buf.kind in MUST_BE_WRITTEN:
        err("coverage", f"{_t(b)} reads {_b(buf)} {cols} written by {names}, which it is not "
            f"guaranteed to follow; {hint}", task=b.id, buffer=buf.id)
    else:
        what = {RAW: "reads {b} {c}, written by {a}", WAR: "overwrites {b} {c}, read by {a}",
                WAW: "overwrites {b} {c}, written by {a}"}[kind]
        err("race", f"{_t(b)} " + what.format(b=_b(buf), c=cols, a=names)
            + f", and they may run at the same time ({kind}); {hint}", task=b.id, buffer=buf.id)


def _check_queues(program: Program, incr, stuck, err, forward: bool = False) -> None:
    tasks = program.tasks
    where: dict[int, int] = {}
    for q, queue in enumerate(program.queues):
        for t in queue:
            if t in where:
                err("queue", f"t{t} is listed twice (queues {where[t]} and {q})", task=t)
            where[t] = q
    missing = [t.id for t in tasks if t.id not in where]
    if missing:
        err("queue", f"{len(missing)} task(s) are in no queue: {missing[:16]}", task=missing[0])
    if stuck or (forward and all(a < b for queue in program.queues
                                 for a, b in zip(queue, queue[1:]))):
        return          # (forward: program order is a topological order of waits and queues)
    succ: dict[int, list[int]] = {}
    pred: dict[int, list[int]] = {}
    for queue in program.queues:
        for a, b in zip(queue, queue[1:]):
            succ.setdefault(a, []).append(b)
            pred.setdefault(b, []).append(a)
    _, q_stuck = _topological(len(tasks), len(program.counters), incr, tasks, succ)
    for cyc in _cycles(q_stuck, tasks, incr, pred):
        names = " -> ".join(f"t{i}" for i in cyc + cyc[:1])
        err("queue", f"queue order contradicts the waits (per-SM deadlock): {names}; an SM "
            f"runs its queue in order, so t{cyc[0]} waits for a task queued behind it; "
            "order every queue by one topological order of the waits", task=cyc[0])
