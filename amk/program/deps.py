"""Which earlier tasks each task must follow, from the regions it touches (program order).

For every buffer we keep an interval map of its columns: each segment remembers its last
writer and the readers since that write (a buffer that some region names rows of keeps, per
column segment, such a map over its rows: `_Grid`). A read depends on the last writers of its
columns (RAW); a write depends on the readers since the last write of each column (WAR) or,
where there were none, on the last writer (WAW). The readers already follow that writer, so
every conflicting pair is joined by a chain of these edges: no transitive closure is needed
for completeness.

A decode program is full of all-to-all patterns (256 tiles each reading a vector that 64 tiles
wrote), so the edges come in shared groups rather than one by one: the writers of a column range
are one frozenset shared by every reader until the next write, and readers of a whole buffer are
one list with a running bitmask. `scan` hands out those groups; `dependencies` unions them and
`validate` checks each group with one bitset operation.
"""
from __future__ import annotations

from bisect import bisect_right
from functools import partial
from typing import Collection, NamedTuple, Sequence

from amk.program.ir import Buffer, BufferKind, Program, Task
from amk.program.regions import ALL_ROWS, Region, buffer_rows, task_regions

RAW, WAR, WAW = "RAW", "WAR", "WAW"
_EMPTY: frozenset[int] = frozenset()


class Conflict(NamedTuple):
    """A task touches columns [lo, hi) of `buffer` after every task in `earlier` (kind RAW:
    it reads what they wrote; WAR: it overwrites what they read; WAW: it overwrites what they
    wrote). `mask` is the bitset of `earlier` when the scan already has it, else None."""
    kind: str
    buffer: int
    lo: int
    hi: int
    earlier: Collection[int]
    mask: int | None = None


# A Conflict from a (kind, buffer, lo, hi, earlier, mask) tuple, without the NamedTuple's
# Python-level __new__ (a scan of a 20k-task program builds ~10^5)
new_conflict = partial(tuple.__new__, Conflict)


class _Segments:
    """Sorted column segments [starts[k], starts[k+1]) of a buffer `width` wide; a
    subclass copies a segment's state when one is cut in two."""
    __slots__ = ()
    width: int
    starts: list[int]

    def _copy_segment(self, i: int) -> None:
        raise NotImplementedError

    def _split(self, x: int) -> int:
        if x >= self.width:
            return len(self.starts)
        i = bisect_right(self.starts, x) - 1
        if self.starts[i] == x:
            return i
        self.starts.insert(i + 1, x)
        self._copy_segment(i)
        return i + 1

    def span(self, lo: int, hi: int) -> tuple[int, int]:
        lo, hi = max(lo, 0), min(hi, self.width)
        if lo >= hi:
            return 0, 0
        i = self._split(lo)
        return i, self._split(hi)

    def _hi(self, k: int) -> int:
        return self.starts[k + 1] if k + 1 < len(self.starts) else self.width


