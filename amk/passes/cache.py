"""A disk cache of pass-pipeline results: a warm compile skips the passes and the proof.

Key = AMK version + the source of every pass module and of the program IR/validator + the
pipeline's functions + the graph text + the options. Values are pickled Programs, written
atomically (temp file + rename), so concurrent processes never see half a file. A program is
written only after `validate` proved it, and is remembered as proved when read back.
"""
from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

from amk.diskcache import read_pickle, write_pickle
from amk.graph import Graph
from amk.program.ir import Program

_SOURCES = ("passes", "program")


@lru_cache(maxsize=1)
def _source_hash() -> str:
    import amk
    root = Path(amk.__file__).parent
    h = hashlib.sha256(amk.__version__.encode())
    for d in _SOURCES:
        for f in sorted((root / d).glob("*.py")):
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def cache_key(graph: Graph, opts, pipeline) -> str:
    h = hashlib.sha256(_source_hash().encode())
    for name, fn in pipeline:       # a patched pipeline (tests, experiments) is another key
        code = getattr(fn, "__code__", None)
        h.update(f"{name}:{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', fn)!r}".encode())
        h.update(code.co_code if code is not None else b"")
    h.update(str(graph).encode())
    h.update(repr(opts).encode())
    return h.hexdigest()[:32]


def _path(cache_dir: Path, key: str) -> Path:
    return cache_dir / "programs" / f"{key}.pkl"


def load(cache_dir: Path, key: str) -> Program | None:
    """The program stored under `key` in cache_dir (AMK_CACHE_DIR, read at the edge), or None."""
    prog = read_pickle(_path(cache_dir, key))
    if not isinstance(prog, Program):
        return None
    from amk.program.validate import ValidationResult, remember
    remember(prog, ValidationResult(prog.name))
    return prog


def store(cache_dir: Path, key: str, program: Program) -> None:
    from amk.program.intern import interned      # equal parts shared: a third of the bytes
    write_pickle(_path(cache_dir, key), interned(program))
