"""Files under AMK_CACHE_DIR: atomic writes (temp file + rename, so a concurrent reader sees all
or nothing) and pickles that read fast. Callers build the keys; a failed read is a miss.

Unpickling runs code, so a pickle is read only from a file and folder that the current user owns
and nobody else may write (neither group- nor other-writable); anything else is a miss. Folders
are created private (0700)."""
from __future__ import annotations

import gc
import os
import pickle
import stat
import tempfile
from pathlib import Path
from typing import Any


def write_atomic(path: str | Path, data: bytes) -> None:
    path = str(path)
    d = os.path.dirname(path)
    os.makedirs(d, mode=0o700, exist_ok=True)
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
    gc_was_on = gc.isenabled()
    gc.disable()      # pickling allocates per object: collections over a compile's heap (8B: 3.9 s)
    try:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        if gc_was_on:
            gc.enable()
    try:
        write_atomic(path, data)
    except OSError:
        pass


def _private(path: str) -> bool:
    """path is ours and writable by nobody else (only the owner's write bit may be set)."""
    if not hasattr(os, "getuid"):          # no POSIX owners (Windows): nothing to check
        return True
    try:
        st = os.stat(path)
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def read_pickle(path: str | Path) -> Any | None:
    """The object, or None when the file is missing or unreadable, or when it or its folder is
    not private to the current user (another user could have planted it)."""
    path = str(path)
    if not (_private(os.path.dirname(path) or ".") and _private(path)):
        return None
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
