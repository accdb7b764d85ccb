"""bench/icache_probe.py on the CPU: its kernels hold the code sizes they are named for and
compile for sm_90a (the timing itself needs a GPU)."""
import sys
from pathlib import Path

import pytest

from amk.backends.cuda.compile import compile_source

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import icache_probe  # noqa: E402


def test_each_probe_is_its_size_of_ffmas_and_compiles():
    src = icache_probe.kernel_source([1, 3])
    for s in (1, 3):
        body = src.split(f"probe_{s}(")[1].split("extern")[0]
        assert body.count("fmaf(") == s * 1024 // 16            # 16 bytes an FFMA
    assert compile_source(src, "sm_90a", use_cache=False).cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize("argv", [["--sizes", "0"], ["--warps", "33"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit) as e:
        icache_probe.main(argv)
    assert e.value.code == 2
