"""A disk cache of `lower_program` (the task descriptors, pointer tables and variant list): with
the program cache and the cubin cache it makes a warm compile skip every expensive step.

Key = AMK version + the CUDA backend's sources (Python and templates) + the knobs that change
the lowering + the CTA count + the program itself (its repr). Written atomically (temp + rename).
"""
from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

from amk import knobs
from amk.diskcache import read_pickle, write_pickle
from amk.program.ir import Program


@lru_cache(maxsize=1)
def _source_hash() -> str:
    import amk
    root = Path(__file__).parent
    h = hashlib.sha256(amk.__version__.encode())
    for f in sorted([*root.glob("*.py"), *(root / "templates").glob("*")]):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _key(program: Program, n_ctas: int) -> str:
    h = hashlib.sha256(_source_hash().encode())
    h.update(repr((n_ctas, knobs.backend_knobs())).encode())
    h.update(repr(program).encode())      # canonical: pickle bytes depend on object sharing
    return h.hexdigest()[:32]


def lower_program_cached(program: Program, n_ctas: int = 132):
    from amk.backends.cuda.lower import Lowered, lower_program
    path = knobs.cache_dir() / "cuda" / f"{_key(program, n_ctas)}.lowered.pkl"
    low = read_pickle(path)
    if not isinstance(low, Lowered):
        low = lower_program(program, n_ctas=n_ctas)
        write_pickle(path, low)
    return low
