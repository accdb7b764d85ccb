"""The research probes in bench/ keep compiling: every config of bench/handoff_probe.py renders a
CUDA source that NVRTC compiles for sm_90a (no GPU needed), without spilling."""
import importlib.util
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("cuda.bindings")

from amk.backends.cuda import compile_source  # noqa: E402

BENCH = Path(__file__).parents[2] / "bench"


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


def test_the_probes_sweep_reports_a_failing_config_and_goes_on(capsys):
    """gpu_tool.sweep (both probes' loop): results in order, a config that raises is printed
    with its error and left out; warm_median drops the warm-up run; cta_span_us is last end -
    first start over the CTAs' %globaltimer pairs."""
    import torch
    tool = _load("gpu_tool")

    def run(cfg):
        if cfg == 2:
            raise RuntimeError("no launch")
        return {"v": cfg * 10}
    rows = tool.sweep([1, 2, 3], run, lambda r: f"row {r['v']}")
    assert rows == [{"v": 10}, {"v": 30}]
    assert capsys.readouterr().out.splitlines() == ["row 10", "2 failed: RuntimeError: no launch", "row 30"]
    assert tool.warm_median([100.0, 3.0, 1.0, 2.0]) == 2.0
    t = torch.tensor([5000, 9000, 4000, 7000, 6000, 12000], dtype=torch.int64)   # 3 CTAs
    assert tool.cta_span_us(t, 3) == 8.0
