"""A CPU thread count that does not oversubscribe a small, shared machine.

torch's default (one thread per core) makes the reference VM's many small ops fight for the
cores: on a busy 2-core machine a SmolLM2 decode step ran at 0.5 steps/s with torch's default
and 10.8 with one thread. The default here is half the usable cores (at least 1, at most 8);
OMP_NUM_THREADS, when set, wins (torch reads it itself).
"""
from __future__ import annotations

import os

import torch


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_threads(cores: int | None = None) -> int:
    """Half the usable cores, between 1 and 8: 1 on a 2-core machine."""
    cores = usable_cores() if cores is None else cores
    return max(1, min(8, cores // 2))


def apply_default() -> int:
    """Set torch's intra-op threads to default_threads() unless OMP_NUM_THREADS is set;
    returns the thread count in effect."""
    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(default_threads())
    return torch.get_num_threads()
