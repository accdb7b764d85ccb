"""from_hf for Gemma 2 / 3, Phi-3, GPT-2, OLMo 2 and sliding-window Mistral / Qwen2 on tiny
random float32 configs with odd sizes and sliding windows shorter than the generation: AMK's
greedy tokens equal transformers' greedy generate, and the logits match at every step."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from amk.models import from_hf  # noqa: E402
from amk.models.decoder import FamilyConfig  # noqa: E402
from test_models import hf_greedy  # noqa: E402   (one greedy-generate helper for both)

VOCAB, PROMPT, NEW = 97, 5, 14         # 18 positions: every window below is shorter
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
COMMON = dict(vocab_size=VOCAB, hidden_size=40, intermediate_size=56, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              initializer_range=0.15, rms_norm_eps=1e-5, **SPECIAL)


def cases():
    t = transformers
    return {
        "gemma2": lambda: t.Gemma2Config(**{**COMMON, "hidden_size": 36}, head_dim=12,
                                         query_pre_attn_scalar=10, sliding_window=6,
                                         attn_logit_softcapping=4.0, final_logit_softcapping=3.0),
        "gemma3": lambda: t.Gemma3TextConfig(**COMMON, head_dim=10, query_pre_attn_scalar=10,
                                             sliding_window=5, sliding_window_pattern=2,
                                             rope_parameters={
                                                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                 "full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
        "phi3": lambda: t.Phi3Config(**{**COMMON, "hidden_size": 60, "num_attention_heads": 6,
                                        "num_key_value_heads": 3}, sliding_window=7),
        "gpt2": lambda: t.GPT2Config(vocab_size=VOCAB, n_embd=36, n_layer=2, n_head=3, n_positions=64,
                                     initializer_range=0.15, **SPECIAL),
        "olmo2": lambda: t.Olmo2Config(**COMMON),
        "mistral_window": lambda: t.MistralConfig(**COMMON, sliding_window=5, head_dim=10),
        "qwen2_window": lambda: t.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=4,
                                              max_window_layers=1),
    }


def tiny_hf(config, seed=0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    gemma = config.model_type.startswith("gemma")
    with torch.no_grad():        # non-trivial norms and biases: a dropped one changes the output
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name:
                if name.endswith("weight"):
                    p.copy_((0 if gemma else 1) + 0.3 * torch.randn_like(p))
                else:
                    p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("case", list(cases()))
def test_greedy_tokens_and_logits_match_transformers(case):
    _assert_matches_transformers(case, tiny_hf(cases()[case]()))


@pytest.mark.parametrize("case", ["gemma3", "qwen2_window"])
def test_eight_layer_models_compile_stamped_and_match_transformers(case, monkeypatch):
    """With 8 layers the compile stamps its local passes (passes/stamp.py): Gemma 3's layers
    repeat in pairs (sliding, full), Qwen2's first layer is unlike the others (max_window_layers
    1); the stamped programs still give transformers' logits and tokens."""
    from amk.passes import pipeline
    used = []
    real = pipeline.stamped
    monkeypatch.setattr(pipeline, "stamped", lambda *a, **k: used.append(real(*a, **k)) or used[-1])
    monkeypatch.setitem(COMMON, "num_hidden_layers", 8)
    _assert_matches_transformers(case, tiny_hf(cases()[case]()))
    assert used and all(p is not None for p in used)  # every compile (prefill chunk, decode) stamped


def _assert_matches_transformers(case, hf):
    ids = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    ref_ids, ref_logits = hf_greedy(hf, ids, NEW)
    model = from_hf(hf, max_seq=24)
    assert isinstance(model.config, FamilyConfig)
    got_ids, got_logits = model.generate(ids[0], NEW, backend="reference", return_logits=True)
    for step, (got, ref) in enumerate(zip(got_logits, ref_logits)):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4, msg=f"{case} step {step}")
    assert got_ids == ref_ids[0]


def test_the_windows_and_caps_reach_the_program():
    """Gemma 2's sliding layers, soft-caps and GeGLU show up where they should."""
    from amk.program.ir import InstructionKind as K
    hf = tiny_hf(cases()["gemma2"]())
    m = from_hf(hf, max_seq=24)
    assert m.config.windows == (6, None, 6) and m.config.attn_softcap == 4.0
    low = m.lower("reference")
    attn = [e.p for e in low.graph.eqns if e.prim == "attention"]
    assert [p.get("window") for p in attn] == [6, None, 6]
    assert all(p["softcap"] == 4.0 for p in attn)
    assert [e.p["cap"] for e in low.graph.eqns if e.prim == "softcap"] == [3.0]
    lowered = low.programs["lower"].tasks
    assert [t.params.get("window") for t in lowered if t.op is K.ATTENTION_TILE] == [6, None, 6]
    assert any(t.op is K.SOFTCAP for t in low.program.tasks)


def test_a_window_at_least_max_seq_is_plain_attention():
    hf = tiny_hf(cases()["mistral_window"]())
    m = from_hf(hf, max_seq=5)
    assert not isinstance(m.config, FamilyConfig)      # the Llama step: nothing to clamp


def test_batch_of_two_gpt2_prompts_broadcasts_the_learned_positions():
    hf = tiny_hf(cases()["gpt2"]())
    ids = torch.randint(3, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(2))
    ref_ids, _ = hf_greedy(hf, ids, 6)
    assert from_hf(hf, max_seq=16).generate(ids, 6, backend="reference") == ref_ids


def test_float64_model_is_refused_by_name():
    from amk.errors import TraceError
    hf = tiny_hf(cases()["olmo2"]()).double()
    with pytest.raises(TraceError, match="float64 are not supported.*dtype=torch.float32"):
        from_hf(hf)
