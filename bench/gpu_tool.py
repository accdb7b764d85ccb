"""What the GPU bench tools share: a parser that shows the tool's docstring, the check that a
CUDA GPU is there (else the tool says so and exits 2), and no driver compute cache.

NVRTC 13 keeps what it compiles in the driver's compute cache (~/.nv/ComputeCache) across
processes: a kernel compiled once before on the machine then takes ~0.05 s, not seconds, and a
"cold" compile or an A/B of two trees with the same kernel would time the cache. Importing this
module turns that cache off (CUDA_CACHE_DISABLE=1, read when CUDA starts), unless the caller's
environment says otherwise."""
from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("CUDA_CACHE_DISABLE", "1")


def parser(doc: str | None) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def have_gpu(tool: str) -> bool:
    """True when torch sees a CUDA GPU; else prints which tool needs one (`tool`: its __file__)."""
    import torch
    if torch.cuda.is_available():
        return True
    root = Path(__file__).resolve().parent.parent
    print(f"{Path(tool).resolve().relative_to(root)} needs a CUDA GPU", file=sys.stderr)
    return False


@contextmanager
def cache_dir(path: str):
    """AMK_CACHE_DIR set to `path` inside the block, restored after (cold/warm compile timings)."""
    old = os.environ.get("AMK_CACHE_DIR")
    os.environ["AMK_CACHE_DIR"] = path
    try:
        yield path
    finally:
        if old is None:
            os.environ.pop("AMK_CACHE_DIR", None)
        else:
            os.environ["AMK_CACHE_DIR"] = old


def python_loop_s(n: int = 20_000_000) -> float:
    """Seconds this host takes for a plain Python loop of n additions: a CPU reference for
    compile times, which are CPU-bound (the lent GPU hosts ran it in 0.58-1.33 s, the 2-core
    development machine in 0.46 s; NOTES v29)."""
    import time
    t, s = time.perf_counter(), 0
    for i in range(n):
        s += i
    return time.perf_counter() - t
