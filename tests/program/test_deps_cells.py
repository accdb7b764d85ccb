"""deps.scan against a cell-by-cell simulation: random regions over row ranges and column
ranges of small buffers, where every cell keeps its last writer and its readers since."""
from hypothesis import given, settings, strategies as st

from amk.program.deps import scan
from amk.program.ir import Buffer, BufferKind, DType, InstructionKind as K, new_task
from amk.program.regions import ALL_ROWS, Region

ROWS, COLS = 4, 6
BUFFERS = [Buffer(b, f"a{b}", BufferKind.ACTIVATION, DType.F32, (ROWS, COLS)) for b in range(2)]


@st.composite
def region(draw):
    lo = draw(st.integers(0, COLS - 1))
    hi = draw(st.integers(lo + 1, COLS))
    if draw(st.booleans()):
        return Region(draw(st.integers(0, 1)), lo, hi)
    r0 = draw(st.integers(0, ROWS - 1))
    return Region(draw(st.integers(0, 1)), lo, hi, r0, draw(st.integers(r0 + 1, ROWS)))


def cells(r: Region):
    rows = range(ROWS) if r.r1 >= ALL_ROWS else range(r.r0, r.r1)
    return [(r.buffer, row, c) for row in rows for c in range(r.lo, r.hi)]


def simulated(regions):
    """(the dependencies of each task, the (task, cell) pairs read before any write)."""
    writer, readers, out, unwritten = {}, {}, [], set()
    for t, (reads, writes) in enumerate(regions):
        deps = set()
        for r in reads:
            deps |= {writer[c] for c in cells(r) if c in writer}
            unwritten |= {(t, c) for c in cells(r) if c not in writer}
        for r in writes:
            for c in cells(r):
                deps |= readers.get(c) or ({writer[c]} if c in writer else set())
        for r in reads:
            for c in cells(r):
                readers.setdefault(c, set()).add(t)
        for r in writes:
            for c in cells(r):
                writer[c], readers[c] = t, set()
        out.append(deps - {t})
    return out, unwritten


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.lists(region(), max_size=2), st.lists(region(), max_size=2)),
                min_size=1, max_size=12))
def test_scan_equals_the_cell_by_cell_simulation(regions):
    tasks = [new_task(i, K.COPY, (), (), {}, (), 0) for i in range(len(regions))]
    unwritten = []
    found = scan(BUFFERS, tasks, regions, unwritten)
    got = [set().union(*(c.earlier for c in f)) - {i} for i, f in enumerate(found)]
    assert (got, {(t, c) for t, r in unwritten for c in cells(r)}) == simulated(regions)


def test_an_every_row_write_joins_the_rows_again():
    rows = [([], [Region(0, 0, COLS, r, r + 1)]) for r in range(ROWS)]     # t0..t3 by rows
    regions = rows + [([], [Region(0, 0, 3)]),                              # t4 every row, cols 0:3
                      ([Region(0, 0, COLS, 1, 2)], []),                      # t5 row 1
                      ([Region(0, 2, 4)], [])]                               # t6 every row, 2:4
    tasks = [new_task(i, K.COPY, (), (), {}, (), 0) for i in range(len(regions))]
    got = [set().union(*(c.earlier for c in f)) for f in scan(BUFFERS, tasks, regions)]
    assert got[4] == {0, 1, 2, 3}
    assert got[5] == {4, 1}          # cols 0:3 from t4, cols 3:6 still row 1's own writer
    assert got[6] == {4, 0, 1, 2, 3}
