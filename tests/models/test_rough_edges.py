"""The sharp edges a new user met in the first hour (issue 25), each fixed and held here."""
import re
from pathlib import Path

import pytest
import torch

import amk
from amk import cli
from amk.cpu_threads import default_threads
from amk.errors import TraceError
from amk.models import presets

README = Path(__file__).resolve().parents[2] / "README.md"


def tiny_model(max_seq=16):
    return presets.random_model(presets.TINY_LLAMA, max_seq=max_seq)


def test_out_of_vocab_id_is_an_amk_error_and_the_model_still_generates():
    m = tiny_model()
    good = m.generate([1, 2, 3], 4, backend="reference")
    with pytest.raises(TraceError, match=r"input_ids.*token id 96.*\[0, 96\)"):
        m.generate([1, 96, 3], 4, backend="reference")
    assert m.generate([1, 2, 3], 4, backend="reference") == good


def test_a_failed_jitted_call_leaves_the_function_usable():
    m = tiny_model()
    step = m.jit("reference")
    params, token, pos, kv = m.example_args()
    ok, _, _ = step(params, token, pos, kv)
    with pytest.raises(TraceError, match=r"EMBED \(amk.ops.embed\): argument 'ids'.*1000"):
        step(params, torch.tensor([1000], dtype=torch.int32), pos, kv)
    again, _, _ = step(params, token, pos, m.new_kv())
    assert torch.equal(again, ok)


def test_float64_weight_names_the_argument():
    m = tiny_model()
    params, token, pos, kv = m.example_args()
    params = {**params, "norm": params["norm"].double()}
    with pytest.raises(TraceError, match=r"params\.norm has dtype torch.float64 \(read by "
                                         r"amk.ops.rmsnorm at .*llama.py:\d+\).*\.float\(\)"):
        m.jit("reference")(params, token, pos, kv)


def test_prompt_plus_new_tokens_may_exactly_fill_max_seq():
    m = tiny_model(max_seq=8)
    assert len(m.generate([1, 2, 3], 6, backend="reference")) == 6     # positions 0..7
    with pytest.raises(TraceError, match="needs 9 cache rows, more than max_seq 8"):
        m.generate([1, 2, 3], 7, backend="reference")


@pytest.mark.parametrize("argv, msg", [
    (["generate", "--max-new-tokens", "-1"], "--max-new-tokens: must be >= 1, got -1"),
    (["generate", "--max-seq", "0"], "--max-seq: must be >= 1, got 0"),
    (["bench", "--iters", "0"], "--iters: must be >= 1, got 0"),
    (["bench", "--max-seq", "-5"], "--max-seq: must be >= 1, got -5"),
    (["bench", "--context", "x"], "'x' is not an integer"),
])
def test_cli_rejects_bad_integers(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_cli_help_shows_defaults_and_presets(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 16)" in out and "(default: 512)" in out
    assert "tiny-llama" in out and "llama-3.2-1b" in out and "smollm2-135m" in out


def test_cpu_thread_default_does_not_oversubscribe_small_machines():
    assert default_threads(2) == 1
    assert default_threads(1) == 1
    assert default_threads(16) == 8
    assert default_threads(64) == 8


def test_readme_api_example_runs_as_written(capsys):
    pytest.importorskip("transformers")
    text = README.read_text()
    block = re.search(r"<!-- api-example -->\n```python\n(.*?)```", text, re.S)
    assert block, "README lost its API example marker"
    code = block.group(1)
    assert "int32" in code and "max_seq, n_kv_heads, head_dim" in code   # it states its inputs
    exec(compile(code, str(README), "exec"), {"__name__": "readme_example"})
    out = capsys.readouterr().out
    assert "embed" in out and re.search(r"\[\d+(, \d+){7}\]", out)
