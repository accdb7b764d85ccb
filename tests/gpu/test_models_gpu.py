"""Whole models on the CUDA megakernel: tiny HF models against transformers, a Llama-3.2-1B-shaped
model against the reference VM on the GPU (32 steps from an empty cache; one step on a cache of
history at the benchmark's split-KV schedule), and 1,000 repeated steps (no race; also with a
combine task a kv group, head dim 128); the preset shapes at a user's cache."""
from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from amk.models.presets import LLAMA_3_2_1B, LLAMA_3_8B, QWEN3_0_6B, random_model  # noqa: E402

I32 = torch.int32


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_hf_models_on_cuda_match_transformers(arch):
    transformers = pytest.importorskip("transformers")
    from amk.models import from_hf
    cls = transformers.LlamaConfig if arch == "llama" else transformers.Qwen3Config
    torch.manual_seed(0)
    cfg = cls(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              initializer_range=0.15)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval().cuda()
    hf.generation_config.eos_token_id = None
    ids = torch.randint(0, 96, (1, 5), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20,
                          do_sample=False, pad_token_id=0)[0, 5:].tolist()
    m = from_hf(hf, max_seq=32)
    assert m.generate(ids[0], 20, backend="cuda") == ref


def _teacher_forced(m, backend, tokens, start):
    step = m.jit(backend)
    params, _, pos, kv = m.example_args()
    logits_all = []
    for i, t in enumerate(tokens):
        pos.fill_(start + i)
        _, logits, kv = step(params, torch.tensor([t], dtype=I32, device="cuda"), pos, kv)
        logits_all.append(logits.float().clone())
    return logits_all


