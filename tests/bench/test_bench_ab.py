"""bench/ab.py, the same-call A/B driver: its variant syntax, the round order and the table
(the decode runs themselves need a GPU)."""
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"     # as ab.py puts it on sys.path


@pytest.fixture(scope="module")
def ab():
    spec = importlib.util.spec_from_file_location("bench_ab", BENCH / "ab.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_ab"] = mod               # its dataclass looks its module up
    spec.loader.exec_module(mod)
    yield mod
    del sys.modules["bench_ab"]
    sys.path.remove(str(BENCH))                 # ab.py put bench/ first, for gpu_tool


def test_a_variant_is_a_tree_and_knobs(ab, tmp_path):
    assert ab.parse_variant("-") == ab.Variant("-", ab.THIS_TREE, {})
    assert ab.parse_variant("AMK_PRELOAD=0,AMK_SPIN_NS=256").env == {"AMK_PRELOAD": "0", "AMK_SPIN_NS": "256"}
    (tmp_path / "amk").mkdir()
    (tmp_path / "amk" / "__init__.py").write_text("")
    v = ab.parse_variant(f"{tmp_path}:AMK_PRELOAD=0")
    assert (v.tree, v.env) == (tmp_path.resolve(), {"AMK_PRELOAD": "0"})
    assert ab.parse_variant(f"{tmp_path}:-").env == {}


@pytest.mark.parametrize("arg, says", [("/nonexistent/tree:-", "holds no amk/ package"),
                                       ("AMK_PRELOAD", "'AMK_PRELOAD' is not NAME=VAL"),
                                       ("=1", "is not NAME=VAL")])
def test_a_bad_variant_says_what_is_wrong(ab, arg, says):
    with pytest.raises(SystemExit, match=says):
        ab.parse_variant(arg)


def test_rounds_alternate_the_variants_and_the_table_keeps_the_best(ab, capsys):
    a, b = ab.parse_variant("-"), ab.parse_variant("AMK_PRELOAD=0")
    order, results = [], iter([1.05, 1.10, 1.04, None])
    rows = ab.run([a, b], 2, lambda v: (order.append(v.name), next(results))[1])
    assert order == ["-", "AMK_PRELOAD=0", "-", "AMK_PRELOAD=0"]
    assert [r["ms"] for r in rows] == [[1.05, 1.04], [1.10, None]]
    assert [r["best_ms"] for r in rows] == [1.04, 1.10]
    text = ab.table(rows)
    assert "- | 1.050 | 1.040 | 1.040" in text and "AMK_PRELOAD=0 | 1.100 | - | 1.100" in text


def test_a_step_that_fails_is_no_result_with_its_reason(ab, monkeypatch, capsys):
    """decode.py records a failed cuda step as amk_cuda_error, with no amk_cuda_ms: the run
    is None and the reason printed (it was a KeyError that ended the whole A/B)."""
    import json
    import subprocess

    def fake_run(cmd, **kw):
        out = Path(cmd[cmd.index("--json") + 1])
        rows = [{"context": 1024, "amk_cuda_error": "CompileError: too many operands"}]
        out.write_text(json.dumps({"rows": rows}))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(ab.subprocess, "run", fake_run)
    assert ab.decode_ms(ab.parse_variant("-"), 1024, 5, 60) is None
    assert "-: CompileError: too many operands" in capsys.readouterr().out
