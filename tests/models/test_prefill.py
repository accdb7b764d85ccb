"""Prefill: a prompt runs as chunks of T rows (pos int32 [T]), not T decode steps. Tokens equal
transformers' greedy ones; a 256-token prompt costs at most 16 decode steps of VM work."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import amk  # noqa: E402
from amk import ops  # noqa: E402
from amk.errors import TraceError  # noqa: E402
from amk.models import from_hf  # noqa: E402
from amk.models.prefill import Chunk, plan_chunks  # noqa: E402
from amk.passes.options import CPU, PassOptions  # noqa: E402

VOCAB = 96
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.15, rms_norm_eps=1e-5)


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY)).eval()
    hf.generation_config.eos_token_id = None
    return hf


def hf_greedy(hf, ids, new):
    with torch.no_grad():
        out = hf.generate(ids[None], attention_mask=torch.ones_like(ids[None]),
                          max_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[0, ids.numel():].tolist()


def test_plan_chunks_full_chunks_then_one_padded_tail():
    assert plan_chunks(256, 0, 512, (128, 16)) == [Chunk(0, 128, 128), Chunk(128, 128, 128)]
    assert plan_chunks(37, 0, 512, (128, 16)) == [Chunk(0, 16, 16), Chunk(16, 16, 16),
                                                  Chunk(32, 16, 5)]
    assert plan_chunks(130, 0, 512, (128, 16)) == [Chunk(0, 128, 128), Chunk(128, 16, 2)]
    # near the cache's end the tail is not padded past max_seq: smaller chunks, then steps of 1
    assert plan_chunks(20, 0, 20, (16,)) == [Chunk(0, 16, 16), Chunk(16, 1, 1), Chunk(17, 1, 1),
                                             Chunk(18, 1, 1), Chunk(19, 1, 1)]
    # the default sizes: a rest filling >= 3/4 of a size is one padded chunk of it
    assert plan_chunks(1000, 0, 1272) == [Chunk(0, 512, 512), Chunk(512, 512, 488)]
    assert plan_chunks(100, 0, 512) == [Chunk(0, 128, 100)]
    assert plan_chunks(300, 0, 512) == [Chunk(0, 128, 128), Chunk(128, 128, 128),
                                        Chunk(256, 16, 16), Chunk(272, 16, 16), Chunk(288, 16, 12)]
    # ... but never past max_seq: a 1000-token prompt in a 1016-row cache takes smaller chunks
    assert [c.size for c in plan_chunks(1000, 0, 1016)] == [512, 128, 128, 128] + [16] * 7
    with pytest.raises(TraceError, match="max_seq"):
        plan_chunks(30, 0, 20)
    with pytest.raises(TraceError, match="positive"):
        plan_chunks(3, 0, 20, (0,))


def _vm_work(jitted):
    """(program runs, task executions) of every reference VM this jitted step built, by rows."""
    out = {}
    for exe in jitted._executables.values():
        rows = next(b.shape[0] for b in exe.program.buffers if b.source == "token")
        runs, tasks = out.get(rows, (0, 0))
        out[rows] = (runs + exe.epoch, tasks + exe.epoch * len(exe.program.tasks))
    return out


def test_256_token_prompt_gives_transformers_tokens_at_most_16_decode_steps_of_work():
    hf = tiny_llama()
    ids = torch.randint(0, VOCAB, (256,), generator=torch.Generator().manual_seed(3))
    want = hf_greedy(hf, ids, 8)
    model = from_hf(hf, max_seq=272)
    got = model.generate(ids, 8, backend="reference")
    assert got == want
    stats = model.last_stats
    assert [c.size for c in stats.prefill_chunks] == [128, 128]
    assert stats.decode_steps == 7 and stats.new_tokens == 8
    # Cost proxy: task executions of the reference VM. Each task is one dispatch plus one torch
    # call over its weight tile; at these sizes that dispatch is what a task costs, for 1 row or
    # 128 (the wall clock on a real model is bench/generate.py --backend reference).
    decode_runs, decode_tasks = _vm_work(model.jit("reference")).pop(1)
    per_step = decode_tasks / decode_runs
    assert decode_runs == 7
    prefill_tasks = sum(t for _, t in _vm_work(model.prefill_jit("reference")).values())
    assert prefill_tasks <= 16 * per_step, (prefill_tasks, per_step)


def test_prefill_logits_match_transformers_forward_at_every_row():
    hf = tiny_llama(seed=1)
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(4))
    model = from_hf(hf, max_seq=64)
    step = model.jit("reference")
    kv = model.new_kv()
    _, logits, kv = step(model.params, ids.to(torch.int32), torch.arange(24, dtype=torch.int32), kv)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert (logits - ref).abs().max() / ref.abs().max() < 1e-5
    k_ref = hf(ids[None], use_cache=True).past_key_values.layers[0].keys[0]   # [n_kv, T, hd]
    assert torch.allclose(kv[0]["k"][:24].transpose(0, 1), k_ref, atol=1e-5)


def _block_attention(q, kc, vc, pos, new_k, new_v):
    kc = ops.kv_update(kc, new_k, pos)
    vc = ops.kv_update(vc, new_v, pos)
    return ops.attention(q, kc, vc, pos, n_heads=4, n_kv_heads=2, head_dim=8), kc, vc


@pytest.mark.parametrize("splits", [1, 3])
def test_block_attention_is_causal_over_cache_and_block(splits):
    g = torch.Generator().manual_seed(5)
    T, start, S = 6, 5, 16
    q = torch.randn(T, 32, generator=g)
    new_k, new_v = torch.randn(T, 16, generator=g), torch.randn(T, 16, generator=g)
    kc, vc = torch.randn(S, 2, 8, generator=g), torch.randn(S, 2, 8, generator=g)
    pos = torch.arange(start, start + T, dtype=torch.int32)
    f = amk.jit(_block_attention, backend="reference", donate=("kc", "vc"),
                options=PassOptions(target=CPU, attn_splits=splits))
    k_all, v_all = kc.clone(), vc.clone()
    k_all[start:start + T] = new_k.view(T, 2, 8)
    v_all[start:start + T] = new_v.view(T, 2, 8)
    out, kc2, vc2 = f(q, kc, vc, pos, new_k, new_v)
    assert torch.equal(kc2, k_all) and torch.equal(vc2, v_all)
    for t in range(T):                   # row t: an independent decode attention at start + t
        n = start + t + 1
        kk = k_all[:n].repeat_interleave(2, dim=1)        # [n, 4, 8]
        vv = v_all[:n].repeat_interleave(2, dim=1)
        s = torch.einsum("hd,nhd->hn", q[t].view(4, 8), kk) / 8 ** 0.5
        ref = torch.einsum("hn,nhd->hd", s.softmax(-1), vv).reshape(-1)
        assert torch.allclose(out[t], ref, atol=1e-5), t


def test_positions_must_be_one_per_row():
    def f(x, pos):
        return ops.rope(x, pos, head_dim=8)
    with pytest.raises(TraceError, match=r"one position per row"):
        amk.jit(f, backend="reference")(torch.zeros(4, 16), torch.zeros(3, dtype=torch.int32))

    def g(q, kc, vc, pos):
        return ops.attention(q, kc, vc, pos, n_heads=2, n_kv_heads=2, head_dim=8)
    cache = torch.zeros(3, 8, 2, 8)      # 3 sequences' caches for 2 rows: neither a block of
    with pytest.raises(TraceError, match="single-sequence cache"):     # one nor one per row
        amk.jit(g, backend="reference")(torch.zeros(2, 16), cache, cache,
                                        torch.zeros(2, dtype=torch.int32))


def test_cuda_backend_refuses_a_block_program():
    from amk.program.positions import prompt_block_tasks
    hf = tiny_llama()
    model = from_hf(hf, max_seq=32)
    step = model.jit("reference")
    kv = model.new_kv()
    block = step.lower(model.params, torch.zeros(4, dtype=torch.int32),
                       torch.arange(4, dtype=torch.int32), kv).program
    decode = step.lower(*model.example_args()).program
    ragged = step.lower(model.params, torch.zeros(4, dtype=torch.int32),    # a position a sequence
                        torch.arange(4, dtype=torch.int32), model.new_kv(4)).program
    assert prompt_block_tasks(block) and not prompt_block_tasks(decode)
    assert not prompt_block_tasks(ragged)


def test_batched_prompts_prefill_each_sequence():
    hf = tiny_llama(seed=2)
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(6))
    want = [hf_greedy(hf, ids[b], 6) for b in range(2)]
    model = from_hf(hf, max_seq=48)
    assert model.generate(ids, 6, backend="reference") == want
    assert [c.size for c in model.last_stats.prefill_chunks] == [16, 16, 16, 16]


def test_generate_reuses_its_caches_and_stale_rows_never_leak():
    """generate keeps its caches between calls (stable addresses for captured graphs): a long
    prompt, then a short one on the same caches, then batch 2, each gives transformers' tokens."""
    hf = tiny_llama(seed=3)
    g = torch.Generator().manual_seed(9)
    long, short = torch.randint(0, VOCAB, (40,), generator=g), torch.randint(0, VOCAB, (7,), generator=g)
    model = from_hf(hf, max_seq=64)
    assert model.generate(long, 6, backend="reference") == hf_greedy(hf, long, 6)
    kv = model.generation_kv(1)
    assert model.generate(short, 6, backend="reference") == hf_greedy(hf, short, 6)
    assert model.generation_kv(1) is kv and bool(kv[0]["k"][40].abs().sum() > 0)   # rows left
    both = torch.stack([short, long[:7]])
    assert model.generate(both, 3, backend="reference") == [hf_greedy(hf, r, 3) for r in both]
    assert model.generation_kv(2)[0]["k"].shape[0] == 2


