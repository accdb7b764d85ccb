"""Files under AMK_CACHE_DIR: atomic writes (temp file + rename, so a concurrent reader sees all
or nothing) and pickles that read fast. Callers build the keys; a failed read is a miss."""
from __future__ import annotations

import gc
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any


def write_atomic(path: str | Path, data: bytes) -> None:
    path = str(path)
    d = os.path.dirname(path)
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_pickle(path: str | Path, obj: Any) -> None:
    """Best effort: a read-only or full disk only costs the next compile its cache hit."""
    try:
        write_atomic(path, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    except OSError:
        pass


def read_pickle(path: str | Path) -> Any | None:
    """The object, or None when the file is missing or unreadable."""
    gc_was_on = gc.isenabled()
    gc.disable()            # unpickling ~10^5 small objects would trigger many full collections
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError, IndexError):
        return None
    finally:
        if gc_was_on:
            gc.enable()