def test_llama_1b_shape_cuda_matches_reference_vm_for_32_steps():
    m = random_model(LLAMA_3_2_1B, device="cuda", max_seq=128, seed=3)
    tokens = torch.randint(0, LLAMA_3_2_1B.vocab, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    got = _teacher_forced(m, "cuda", tokens, 0)
    want = _teacher_forced(m, "reference", tokens, 0)
    agree = 0
    for i, (g, w) in enumerate(zip(got, want)):
        rel = ((g - w).norm() / w.norm()).item()
        assert rel < 2e-2, f"step {i}: relative error {rel:.3e}"
        agree += int(g.argmax() == w.argmax())
    assert agree >= 30, f"argmax agreed on only {agree}/32 steps"


def _step_with_history_matches_reference(cfg, max_seq, pos, seed):
    """One step of cfg's model on a cache full of history at pos: logits, argmax and both caches
    (only row pos written) of the cuda backend against the reference VM on the same GPU."""
    m = random_model(cfg, device="cuda", max_seq=max_seq, seed=seed)
    params, token, p, kv = m.example_args()
    g = torch.Generator(device="cuda").manual_seed(pos)
    for layer in kv:
        for c in layer.values():
            c.copy_(torch.randn(c.shape, generator=g, device="cuda"))
    token.fill_(11)
    p.fill_(pos)
    out = {}
    for backend in ("cuda", "reference"):
        cache = [{k: c.clone() for k, c in layer.items()} for layer in kv]
        _, logits, cache = m.jit(backend)(params, token, p, cache)
        out[backend] = (logits.float(), cache)
    (got, gkv), (want, wkv) = out["cuda"], out["reference"]
    assert ((got - want).norm() / want.norm()).item() < 2e-2
    assert got.argmax() == want.argmax()
    for gl, wl in zip(gkv, wkv):
        for k in ("k", "v"):
            # the new row: bf16 values up to ~4 (an ulp 0.016), rounded in another order
            torch.testing.assert_close(gl[k].float(), wl[k].float(), rtol=2e-2, atol=4e-2)
            assert torch.equal(gl[k][:pos], wl[k][:pos]) and torch.equal(gl[k][pos + 1:], wl[k][pos + 1:])


@pytest.mark.parametrize("pos", [0, 136, 137, 700, 1087])
def test_llama_1b_shape_split_kv_step_with_history_matches_reference_vm(pos):
    """The benchmark's schedule at a sized cache (max_seq 1088: 8 KV shards a kv head, the
    combine folded into the o tiles and their weights preloaded, the new K/V rows read by the
    attention and appended after it), pos at shard edges."""
    _step_with_history_matches_reference(replace(LLAMA_3_2_1B, n_layers=2), 1088, pos, seed=5)


SHAPES = {"qwen3-0.6b": replace(QWEN3_0_6B, n_layers=2),              # head dim 128, qk-norm
          "qwen2-biases": replace(LLAMA_3_2_1B, n_layers=2, qkv_bias=True),
          "llama-3-8b": replace(LLAMA_3_8B, n_layers=1)}


# 8192 rows, R = 128: the biases' 1B shape P = 8 folded (the o tile's staging area holds 8
# partials), Qwen3 and the 8B (head dim 128) P = 16 and a combine task a kv group (split_kv):
# live shards 1 (0, 127, 254), 2 (255: the first step with two), 8 (1023: all of P = 8), 11, 15,
# 16 (1500, 2046, 2047), then ever longer shards (4095, 8191)
@pytest.mark.parametrize("pos", [0, 127, 254, 255, 1023, 1500, 2046, 2047, 4095, 8191])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_preset_shapes_at_a_users_cache_match_reference_vm(shape, pos):
    """The cache a user allocates (8192 rows: split-KV over the live window [0, pos], P from the
    capacity, the live shard count from pos) for the other preset shapes and biases, from an
    empty-ish to a full cache, at the positions where the live count changes."""
    _step_with_history_matches_reference(SHAPES[shape], 8192, pos, seed=6)


@pytest.mark.parametrize("pos", [0, 1023, 8191])
def test_llama_1b_shape_at_a_users_cache_matches_reference_vm(pos):
    """The 1B shape at 8192 rows (P from the capacity, the combine folded into the o tiles)."""
    _step_with_history_matches_reference(replace(LLAMA_3_2_1B, n_layers=2), 8192, pos, seed=6)


def _repeated_steps_are_identical(cfg, max_seq, pos, combines=None):
    """The same step (same row rewritten) 1,000 times: the same logits every time (a race
    would show as a different result). combines: the ATTENTION_COMBINE tasks it must have."""
    m = random_model(cfg, device="cuda", max_seq=max_seq, seed=4)
    step = m.jit("cuda")
    params, token, p, kv = m.example_args()
    token.fill_(7)
    p.fill_(pos)
    if combines is not None:
        from amk.program.ir import InstructionKind as K
        prog = step.lower(params, token, p, kv).program
        assert sum(t.op is K.ATTENTION_COMBINE for t in prog.tasks) == combines
    first = None
    for _ in range(1000):
        ids, logits, kv = step(params, token, p, kv)
        if first is None:
            first = logits.clone()
        elif not torch.equal(logits, first):
            raise AssertionError("a repeated step gave a different result: a race")
    torch.cuda.synchronize()


def test_one_thousand_repeated_steps_are_identical():
    _repeated_steps_are_identical(replace(LLAMA_3_2_1B, n_layers=2, vocab=4096), 256, 100)


@pytest.mark.parametrize("preset, combines", [("QWEN3_0_6B", 0), ("LLAMA_3_8B", 2 * 8)])
def test_head_dim_128_split_kv_gives_the_same_result_for_1000_steps(preset, combines):
    """Head dim 128 at batch 1, 15 live shards of 16 a group: Qwen3-0.6B's 16 partials folded
    into every o tile (staged from the end of its x, up to the preload), the 8B's larger ones
    merged by one combine task a kv group."""
    from amk.models import presets
    cfg = replace(getattr(presets, preset), n_layers=2, vocab=4096)
    _repeated_steps_are_identical(cfg, 4096, 2000, combines=combines)


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_tiny_llama_generates_the_reference_tokens(backend):
    from amk.models.presets import TINY_LLAMA
    m = random_model(TINY_LLAMA, device="cuda", seed=5)
    prompt = [3, 14, 15, 92, 65]
    assert m.generate(prompt, 12, backend=backend) == m.generate(prompt, 12, backend="reference")
