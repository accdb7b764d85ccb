"""Batched decode on the CUDA megakernel: the Llama-3.2-1B shape (2 layers) at a user's 8192-row
cache, B sequences each at its own position (pos int32 [B]: 0, 8191 and lengths between, at
the live shard count's edges) or all at one (pos [1]), against the reference VM on the same GPU:
logits and argmax per sequence, and each cache changed only at its own row pos[b]."""
from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from amk.models.presets import LLAMA_3_2_1B, random_model  # noqa: E402

MAX_SEQ = 8192
MIXED = [0, MAX_SEQ - 1, 1023, 127, 128, 255, 4095, 1, 2047, 700, 8000, 33, 512, 3, 6000, 1500]


def _batch_step_matches_reference(batch, positions, seed):
    m = random_model(replace(LLAMA_3_2_1B, n_layers=2), device="cuda", max_seq=MAX_SEQ, seed=seed)
    kv = m.new_kv(batch)
    g = torch.Generator(device="cuda").manual_seed(seed)
    for layer in kv:
        for c in layer.values():
            c.copy_(torch.randn(c.shape, generator=g, device="cuda"))
    token = torch.randint(0, m.config.vocab, (batch,), generator=g, device="cuda", dtype=torch.int32)
    pos = torch.tensor(positions, dtype=torch.int32, device="cuda")
    out = {}
    for backend in ("cuda", "reference"):
        cache = [{k: c.clone() for k, c in layer.items()} for layer in kv]
        _, logits, cache = m.jit(backend)(m.params, token, pos, cache)
        torch.cuda.synchronize()
        out[backend] = (logits.float().reshape(batch, -1), cache)
    (got, gkv), (want, wkv) = out["cuda"], out["reference"]
    for b in range(batch):
        rel = ((got[b] - want[b]).norm() / want[b].norm()).item()
        assert rel < 2e-2, f"sequence {b} at pos {positions[b % len(positions)]}: relative error {rel:.3e}"
        assert got[b].argmax() == want[b].argmax(), f"sequence {b}: argmax differs"
    rows = positions if len(positions) == batch else positions * batch
    for gl, wl, old in zip(gkv, wkv, kv):
        for k in ("k", "v"):
            torch.testing.assert_close(gl[k].float(), wl[k].float(), rtol=2e-2, atol=4e-2)
            for b, p in enumerate(rows):       # sequence b's cache changed at row p only
                assert torch.equal(gl[k][b, :p], old[k][b, :p])
                assert torch.equal(gl[k][b, p + 1:], old[k][b, p + 1:])


@pytest.mark.parametrize("batch", [4, 16, 64])
def test_batch_with_a_position_per_sequence_matches_reference_vm(batch):
    positions = [0, MAX_SEQ - 1, 1023, 128] if batch == 4 else (MIXED * 4)[:batch]
    assert 0 in positions and MAX_SEQ - 1 in positions
    _batch_step_matches_reference(batch, positions, seed=batch)


@pytest.mark.parametrize("batch, pos", [(16, 1023), (64, 1023), (16, 0), (16, MAX_SEQ - 1)])
def test_batch_at_one_shared_position_matches_reference_vm(batch, pos):
    """The benchmark's batch (bench/decode.py --batch: every sequence at one position)."""
    _batch_step_matches_reference(batch, [pos], seed=batch + pos)


PROMPTS = [[5, 17, 3, 60, 2, 9, 41], [11, 4], [70, 8, 8, 1, 33]]


def test_ragged_generate_and_continuous_batching_on_cuda_give_the_reference_tokens():
    """Prompts of different lengths decode on the megakernel at their own positions (pos [B]),
    and a continuous batch's slots too: the tokens of the reference backend."""
    from amk.models.presets import TINY_LLAMA
    m = random_model(TINY_LLAMA, device="cuda", seed=3, max_seq=32)
    assert m.generate(PROMPTS, 6, backend="cuda") == m.generate(PROMPTS, 6, backend="reference")
    got = {}
    for backend in ("cuda", "reference"):
        batch = m.batch(3, backend=backend)
        slots = [batch.add(p) for p in PROMPTS]
        got[backend] = [batch.step() for _ in range(5)]
        assert sorted(slots) == [0, 1, 2]
    assert got["cuda"] == got["reference"]
