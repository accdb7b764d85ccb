"""from_hf on tiny random transformers models: AMK's greedy tokens equal transformers' greedy
generate, and AMK's logits match transformers' at every step (float32, reference backend)."""
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

import amk  # noqa: E402
from amk.models import from_hf  # noqa: E402

VOCAB, PROMPT, NEW = 96, 5, 20
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            initializer_range=0.15, rms_norm_eps=1e-5)

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
CASES = {
    "llama3_tied": (transformers.LlamaConfig, dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True)),
    "qwen2_bias": (transformers.Qwen2Config, dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3_qknorm": (transformers.Qwen3Config, dict(head_dim=32)),
    "mistral": (transformers.MistralConfig, dict(sliding_window=None)),
}


def tiny_hf(cls, seed=0, **kw):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cls(**TINY, **kw)).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a dropped one changes the output
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(model, ids, new):
    with torch.no_grad():
        # an explicit mask: otherwise HF treats prompt tokens equal to pad_token_id as padding
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:].tolist(), [l.float() for l in out.logits]


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_and_logits_match_transformers(case):
    cls, kw = CASES[case]
    hf = tiny_hf(cls, **kw)
    ids = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    ref_ids, ref_logits = hf_greedy(hf, ids, NEW)
    model = from_hf(hf, max_seq=32)
    got_ids, got_logits = model.generate(ids[0], NEW, backend="reference", return_logits=True)
    assert got_ids == ref_ids[0]
    assert len(got_logits) == NEW
    for step, (got, ref) in enumerate(zip(got_logits, ref_logits)):
        rel = ((got - ref).abs().max() / ref.abs().max()).item()
        assert rel < 1e-4, f"{case}: step {step} logits differ by {rel:.2e} (relative)"


def test_weights_are_shared_not_copied():
    hf = tiny_hf(transformers.Qwen2Config)
    p = from_hf(hf, max_seq=16).params
    layer = hf.model.layers[1]
    assert p["layers"][1]["wk"].data_ptr() == layer.self_attn.k_proj.weight.data_ptr()
    assert p["layers"][1]["bq"].data_ptr() == layer.self_attn.q_proj.bias.data_ptr()
    assert p["lm_head"].data_ptr() == hf.lm_head.weight.data_ptr()


def test_yarn_attention_scaling_is_folded_into_the_softmax_scale():
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}
    hf = tiny_hf(transformers.LlamaConfig, rope_parameters=rope)
    assert hf.model.rotary_emb.attention_scaling != 1.0
    ids = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(2))
    ref_ids, _ = hf_greedy(hf, ids, 8)
    assert from_hf(hf, max_seq=16).generate(ids[0], 8, backend="reference") == ref_ids[0]


def test_batch_of_two_prompts():
    hf = tiny_hf(transformers.Qwen3Config, head_dim=16)
    ids = torch.randint(0, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(3))
    ref_ids, _ = hf_greedy(hf, ids, 6)
    assert from_hf(hf, max_seq=16).generate(ids, 6, backend="reference") == ref_ids


def test_unsupported_architecture_is_a_clear_error():
    cfg = transformers.OPTConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                 ffn_dim=64, word_embed_proj_dim=32, vocab_size=64)
    with pytest.raises(amk.TraceError, match="model_type 'opt' is not supported.*gpt2"):
        from_hf(transformers.OPTForCausalLM(cfg))


def test_missing_weight_is_named():
    hf = tiny_hf(transformers.Qwen2Config)
    hf.model.layers[1].self_attn.v_proj.bias = None
    with pytest.raises(amk.TraceError, match=r"model\.layers\.1\.self_attn\.v_proj\.bias"):
        from_hf(hf)


def test_sliding_window_narrower_than_the_cache_is_honoured():
    # (tests/models/test_families.py checks the tokens of windowed Mistral and Qwen2)
    hf = tiny_hf(transformers.MistralConfig, sliding_window=8)
    assert from_hf(hf, max_seq=32).config.windows == (8, 8)
    assert from_hf(hf, max_seq=8).config.max_seq == 8


