"""A program's content digest, for the disk caches' keys (the CUDA lowered tables).

By default sha256 of its canonical repr, which costs ~0.5 s for a 10^4-task program. A program
the pass pipeline produced under a pass-cache key is a pure function of that key (the graph,
the options and every pass's source), so run_pipeline_cached records the key instead and
neither a cold nor a warm compile ever builds the repr. Memoised per object, like validate's
proofs (programs are frozen; a program freed takes its entry with it)."""
from __future__ import annotations

import hashlib
import weakref

from amk.program.ir import Program

_DIGESTS: dict[int, str] = {}


def remember_digest(program: Program, digest: str) -> None:
    key = id(program)
    if key not in _DIGESTS:
        weakref.finalize(program, _DIGESTS.pop, key, None)
    _DIGESTS[key] = digest


def program_digest(program: Program) -> str:
    d = _DIGESTS.get(id(program))
    if d is None:
        d = "repr:" + hashlib.sha256(repr(program).encode()).hexdigest()
        remember_digest(program, d)
    return d
