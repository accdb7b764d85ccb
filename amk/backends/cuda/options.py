"""CudaOptions: every setting of the CUDA backend, as one frozen value.

Built once at the edge (amk.knobs.cuda_options(), where amk.jit makes the function) and passed
down to lowering, codegen, compile and runtime; no module of the backend reads the environment.
`key()` is what changes the lowered tables, the source or the cubin: every cache key hashes it.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

@dataclass(frozen=True)
class CudaOptions:
    preload_bytes: int = 65536      # a GEMV tile's weight bytes preloaded into smem (preload.py); 0 off
    spin_ns: int = 128              # longest sleep between two polls of a counter
    counter_stride: int = 1         # 4-byte words between two counters in device memory
    profile: bool = False           # per-task %globaltimer records (CudaProgram.profile)
    lineinfo: bool = False          # NVRTC -lineinfo (profilers map SASS to source lines)
    source: str | None = None       # an edited kernel.cu compiled instead of the rendered one
    source_path: str = ""           # where `source` came from (for messages)
    watchdog_s: float = 1.0         # runtime only: no progress this long = a stuck schedule
    cache_dir: Path | None = None   # where the lowered tables and cubins are cached; None: nowhere

    def key(self) -> str:
        """Everything here that changes the lowered tables, the source or the cubin (the source
        override by its content); not where caches live, the watchdog or debug printing."""
        src = hashlib.sha256(self.source.encode()).hexdigest() if self.source is not None else "-"
        return repr((self.preload_bytes, self.spin_ns, self.counter_stride, self.profile,
                     self.lineinfo, src))

    def __repr__(self) -> str:      # the override's text is long: its hash instead
        return f"CudaOptions{self.key()}"