def test_generate_stops_at_eos_and_reports_each_token():
    hf = tiny_hf(transformers.LlamaConfig)
    ids = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(4))
    model = from_hf(hf, max_seq=16)
    full = model.generate(ids[0], 6, backend="reference")
    seen = []
    short = model.generate(ids[0], 6, backend="reference", eos_token_id=full[2],
                           on_token=lambda i, tok, logits: seen.append((i, int(tok[0]), tuple(logits.shape))))
    stop = full.index(full[2]) + 1
    assert short == full[:stop]
    assert seen == [(i, t, (1, VOCAB)) for i, t in enumerate(full[:stop])]


def test_to_casts_weights_keeps_ties_and_f32_rope():
    hf = tiny_hf(transformers.LlamaConfig, tie_word_embeddings=True)
    model = from_hf(hf, max_seq=16).to(dtype=torch.bfloat16)
    p = model.params
    assert p["lm_head"] is p["embed"] and p["embed"].dtype == torch.bfloat16
    assert p["layers"][0]["wq"].dtype == torch.bfloat16 and p["inv_freq"].dtype == torch.float32
    assert model.config.dtype == torch.bfloat16 and model.new_kv()[0]["k"].dtype == torch.bfloat16


@pytest.mark.parametrize("family, fmt", [("LlamaConfig", "int8"), ("LlamaConfig", "int4"),
                                         ("LlamaConfig", "fp8"), ("Qwen2Config", "int8")])
def test_quantized_model_matches_transformers_on_the_dequantized_weights(family, fmt):
    # Qwen2 has q/k/v biases: they stay float and are added in the quantized GEMV's epilogue
    from amk.quant import dequantize
    hf = tiny_hf(getattr(transformers, family), tie_word_embeddings=True)
    model = from_hf(hf, max_seq=16)
    model.quantize(fmt, group=32)
    assert model.params["layers"][0]["wq"].fmt == fmt
    assert ("bq" in model.params["layers"][0]) == (family == "Qwen2Config")
    hf_names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
                "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
                "w_down": "mlp.down_proj"}
    with torch.no_grad():   # transformers on exactly the weights the quantized GEMVs multiply by
        hf.config.tie_word_embeddings = False
        hf.lm_head.weight = torch.nn.Parameter(dequantize(model.params["lm_head"]))
        for layer, p in zip(hf.model.layers, model.params["layers"]):
            for key, name in hf_names.items():
                layer.get_submodule(name).weight.copy_(dequantize(p[key]))
    ids = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(5))
    ref_ids, ref_logits = hf_greedy(hf, ids, 8)
    got_ids, got_logits = model.generate(ids[0], 8, backend="reference", return_logits=True)
    assert got_ids == ref_ids[0]
    for got, ref in zip(got_logits, ref_logits):
        assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-4


def test_cli_ir_dumps_every_stage_and_prints_stats(tmp_path, monkeypatch, capsys):
    from amk import cli
    monkeypatch.setenv("AMK_DUMP_IR", "")      # restored after the test, whatever cli does
    assert cli.main(["ir", "--model", "tiny-llama", "--dump", str(tmp_path), "--stats", "--backend", "reference"]) == 0
    out = capsys.readouterr().out
    assert not os.environ.get("AMK_DUMP_IR")
    (folder,) = tmp_path.iterdir()
    files = sorted(p.name for p in folder.iterdir())
    assert files[0] == "00_graph.txt" and "01_lower.txt" in files
    assert "embed" in (folder / "00_graph.txt").read_text()
    stage_lines = [l.split()[0] for l in out.splitlines() if "tasks=" in l]
    assert stage_lines == ["lower", "tile", "defer_kv_append", "split_kv", "fuse", "plan_memory",
                           "allocate_counters", "place"]
    assert "balance=" in out.splitlines()[-2]          # the placed program reports its balance


def test_cli_generate_without_a_tokenizer_is_a_clear_error(capsys):
    from amk import cli
    assert cli.main(["generate", "--model", "tiny-llama", "--max-new-tokens", "2"]) == 1
    assert "has no tokenizer" in capsys.readouterr().err