class _Columns(_Segments):
    """One buffer's columns: disjoint segments [starts[k], starts[k+1]) with their last writer
    and the partial readers since; whole-buffer readers are kept once, in `full` (with running
    masks), and segment k has seen full[full_from[k]:] since its last write."""
    __slots__ = ("width", "starts", "writer", "readers", "full_from", "full", "memo", "full_memo",
                 "masks")

    def __init__(self, width: int, masks: bool):
        self.width = max(width, 1)
        self.starts = [0]
        self.writer = [-1]
        self.readers: list[list[int]] = [[]]
        self.full_from = [0]
        self.full: list[int] = []
        self.memo: dict[tuple[int, int], tuple] = {}      # writers(lo, hi), until a write
        # (from, to) -> (frozenset, bitset) of full[from:to]: `full` only grows until a
        # whole-buffer write, so the tiles that overwrite one buffer share one group
        self.full_memo: dict[tuple[int, int], tuple] = {}
        self.masks = masks

    def _copy_segment(self, i: int) -> None:
        self.writer.insert(i + 1, self.writer[i])
        self.readers.insert(i + 1, list(self.readers[i]))
        self.full_from.insert(i + 1, self.full_from[i])

    def writers(self, lo: int, hi: int) -> tuple[frozenset[int], list[tuple[int, int]]]:
        """The last writers of [lo, hi) (one shared object until the next write), and the
        column ranges nobody has written yet."""
        key = (lo, hi)
        got = self.memo.get(key)
        if got is None:
            i, j = self.span(lo, hi)
            ws = self.writer[i:j]
            holes = [(self.starts[k], self._hi(k)) for k in range(i, j) if ws[k - i] < 0]
            got = self.memo[key] = (frozenset(w for w in ws if w >= 0), holes)
        return got

    def overwritten(self, buf: int, lo: int, hi: int, out: list[Conflict],
                    at: tuple[int, int] | None = None) -> None:
        """What a write of [lo, hi) of this buffer (id `buf`) must follow, appended to `out`:
        readers since the last write, else the writer. Whole-buffer readers come back as one
        frozenset shared by every writer that sees them. The conflicts name columns `at`
        (a _Grid's row map: lo, hi are rows), else [lo, hi)."""
        i, j = self.span(lo, hi)
        if at is not None:
            lo, hi = at
        readers: set[int] = set()
        writers: set[int] = set()
        nfull = len(self.full)
        min_f = nfull
        for k in range(i, j):
            f = self.full_from[k]
            r = self.readers[k]
            if r or f < nfull:
                readers.update(r)
                if f < min_f:
                    min_f = f
            elif self.writer[k] >= 0:
                writers.add(self.writer[k])
        if readers:
            out.append(new_conflict((WAR, buf, lo, hi, frozenset(readers), None)))
        if min_f < nfull:
            key = (min_f, nfull)
            full = self.full_memo.get(key)
            if full is None:
                ids = self.full[min_f:]
                full = self.full_memo[key] = (frozenset(ids), bitset(ids) if self.masks else None)
            out.append(new_conflict((WAR, buf, lo, hi, full[0], full[1])))
        if writers:
            out.append(new_conflict((WAW, buf, lo, hi, frozenset(writers), None)))

    def read(self, lo: int, hi: int, t: int) -> None:
        if lo <= 0 and hi >= self.width:
            if not self.full or self.full[-1] != t:
                self.full.append(t)
            return
        i, j = self.span(lo, hi)
        for k in range(i, j):
            r = self.readers[k]
            if not r or r[-1] != t:
                r.append(t)

    def clone(self) -> "_Columns":
        c = _Columns.__new__(_Columns)
        c.width, c.starts, c.writer = self.width, list(self.starts), list(self.writer)
        c.readers, c.full_from = [list(r) for r in self.readers], list(self.full_from)
        c.full, c.memo, c.full_memo = list(self.full), dict(self.memo), dict(self.full_memo)
        c.masks = self.masks
        return c

    def write(self, lo: int, hi: int, t: int) -> None:
        self.memo = {}
        if lo <= 0 and hi >= self.width:
            self.starts, self.writer, self.readers = [0], [t], [[]]
            self.full, self.full_from, self.full_memo = [], [0], {}
            return
        i, j = self.span(lo, hi)
        if i >= j:
            return
        del self.starts[i + 1:j]
        self.writer[i:j] = [t]
        self.readers[i:j] = [[]]
        self.full_from[i:j] = [len(self.full)]