def test_a_rest_of_3_4_of_a_chunk_runs_as_one_padded_chunk_with_transformers_tokens():
    hf = tiny_llama(seed=5)
    ids = torch.randint(0, VOCAB, (120,), generator=torch.Generator().manual_seed(8))
    want = hf_greedy(hf, ids, 4)
    model = from_hf(hf, max_seq=160)
    assert model.generate(ids, 4, backend="reference") == want
    assert [(c.size, c.tokens) for c in model.last_stats.prefill_chunks] == [(128, 120)]


def test_a_padded_chunk_puts_its_last_real_token_in_the_last_row():
    from amk.models.prefill import row_positions
    assert row_positions(Chunk(10, 8, 5)).tolist() == [10, 11, 12, 13, 15, 16, 17, 14]
    assert row_positions(Chunk(10, 4, 4)).tolist() == [10, 11, 12, 13]
    assert row_positions(Chunk(3, 4, 1)).tolist() == [4, 5, 6, 3]
    assert row_positions(Chunk(7, 1, 1)).tolist() == [7]


def test_the_chunk_program_runs_norm_and_lm_head_on_its_last_row_only():
    hf = tiny_llama(seed=6)
    ids = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(2))
    model = from_hf(hf, max_seq=32)
    from amk.models.prefill import chunk_args, prefill
    low = model.prefill_jit("reference").lower(*chunk_args(model, Chunk(0, 16, 13), model.new_kv()))
    heads = [t for t in low.program.tasks if "lm_head" in t.name]
    assert heads and all(low.program.buffers[t.outputs[0]].shape[0] == 1 for t in heads)
    logits = prefill(model, ids, model.new_kv(), "reference", sizes=(16,))   # one padded chunk
    with torch.no_grad():
        ref = hf(ids[None].long()).logits[0, -1]
    assert logits.shape == ref.shape
    assert (logits - ref).abs().max() / ref.abs().max() < 1e-5
