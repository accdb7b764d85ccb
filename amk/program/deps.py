"""Which earlier tasks each task must follow, from the regions it touches (program order).

For every buffer we keep an interval map of its columns: each segment remembers its last writer
and the readers since that write. A read depends on the segment's last writer (RAW); a write
depends on the readers since the last write (WAR) or, if there were none, on the last writer
(WAW). The readers already follow that writer, so the edge set needs no transitive closure to be
complete: every conflicting pair is connected by a chain of these edges. Cost is linear in the
number of (task, segment) touches, not in the number of task pairs.
"""
from __future__ import annotations

from bisect import bisect_right
from typing import NamedTuple, Sequence

from amk.program.ir import Buffer, Program, Task
from amk.program.regions import Region, task_regions

RAW, WAR, WAW = "RAW", "WAR", "WAW"


class Hazard(NamedTuple):
    """`later` must follow `earlier`: they touch columns [lo, hi) of `buffer` (kind RAW/WAR/WAW)."""
    earlier: int
    later: int
    kind: str
    buffer: int
    lo: int
    hi: int


class _ColumnMap:
    """Disjoint segments covering [0, width): starts[i] .. starts[i+1] with (writer, readers)."""
    __slots__ = ("starts", "writer", "readers", "width")

    def __init__(self, width: int):
        self.width = width
        self.starts = [0]
        self.writer = [-1]
        self.readers: list[list[int]] = [[]]

    def _split(self, x: int) -> int:
        """Make x a segment start (if inside the map); return the index of the segment at x."""
        if x >= self.width:
            return len(self.starts)
        i = bisect_right(self.starts, x) - 1
        if self.starts[i] == x:
            return i
        self.starts.insert(i + 1, x)
        self.writer.insert(i + 1, self.writer[i])
        self.readers.insert(i + 1, list(self.readers[i]))
        return i + 1

    def span(self, lo: int, hi: int) -> tuple[int, int]:
        lo = max(lo, 0)
        hi = min(hi, self.width)
        if lo >= hi:
            return 0, 0
        i = self._split(lo)
        j = self._split(hi)
        return i, j

    def seg_hi(self, k: int) -> int:
        return self.starts[k + 1] if k + 1 < len(self.starts) else self.width

    def write(self, i: int, j: int, task: int) -> None:
        """Segments i..j-1 become one segment last written by `task`, with no readers."""
        self.starts[i + 1:j] = []
        self.writer[i:j] = [task]
        self.readers[i:j] = [[]]


def hazards(buffers: Sequence[Buffer], tasks: Sequence[Task],
            regions: Sequence[tuple[list[Region], list[Region]]] | None = None,
            unwritten: list[tuple[int, Region]] | None = None) -> list[list[Hazard]]:
    """For each task (in the order given) the hazards it has with earlier tasks, one per
    (earlier task, kind, buffer), spanning the columns involved. If `unwritten` is a list,
    (task, region) pairs it reads that no earlier task wrote are appended to it."""
    if regions is None:
        regions = [task_regions(t, buffers) for t in tasks]
    maps: dict[int, _ColumnMap] = {}
    out: list[list[Hazard]] = []
    for task, (reads, writes) in zip(tasks, regions):
        b = task.id
        found: dict[tuple[int, str, int], list[int]] = {}

        def note(a: int, kind: str, buf: int, lo: int, hi: int) -> None:
            if a == b:
                return
            key = (a, kind, buf)
            span = found.get(key)
            if span is None:
                found[key] = [lo, hi]
            else:
                span[0] = min(span[0], lo)
                span[1] = max(span[1], hi)

        for r in reads:
            m = maps.get(r.buffer) or maps.setdefault(r.buffer, _ColumnMap(buffers[r.buffer].cols))
            i, j = m.span(r.lo, r.hi)
            for k in range(i, j):
                if m.writer[k] >= 0:
                    note(m.writer[k], RAW, r.buffer, m.starts[k], m.seg_hi(k))
                elif unwritten is not None:
                    unwritten.append((b, Region(r.buffer, m.starts[k], m.seg_hi(k))))
        for w in writes:
            m = maps.get(w.buffer) or maps.setdefault(w.buffer, _ColumnMap(buffers[w.buffer].cols))
            i, j = m.span(w.lo, w.hi)
            for k in range(i, j):
                lo, hi = m.starts[k], m.seg_hi(k)
                if m.readers[k]:
                    for a in m.readers[k]:
                        note(a, WAR, w.buffer, lo, hi)
                elif m.writer[k] >= 0:
                    note(m.writer[k], WAW, w.buffer, lo, hi)
        # Update the maps: reads first, then writes (a write supersedes this task's own reads).
        for r in reads:
            m = maps[r.buffer]
            i, j = m.span(r.lo, r.hi)
            for k in range(i, j):
                rl = m.readers[k]
                if not rl or rl[-1] != b:
                    rl.append(b)
        for w in writes:
            m = maps[w.buffer]
            i, j = m.span(w.lo, w.hi)
            if i < j:
                m.write(i, j, b)
        out.append([Hazard(a, b, kind, buf, lo, hi) for (a, kind, buf), (lo, hi) in found.items()])
    return out


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
    return [tuple(sorted({h.earlier for h in hs})) for hs in hazards(buffers, tasks)]
