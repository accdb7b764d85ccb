"""repeat: find the block of equations a traced step repeats (a decoder's layers), and the small
graph of three of its blocks that passes/stamp.py runs the local passes on (six or seven for
passes/stamp_period.py).

A Repeat is `count` blocks of `size` equations from equation `start`: block b's equation k
equals block b-1's (same primitive, params, source line, shapes and dtypes) and is wired the
same way one block later. Each input of a block's equation is
  * an output of the same block or of the block before it (the one block before, at the same
    place: a layer reads its own values and the residual stream of the layer before), or
  * a graph input shared by every block (pos, the rope frequencies), or
  * a graph input private to the block (its weights, its KV cache), at the same place as the
    block before's private input, with its shape, dtype and kind.
Anything else (a block reading two blocks back, a value of the prologue, an input of another
block; equations after the blocks reading a block before the last) is no Repeat: the plain
pipeline runs. A shared input read as a linear's activation is none either: `tile` sizes a
GEMV's tiles by every GEMV reading the same x, across the whole program.
"""
from __future__ import annotations

from dataclasses import dataclass

from amk.graph import Eqn, Graph, Var

# Blocks the small graph keeps: the first, one middle block (it sees a block on either side)
# and the last; fewer blocks than MIN_BLOCKS save nothing.
MIN_BLOCKS = 4
_LINEARS = ("linear", "qlinear")


@dataclass(frozen=True)
class Repeat:
    start: int                      # the first equation of block 0
    size: int                       # equations a block
    count: int                      # blocks
    # per block b, the graph input index of each private input of block 1 -> block b's
    private: tuple[dict[int, int], ...]

    def block_of(self, eqn: int) -> int:
        """-1 before the blocks, b inside block b, count after them."""
        if eqn < self.start:
            return -1
        return min((eqn - self.start) // self.size, self.count)


def _signatures(g: Graph) -> list[int]:
    ids: dict[tuple, int] = {}
    return [ids.setdefault((e.prim, e.params, e.src, tuple(v.aval for v in e.inputs),
                            tuple(v.aval for v in e.outputs)), len(ids)) for e in g.eqns]


def _longest_period(sig: list[int]) -> tuple[int, int, int] | None:
    """(start, size, count) of the longest run of equations repeating with one period."""
    n = len(sig)
    best = None
    for p in range(1, n // MIN_BLOCKS + 1):
        run = 0
        for i in range(n - p):
            run = run + 1 if sig[i] == sig[i + p] else 0
            count = (run + p) // p
            if count >= MIN_BLOCKS and (best is None or count * p > best[1] * best[2]):
                best = (i + 1 - run, p, count)
    return best


def find_repeat(g: Graph) -> Repeat | None:
    """The Repeat of g's equations, or None where its blocks are not wired alike."""
    found = _longest_period(_signatures(g))
    if found is None:
        return None
    start, size, count = found
    made = {o.id: (i, k) for i, e in enumerate(g.eqns) for k, o in enumerate(e.outputs)}
    index = {v.id: i for i, v in enumerate(g.inputs)}
    outputs = {v.id for v in g.outputs}
    readers: dict[int, set[int]] = {}          # graph input -> blocks reading it
    shared: set[int] = set()
    step: list[dict[int, int]] = [{}]          # per block b >= 1, block b-1's inputs -> b's
    end = start + size * count
    for b in range(1, count):
        step.append({})
        lo = start + (b - 1) * size             # the block before's first equation
        for i in range(start + b * size, start + (b + 1) * size):
            e, f = g.eqns[i], g.eqns[i - size]
            if any((o.id in outputs) != (u.id in outputs) for o, u in zip(e.outputs, f.outputs)):
                return None
            for k, (v, u) in enumerate(zip(e.inputs, f.inputs)):
                if v.id in made:
                    iv, ov = made[v.id]
                    if iv < lo or (u.id in made and made[u.id] != (iv - size, ov)) or (
                            u.id not in made and b > 1):
                        return None
                elif v.id not in index:
                    return None
                elif v is u:
                    if e.prim in _LINEARS and k == 0:
                        return None
                    shared.add(v.id)
                else:
                    if u.id not in index or v.aval != u.aval or g.input_kinds[index[v.id]] != \
                            g.input_kinds[index[u.id]] or step[b].get(index[u.id], index[v.id]) != index[v.id]:
                        return None
                    step[b][index[u.id]] = index[v.id]
                    readers.setdefault(v.id, set()).add(b)
                    readers.setdefault(u.id, set()).add(b - 1)
    if any(len(bs) > 1 for v, bs in readers.items()) or shared & set(readers):
        return None
    # after the blocks: nothing reads a block before the last
    last = start + (count - 1) * size
    for e in g.eqns[end:]:
        if any(v.id in made and start <= made[v.id][0] < last for v in e.inputs):
            return None
    private = [{}, {u: u for u in step[1].values()}]
    for b in range(2, count):
        private.append({k: step[b][v] for k, v in private[b - 1].items()})
    return Repeat(start, size, count, tuple(private))


def small_graph(g: Graph, rep: Repeat, blocks: int = 3) -> Graph:
    """g with blocks 0 .. blocks-2 and the last only (the last reading block blocks-2 where it
    read the block before it); every graph input is kept, so the inputs' buffers are numbered
    as in g."""
    s, p, n = rep.start, rep.size, rep.count
    assert 3 <= blocks <= n
    made = {o.id: (i, k) for i, e in enumerate(g.eqns) for k, o in enumerate(e.outputs)}
    last = s + (n - 1) * p
    back = (n - blocks) * p                     # block n-2's equations -> block blocks-2's

    def moved(v: Var) -> Var:
        i, k = made.get(v.id, (-1, 0))
        return g.eqns[i - back].outputs[k] if last - p <= i < last else v

    tail = [Eqn(e.prim, tuple(moved(v) for v in e.inputs), e.outputs, e.params, e.src)
            for e in g.eqns[last:last + p]]
    eqns = g.eqns[:s + (blocks - 1) * p] + tuple(tail) + g.eqns[s + n * p:]
    kept = {o.id for e in eqns for o in e.outputs} | {v.id for v in g.inputs}
    return Graph(g.inputs, g.input_paths, g.input_kinds, eqns,
                 tuple(v for v in g.outputs if v.id in kept), g.name)
