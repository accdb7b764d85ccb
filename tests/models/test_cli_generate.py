"""`amk generate`: streams the text as tokens arrive, counts only what ran (EOS stops), keeps the
prompt apart from the answer under --chat, and takes the sampling flags."""
import pytest
import torch

pytest.importorskip("transformers")

from amk import cli  # noqa: E402
from amk.cli_stream import TextStream  # noqa: E402
from amk.models import from_hf  # noqa: E402

from tests.models.test_prefill import tiny_llama  # noqa: E402


class CharTokenizer:
    """ids = printable byte - 31 (1..95; 0 is EOS); enough of a tokenizer for the CLI."""
    eos_token_id = 0

    def __call__(self, text):
        return type("Enc", (), {"input_ids": [b - 31 for b in text.encode()]})()

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i + 31 for i in ids if i > 0).decode(errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return self(f"<user>{messages[0]['content']}<assistant>").input_ids


@pytest.fixture(scope="module")
def model():
    m = from_hf(tiny_llama(seed=9), max_seq=96)      # vocab 96: ids 1..95 are printable bytes
    m.tokenizer = CharTokenizer()
    return m


def _run(model, monkeypatch, capsys, *extra):
    monkeypatch.setattr(cli, "load_model", lambda name, max_seq: model)
    rc = cli.main(["generate", "--prompt", "hi", "--max-new-tokens", "12", "--backend",
                   "reference", *extra])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out, err


def test_generate_streams_each_token_and_reports_what_ran(model, monkeypatch, capsys):
    seen = []
    real = TextStream.add

    def spy(self, tok):                 # what stdout holds when each token arrives
        real(self, tok)
        seen.append(capsys.readouterr().out)
    monkeypatch.setattr(TextStream, "add", spy)
    out, err = _run(model, monkeypatch, capsys, "--ignore-eos")
    streamed = "".join(seen) + out
    want = model.decode(model.generate(model.tokenizer("hi").input_ids, 12, backend="reference"))
    assert streamed == "hi" + want + "\n"
    assert sum(1 for s in seen if s) >= 2             # text arrived in pieces, not at the end
    assert "11 decode steps" in err and "1 prefill chunks" in err and "tokens/s" in err


def test_stats_count_only_steps_that_ran_before_eos(model, monkeypatch, capsys):
    ids = model.tokenizer("hi").input_ids
    greedy = model.generate(ids, 12, backend="reference")
    model.tokenizer.eos_token_id = greedy[2]
    try:
        out, err = _run(model, monkeypatch, capsys)
    finally:
        model.tokenizer.eos_token_id = 0
    n = greedy.index(greedy[2]) + 1
    assert f"{n} new tokens" in err and f"{n - 1} decode steps" in err


def test_chat_prints_the_prompt_apart_from_the_answer(model, monkeypatch, capsys):
    out, _ = _run(model, monkeypatch, capsys, "--chat", "--ignore-eos")
    first, second = out.split("\n", 1)
    assert first == "user: hi"
    assert second.startswith("assistant: ") and len(second) > len("assistant: \n")


def test_sampling_flags_repeat_for_a_seed(model, monkeypatch, capsys):
    flags = ("--ignore-eos", "--temperature", "2", "--top-k", "20", "--top-p", "0.9")
    a, _ = _run(model, monkeypatch, capsys, *flags, "--seed", "4")
    b, _ = _run(model, monkeypatch, capsys, *flags, "--seed", "4")
    greedy, _ = _run(model, monkeypatch, capsys, "--ignore-eos")
    assert a == b and a != greedy
    rc = cli.main(["generate", "--prompt", "hi", "--backend", "reference", "--top-p", "2"])
    assert rc == 1 and "top_p" in capsys.readouterr().err


def test_text_stream_waits_for_a_whole_character():
    import io
    out = io.StringIO()
    s = TextStream(lambda ids: bytes(ids).decode(errors="replace"), out)
    for b in "é!".encode():
        s.add(b)
        assert "\ufffd" not in out.getvalue()
    s.close()
    assert out.getvalue() == "é!\n"