class _Grid(_Segments):
    """A buffer that some region names rows of: disjoint column segments [starts[k],
    starts[k+1]), each with a _Columns over the buffer's rows (rows in the part of columns).
    A write of every row of a segment resets its row map to one piece, so the rows stay apart
    only in the columns a row-naming region touched since: batched attention writes y by rows,
    and the GEMV tiles that later write all rows of that storage cost one piece each again."""
    __slots__ = ("width", "rows", "starts", "cells", "memo", "masks")

    def __init__(self, width: int, rows: int, masks: bool):
        self.width, self.rows, self.masks = max(width, 1), max(rows, 1), masks
        self.starts = [0]
        self.cells = [_Columns(self.rows, masks)]
        self.memo: dict[tuple[int, int, int, int], tuple] = {}   # writers(...), until a write

    def _copy_segment(self, i: int) -> None:
        self.cells.insert(i + 1, self.cells[i].clone())

    def writers(self, lo: int, hi: int, r0: int, r1: int
                ) -> tuple[frozenset[int], list[tuple[int, int, int, int]]]:
        """The last writers of rows [r0, r1) x columns [lo, hi), and the (lo, hi, r0, r1)
        pieces nobody has written yet (r1 = ALL_ROWS for a piece of every row)."""
        key = (lo, hi, r0, r1)
        got = self.memo.get(key)
        if got is None:
            i, j = self.span(lo, hi)
            sets, holes = [], []
            for k in range(i, j):
                ws, gaps = self.cells[k].writers(r0, r1)
                if ws:
                    sets.append(ws)
                a, b = self.starts[k], self._hi(k)
                holes += [(a, b, ra, ALL_ROWS if ra <= 0 and rb >= self.rows else rb)
                          for ra, rb in gaps]
            ws = sets[0] if len(sets) == 1 else _EMPTY.union(*sets)
            got = self.memo[key] = (ws, holes)
        return got

    def overwritten(self, buf: int, lo: int, hi: int, r0: int, r1: int,
                    out: list[Conflict]) -> None:
        i, j = self.span(lo, hi)
        for k in range(i, j):
            self.cells[k].overwritten(buf, r0, r1, out, (lo, hi))

    def read(self, lo: int, hi: int, r0: int, r1: int, t: int) -> None:
        i, j = self.span(lo, hi)
        for k in range(i, j):
            self.cells[k].read(r0, r1, t)

    def write(self, lo: int, hi: int, r0: int, r1: int, t: int) -> None:
        self.memo = {}
        i, j = self.span(lo, hi)
        if i >= j:
            return
        if r0 <= 0 and r1 >= self.rows:          # every row: one piece again
            cell = _Columns(self.rows, self.masks)
            cell.write(0, self.rows, t)
            del self.starts[i + 1:j]
            self.cells[i:j] = [cell]
            return
        for k in range(i, j):
            self.cells[k].write(r0, r1, t)


def bitset(ids: Sequence[int]) -> int:
    """The bitset of task ids, one shift a run of consecutive ids: a group of readers is
    mostly the tiles of one op, one run, where a bit at a time costs a big-int operation each."""
    m = 0
    k, n = 0, len(ids)
    while k < n:
        start = end = ids[k]
        k += 1
        while k < n and ids[k] == end + 1:
            end += 1
            k += 1
        m |= ((1 << (end - start + 1)) - 1) << start
    return m


