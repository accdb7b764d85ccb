"""Per-sequence positions: prompts of different lengths in one batch, and continuous batching,
each sequence's greedy tokens those of generating it alone (reference backend)."""
import pytest
import torch

from amk.errors import TraceError
from amk.models.presets import TINY_LLAMA, random_model

PROMPTS = [[5, 17, 3, 60, 2, 9, 41], [11, 4], [70, 8, 8, 1, 33]]


@pytest.fixture(scope="module")
def model():
    return random_model(TINY_LLAMA, seed=3, max_seq=32)


@pytest.fixture(scope="module")
def alone(model):
    return [model.generate(p, 6, backend="reference") for p in PROMPTS]


def test_prompts_of_different_lengths_decode_at_their_own_positions(model, alone):
    assert len({len(p) for p in PROMPTS}) == 3
    got = model.generate(PROMPTS, 6, backend="reference")
    assert got == alone
    assert len({tuple(a) for a in alone}) == 3              # three different continuations


def test_a_freed_slot_takes_a_new_prompt_while_the_others_go_on(model, alone):
    batch = model.batch(2, backend="reference")
    a = batch.add(PROMPTS[0])
    b = batch.add(PROMPTS[1])
    seqs = {a: [int(batch.token[a])], b: [int(batch.token[b])]}
    for _ in range(2):
        for s, t in batch.step().items():
            seqs[s].append(t)
    batch.release(a)                                 # sequence 0 is done after 3 tokens
    c = batch.add(PROMPTS[2])
    assert c == a
    third = [int(batch.token[c])]
    for _ in range(5):
        new = batch.step()
        third.append(new[c])
        seqs[b].append(new[b])
    assert seqs[a][:3] == alone[0][:3]
    assert len(seqs[b]) == 8 and seqs[b][:6] == alone[1]     # b went on across the swap
    assert third == alone[2]


def test_batch_errors_name_what_is_wrong(model):
    with pytest.raises(TraceError, match="slots must be an integer >= 2"):
        model.batch(1, backend="reference")
    batch = model.batch(2, backend="reference")
    with pytest.raises(TraceError, match="no slot holds a sequence"):
        batch.step()
    with pytest.raises(TraceError, match="slot 0 holds no sequence"):
        batch.release(0)
    batch.add([1, 2])
    batch.add([3])
    with pytest.raises(TraceError, match="all 2 slots are busy"):
        batch.add([4])
    with pytest.raises(TraceError, match="outside the model's vocabulary"):
        batch.release(0) or batch.add([10_000])
