"""RankGroup: which tensor-parallel rank a traced step is, and how many ranks there are.

A sharded model traces one step per rank; the rank and world are compile-time constants of
that rank's program (they land in the all-reduce tasks' params), so every rank gets its own
program. Collectives are matched across ranks by their order in the program (as NCCL matches
collectives by issue order on a communicator)."""
from __future__ import annotations

from dataclasses import dataclass

from amk.errors import TraceError


@dataclass(frozen=True)
class RankGroup:
    rank: int
    world: int

    def __post_init__(self):
        ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (self.rank, self.world))
        if not ok or self.world < 1 or not 0 <= self.rank < self.world:
            raise TraceError(f"RankGroup(rank={self.rank!r}, world={self.world!r}): need ints "
                             f"with world >= 1 and 0 <= rank < world")

    def params(self) -> dict:
        return {"rank": self.rank, "world": self.world}