def scan(buffers: Sequence[Buffer], tasks: Sequence[Task],
         regions: Sequence[tuple[list[Region], list[Region]]] | None = None,
         unwritten: list[tuple[int, Region]] | None = None,
         masks: bool = False) -> list[list[Conflict]]:
    """For each task, in the order given (an order every task's predecessors come first in),
    the groups of earlier tasks it conflicts with. If `unwritten` is a list, (task, region)
    pairs it reads that no earlier task wrote are appended to it. With `masks`, whole-buffer
    reader groups carry their bitset."""
    if regions is None:
        regions = [task_regions(t, buffers) for t in tasks]
    # Weights, inputs and caches that no task writes can conflict with nothing: not tracked.
    # (Activations are, even if unwritten: their unwritten reads are reported.)
    # A buffer some region names rows of gets a _Grid; every other buffer one column map.
    written: set[int] = set()
    rowed: set[int] = set()
    for reads, writes in regions:
        for r in writes:
            written.add(r.buffer)
            if not r.every_row:
                rowed.add(r.buffer)
        for r in reads:
            if not r.every_row:
                rowed.add(r.buffer)
    written |= {b.id for b in buffers if b.kind in (BufferKind.ACTIVATION, BufferKind.IO_OUTPUT)}
    by_row = rowed & written
    # each tracked buffer's map, and whether it is a _Grid (its spans name rows too)
    maps: dict[int, tuple[_Segments, bool]] = {
        b: ((_Grid(buffers[b].cols, buffer_rows(buffers[b]), masks), True) if b in by_row
            else (_Columns(buffers[b].cols, masks), False)) for b in written}

    def lanes(rs: list[Region]) -> list[tuple]:
        """(r, the map of r's buffer, the span r names on it: columns, and rows on a _Grid)
        for each region of a tracked buffer."""
        out = []
        for r in rs:
            got = maps.get(r.buffer)
            if got is not None:
                out.append((r, got[0], (r.lo, r.hi, r.r0, r.r1) if got[1] else (r.lo, r.hi)))
        return out

    out: list[list[Conflict]] = []
    for task, (reads, writes) in zip(tasks, regions):
        t = task.id
        found: list[Conflict] = []
        reads = lanes(reads)
        writes = lanes(writes)
        for r, m, at in reads:
            ws, holes = m.writers(*at)
            if ws:
                found.append(new_conflict((RAW, r.buffer, r.lo, r.hi, ws, None)))
            if holes and unwritten is not None:     # a _Columns' holes (lo, hi) are every row
                unwritten += [(t, Region(r.buffer, *h)) for h in holes]
        for r, m, at in writes:
            m.overwritten(r.buffer, *at, found)
        out.append(found)
        # A task's own reads go in before its writes, so a write supersedes them.
        for _, m, at in reads:
            m.read(*at, t)
        for _, m, at in writes:
            m.write(*at, t)
    return out


# The last scan with masks and unwritten reads, with its inputs: the pipeline's last resync
# scans the tasks and regions that the final `validate` scans again (allocate_counters and
# place change only waits, counters and queues), so that second scan is a lookup.
# One (inputs, result) pair, read and replaced whole.
_LAST_SCAN: list = [None]


def scan_all(buffers: Sequence[Buffer], tasks: Sequence[Task],
             regions: Sequence[tuple[list[Region], list[Region]]]
             ) -> tuple[list[list[Conflict]], list[tuple[int, Region]]]:
    """scan with masks, and the unwritten reads: (conflicts per task, unwritten). Memoised on
    the last call's inputs, compared by value (the buffers, the task ids and every region), so
    a caller that computed its own regions gets the scan of exactly those."""
    ids = [t.id for t in tasks]
    last = _LAST_SCAN[0]
    if last is not None and last[0][1] == ids and last[0][0] == buffers and last[0][2] == regions:
        return last[1]
    unwritten: list[tuple[int, Region]] = []
    out = scan(buffers, tasks, regions, unwritten, masks=True)
    pair = (out, unwritten)
    _LAST_SCAN[0] = ((buffers, ids, list(regions)), pair)
    return pair


def forget_last_scan() -> None:
    _LAST_SCAN[0] = None


def dependencies(program_or_buffers: Program | Sequence[Buffer],
                 tasks: Sequence[Task] | None = None) -> list[tuple[int, ...]]:
    """For each task in program order, the sorted ids of earlier tasks it must follow.

    `dependencies(program)` or `dependencies(buffers, tasks)`; a (buffers, tasks) pair also works.
    """
    if isinstance(program_or_buffers, Program):
        buffers, tasks = program_or_buffers.buffers, program_or_buffers.tasks
    elif tasks is None:
        buffers, tasks = program_or_buffers  # type: ignore[misc]
    else:
        buffers = program_or_buffers
    out = []
    for task, found in zip(tasks, scan(buffers, tasks)):
        deps = _EMPTY.union(*(c.earlier for c in found)) if found else _EMPTY
        out.append(tuple(sorted(deps - {task.id})))
    return out
