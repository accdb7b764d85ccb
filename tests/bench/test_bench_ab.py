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


def test_a_matrix_runs_its_rows_in_order_and_skips_what_the_budget_cannot_hold(ab, capsys):
    """run_matrix: each row an A/B of its own (the variants alternated), in the matrix's order;
    once the time used plus the longest run so far times a row's runs would pass the budget,
    the rest of the rows are skipped and named, not started."""
    a, b = ab.parse_variant("-"), ab.parse_variant("AMK_PRELOAD=0")
    now = [0.0]
    seen = []

    def measure(v, row):                     # every run takes 10 s of the fake clock
        seen.append((row.name(), v.name))
        now[0] += 10.0
        return 1.0 if v.name == "-" else 1.1
    rows = ab.MATRICES["batch1"][:4]
    done, skipped = ab.run_matrix([a, b], rows, 1, measure, budget_s=45.0, clock=lambda: now[0])
    # rows 1 and 2 take 20 s each; a third would end at 60 s > 45 s
    assert [d["row"] for d in done] == [rows[0].name(), rows[1].name()]
    assert skipped == [rows[2].name(), rows[3].name()]
    assert seen == [(rows[0].name(), "-"), (rows[0].name(), "AMK_PRELOAD=0"),
                    (rows[1].name(), "-"), (rows[1].name(), "AMK_PRELOAD=0")]
    text = ab.matrix_table(done)
    assert f"{rows[0].name()} | 1.000 | 1.100" in text and "row | - | AMK_PRELOAD=0" in text
    done, skipped = ab.run_matrix([a, b], rows, 1, measure, budget_s=0, clock=lambda: now[0])
    assert len(done) == 4 and skipped == []                   # no budget: every row


def test_every_matrix_row_names_a_preset_and_a_format_decode_takes(ab):
    from amk.models.presets import PRESETS
    from amk.quant import FORMATS                 # bench/decode.py's --quant choices
    for rows in ab.MATRICES.values():
        assert len(set(rows)) == len(rows)
        for row in rows:
            assert row.model in PRESETS and (row.quant is None or row.quant in FORMATS)
            assert row.context >= 1 and row.batch >= 1


def test_shape_args_are_decode_py_arguments(ab):
    assert ab.shape_args(1, None) == ("--batch", "1")
    assert ab.shape_args(16, "int4", ["hidden=3072"]) == ("--batch", "16", "--quant", "int4", "--set", "hidden=3072")


def test_a_matrix_refuses_the_options_its_rows_set(ab):
    for extra in (["--model", "qwen3-0.6b"], ["--context", "128"], ["--batch", "4"], ["--quant", "int4"]):
        with pytest.raises(SystemExit, match="--matrix sets each row"):
            ab.main(["--matrix", "batch1", *extra, "-"])
