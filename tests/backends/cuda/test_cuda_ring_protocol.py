"""Kernel v2's ring protocol (templates/ring.cuh) as a model on the CPU: producer lanes and
consumer warps interleaved by a random scheduler, copies landing in any order, mbarriers with
the hardware's parity semantics (a parity wait passes when the barrier's completed-phase count
has the other parity, so a wait two phases behind passes at once). Every consumer must read
exactly its item, and every run must finish: the page order of ring.py (item q on page q %
pages, producer lane and consumer warp q % pages) guarantees both. The same model with the
items dealt round robin to all 16 warps (v1's order) reads a stale page: the model can fail."""
import random

import pytest

from amk.backends.cuda import ring

WARPS = 16


class Barrier:
    def __init__(self):
        self.completed = 0                       # phases completed so far

    def passes(self, parity: int) -> bool:       # mbarrier.try_wait.parity / test_wait.parity
        return (self.completed & 1) != parity


def simulate(steps: list[int], pages: int, seed: int, warp_of=ring.consumer_warp) -> list[str]:
    """Run the protocol over RING steps of the given item counts; the errors (stale reads,
    deadlock), none when it is sound."""
    rng = random.Random(seed)
    full = [Barrier() for _ in range(pages)]
    empty = [Barrier() for _ in range(pages)]
    content = [None] * pages                     # the item a page holds once its copy landed
    flight = []                                  # (page, item) copies not landed yet
    starts = [sum(steps[:i]) for i in range(len(steps))]
    total = sum(steps)
    # the producer: lane p issues the items q = p (mod pages), in order, each after its wait
    lane_next = {p: p for p in range(pages)}
    # the consumers: per step, warp w's items in order; a barrier closes every step
    todo = [[[q for q in range(s, s + n) if warp_of(q, pages) == w] for w in range(WARPS)]
            for s, n in zip(starts, steps)]
    step = 0
    errors = []
    while step < len(steps) or flight or any(q < total for q in lane_next.values()):
        moves = []
        for p, q in lane_next.items():
            if q < total and (q < pages or empty[p].passes((q // pages - 1) & 1)):
                moves.append(("issue", p))
        if flight:
            moves.append(("land", None))
        if step < len(steps):
            for w in range(WARPS):
                if todo[step][w]:
                    q = todo[step][w][0]
                    if full[q % pages].passes((q // pages) & 1):
                        moves.append(("take", w))
            if not any(todo[step]):
                moves.append(("barrier", None))
        if not moves:
            return errors + [f"deadlock at step {step}"]
        kind, who = rng.choice(moves)
        if kind == "issue":
            q = lane_next[who]
            flight.append((who, q))
            lane_next[who] = q + pages
        elif kind == "land":
            p, q = flight.pop(rng.randrange(len(flight)))
            content[p] = q
            full[p].completed += 1
        elif kind == "take":
            q = todo[step][who].pop(0)
            p = q % pages
            if content[p] != q:
                errors.append(f"warp {who} read item {content[p]} for item {q}")
            empty[p].completed += 1               # the warp's 32 lanes: one phase
        else:
            step += 1
    return errors


STEP_SETS = [[16, 16, 16], [3, 40, 1, 7, 64], [1] * 30, [200, 5, 33]]


@pytest.mark.parametrize("steps", STEP_SETS, ids=str)
@pytest.mark.parametrize("pages", [2, 10, 16])
def test_every_consumer_reads_its_item_and_every_run_finishes(steps, pages):
    for seed in range(20):
        assert simulate(steps, pages, seed) == [], (steps, pages, seed)


def test_items_dealt_round_robin_to_all_warps_read_stale_pages():
    """v1's order (item it to warp it % 16) over 10 pages: a warp's parity wait for item q can
    pass on the phase of item q - 20 while item q - 10 has not landed."""
    def round_robin(q, pages):
        return q % WARPS
    found = [e for seed in range(50) for e in simulate([64, 64], 10, seed, round_robin)]
    assert any("read item" in e for e in found)
