"""Tensor parallelism (Model.shard, amk/models/shard.py) on the rank simulator: a model sharded
over 2 or 4 ranks gives the unsharded model's logits (float32, tight) and exactly its greedy
tokens, on tiny random Llama (biases everywhere), Qwen2 (q/k/v biases) and GQA configs."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from amk.errors import TraceError  # noqa: E402
from amk.models import from_hf  # noqa: E402
from amk.models.presets import TINY_LLAMA, random_model  # noqa: E402

VOCAB, PROMPT, NEW = 96, 4, 6
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
            initializer_range=0.15, rms_norm_eps=1e-5)
CASES = {   # every case divides by 4: heads, kv heads, intermediate and vocab
    "llama_biases": lambda t: t.LlamaConfig(**TINY, attention_bias=True, mlp_bias=True),
    "qwen2_bias": lambda t: t.Qwen2Config(**TINY, rope_parameters={"rope_type": "default",
                                                                   "rope_theta": 1e6}),
    "llama_gqa_tied": lambda t: t.LlamaConfig(**{**TINY, "num_attention_heads": 8},
                                              tie_word_embeddings=True),
}


def tiny(case, seed=0):
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(CASES[case](transformers)).eval()
    with torch.no_grad():       # non-trivial norms and biases: a dropped or doubled one shows
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
    return from_hf(hf, max_seq=16)


def prompt(seed=1):
    return torch.randint(0, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_sharded_greedy_tokens_and_logits_match_unsharded(case, n):
    model = tiny(case)
    ids = prompt()
    ref_ids, ref_logits = model.generate(ids, NEW, backend="reference", return_logits=True)
    got_ids, got_logits = model.shard(n).generate(ids, NEW, return_logits=True)
    assert got_ids == ref_ids
    assert len(set(ref_ids)) > 1, "a degenerate case: the tokens should vary"
    for step, (got, ref) in enumerate(zip(got_logits, ref_logits)):
        assert got.shape == ref.shape == (1, VOCAB)
        rel = ((got - ref).abs().max() / ref.abs().max()).item()
        assert rel < 1e-5, f"{case} x{n}: step {step} logits differ by {rel:.2e} (relative)"


def test_each_rank_caches_only_its_kv_heads():
    model = tiny("llama_gqa_tied")
    c = model.config
    sharded = model.shard(2)
    kv_ref, kv = model.new_kv(), sharded.new_kv()
    assert kv[1][0]["k"].shape == (c.max_seq, c.n_kv_heads // 2, c.head_dim)
    for p, tok in enumerate(prompt().tolist()):
        token = torch.tensor([tok], dtype=torch.int32)
        pos = torch.tensor([p], dtype=torch.int32)
        ref_tok, _, kv_ref = model.step(model.params, token, pos, kv_ref)
        got_tok, _, kv = sharded.step(token, pos, kv)
        assert torch.equal(got_tok, ref_tok)
    for layer in range(c.n_layers):
        for name in ("k", "v"):
            joined = torch.cat([kv[r][layer][name] for r in range(2)], dim=1)    # kv heads side by side
            torch.testing.assert_close(joined, kv_ref[layer][name], rtol=1e-5, atol=1e-6)


def test_random_interleaving_of_ranks_gives_the_same_bits():
    model = tiny("qwen2_bias")
    ids = prompt(2)
    a_ids, a_logits = model.shard(4).generate(ids, 4, return_logits=True)
    b_ids, b_logits = model.shard(4, order="random", seed=3).generate(ids, 4, return_logits=True)
    assert a_ids == b_ids
    assert all(torch.equal(a, b) for a, b in zip(a_logits, b_logits))


def test_rank_program_has_one_allreduce_per_row_parallel_layer_and_a_maxloc():
    model = tiny("llama_biases")
    prog = model.shard(2).lower(1).program
    coll = [t for t in prog.tasks if "world" in t.params]
    assert [t.params.get("reduce", "sum") for t in coll] == ["sum"] * 2 * model.config.n_layers + ["maxloc"]
    assert all(t.params["rank"] == 1 and t.params["world"] == 2 for t in coll)


def test_shard_sizes_that_do_not_divide_are_named():
    model = tiny("qwen2_bias")            # 4 heads, 4 kv heads, ffn 96, vocab 96
    with pytest.raises(TraceError, match=r"Model.shard\(3\): 3 ranks do not divide n_heads=4, "
                                         r"n_kv_heads=4; .* divide them all: \[1, 2, 4\]"):
        model.shard(3)
    gqa = random_model(TINY_LLAMA)        # 2 kv heads
    with pytest.raises(TraceError, match=r"do not divide n_kv_heads=2; .*\[1, 2\]"):
        gqa.shard(4)
    with pytest.raises(TraceError, match="positive int"):
        gqa.shard(0)


def test_quantized_weights_are_refused_with_a_clear_error():
    model = random_model(TINY_LLAMA).quantize("int8", group=16)
    with pytest.raises(TraceError, match=r"params\['layers'\]\[0\]\['wq'\] is quantized"):
        model.shard(2)
