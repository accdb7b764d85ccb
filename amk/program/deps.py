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


def scan(buffers: Sequence[Buffer], tasks: Sequence[Task],
         regions: Sequence[tuple[list[Region], list[Region]]] | None = None,
         unwritten: list[tuple[int, Region]] | None = None) -> list[dict[int, list]]:
    """For each task (in the order given) {earlier task id: [kind, buffer, lo, hi]}: the first
    conflict found with it (RAW before WAR/WAW), its columns widened over later segments of the
    same kind and buffer. If `unwritten` is a list, (task, region) pairs it reads that no
    earlier task wrote are appended to it. The cheap form behind `hazards`/`dependencies`."""
    if regions is None:
        regions = [task_regions(t, buffers) for t in tasks]
    maps: dict[int, _ColumnMap] = {}
    out: list[dict[int, list]] = []
    for task, (reads, writes) in zip(tasks, regions):
        b = task.id
        found: dict[int, list] = {}
        get = found.get
        for buf, lo, hi in reads:
            m = maps.get(buf) or maps.setdefault(buf, _ColumnMap(buffers[buf].cols))
            i, j = m.span(lo, hi)
            starts, writer = m.starts, m.writer
            for k in range(i, j):
                a = writer[k]
                if a == b:
                    continue
                seg_hi = starts[k + 1] if k + 1 < len(starts) else m.width
                if a < 0:
                    if unwritten is not None:
                        unwritten.append((b, Region(buf, starts[k], seg_hi)))
                    continue
                e = get(a)
                if e is None:
                    found[a] = [RAW, buf, starts[k], seg_hi]
                elif e[0] is RAW and e[1] == buf and e[3] < seg_hi:
                    e[3] = seg_hi
        for buf, lo, hi in writes:
            m = maps.get(buf) or maps.setdefault(buf, _ColumnMap(buffers[buf].cols))
            i, j = m.span(lo, hi)
            starts, writer, readers = m.starts, m.writer, m.readers
            for k in range(i, j):
                if readers[k]:
                    kind, earlier = WAR, readers[k]
                elif writer[k] >= 0:
                    kind, earlier = WAW, (writer[k],)
                else:
                    continue
                seg_hi = starts[k + 1] if k + 1 < len(starts) else m.width
                for a in earlier:
                    e = get(a)
                    if e is None:
                        if a != b:
                            found[a] = [kind, buf, starts[k], seg_hi]
                    elif e[0] is kind and e[1] == buf and e[3] < seg_hi:
                        e[3] = seg_hi
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
        out.append(found)
    return out


def hazards(buffers: Sequence[Buffer], tasks: Sequence[Task],
            regions: Sequence[tuple[list[Region], list[Region]]] | None = None
            ) -> list[list[Hazard]]:
    """For each task (in the order given) one Hazard per earlier task it must follow."""
    return [[Hazard(a, t.id, *e) for a, e in found.items()]
            for t, found in zip(tasks, scan(buffers, tasks, regions))]


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
    return [tuple(sorted(found)) for found in scan(buffers, tasks)]
