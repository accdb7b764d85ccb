"""A disk cache of `lower_program` (the task descriptors, pointer tables and variant list): with
the program cache and the cubin cache it makes a warm compile skip every expensive step.

Key = AMK version + the CUDA backend's sources (Python and templates) + the options that change
the lowering (CudaOptions.key) + the CTA count + the program's digest (amk/program/digest.py). Written
atomically (temp + rename); nothing is cached when options.cache_dir is None.
"""
from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

from amk.diskcache import read_pickle, write_pickle
from amk.gcpause import without_gc
from amk.identity_memo import IdentityMemo
from amk.program.digest import program_digest
from amk.program.ir import Program
from amk.version import VERSION
from amk.backends.cuda.options import CudaOptions


@lru_cache(maxsize=1)
def _source_hash() -> str:
    root = Path(__file__).parent
    h = hashlib.sha256(VERSION.encode())
    for f in sorted([*root.glob("*.py"), *(root / "templates").glob("*")]):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _key(program: Program, n_ctas: int, options: CudaOptions) -> str:
    h = hashlib.sha256(_source_hash().encode())
    h.update(repr((n_ctas, options.key())).encode())
    h.update(program_digest(program).encode())
    return h.hexdigest()[:32]


# The last lowering, by program object: a compile started ahead (compile.start_program) lowers
# the program that CudaProgram lowers again moments later. The tables are read, never written.
_LAST = IdentityMemo(limit=1)


def lower_program_cached(program: Program, n_ctas: int = 132,
                         options: CudaOptions = CudaOptions(), on_spec=None):
    """lower_program through the memo and the disk cache. on_spec(spec), when given, is called
    once with the kernel spec: before the tables are packed when they are lowered now."""
    told = []

    def tell(spec) -> None:
        told.append(True)
        on_spec(spec)

    low = _LAST.get(program, (n_ctas, options.key()),
                    lambda: _lower(program, n_ctas, options, tell if on_spec else None))
    if on_spec is not None and not told:
        on_spec(low.spec)
    return low


@without_gc
def _lower(program: Program, n_ctas: int, options: CudaOptions, on_spec):
    from amk.backends.cuda import lower
    if options.cache_dir is None:
        return lower.lower_program(program, n_ctas, options, on_spec)
    path = options.cache_dir / "cuda" / f"{_key(program, n_ctas, options)}.lowered.pkl"
    low = read_pickle(path)
    if not isinstance(low, lower.Lowered):
        low = lower.lower_program(program, n_ctas, options, on_spec)
        write_pickle(path, low)
    return low
