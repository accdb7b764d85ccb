"""bench/icache_probe.py on the CPU: its kernels hold the code sizes they are named for and
compile for sm_90a (the timing itself needs a GPU)."""
import importlib.util
from pathlib import Path

from amk.backends.cuda.compile import compile_source

TOOL = Path(__file__).resolve().parents[2] / "bench" / "icache_probe.py"


def _tool():
    spec = importlib.util.spec_from_file_location("icache_probe", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_each_probe_is_its_size_of_ffmas_and_compiles():
    ip = _tool()
    src = ip.kernel_source([1, 3])
    for s in (1, 3):
        body = src.split(f"probe_{s}(")[1].split("extern")[0]
        assert body.count("fmaf(") == s * 1024 // 16            # 16 bytes an FFMA
    assert compile_source(src, "sm_90a", use_cache=False).cubin[:4] == b"\x7fELF"


def test_bad_arguments_are_refused():
    ip = _tool()
    for argv in (["--sizes", "0"], ["--warps", "33"]):
        try:
            ip.main(argv)
        except SystemExit as e:
            assert e.code == 2
        else:
            raise AssertionError(argv)
