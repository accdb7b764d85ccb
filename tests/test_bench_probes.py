"""The research probes in bench/ keep compiling: every config of bench/handoff_probe.py renders a
CUDA source that NVRTC compiles for sm_90a (no GPU needed), without spilling."""
import importlib.util
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("cuda.bindings")

from amk.backends.cuda import compile_source  # noqa: E402

BENCH = Path(__file__).parents[1] / "bench"


def _load(name: str):
    sys.path.insert(0, str(BENCH))            # the probes import gpu_tool beside them
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


def test_every_handoff_probe_config_compiles_without_spills():
    probe = _load("handoff_probe")
    seen = set()
    for cfg in probe.CONFIGS:
        key = (cfg["mode"], cfg["u"], cfg["spin"])
        if key in seen:
            continue
        seen.add(key)
        res = compile_source(probe.source(cfg), "sm_90a", use_cache=False)
        assert res.cubin, key
        spills = re.findall(r"(\d+) bytes spill stores", res.log)
        assert spills and all(int(n) == 0 for n in spills), (key, res.log)
    assert {m for m, _, _ in seen} == set(probe.MODES)
