"""Seeded sampling: reproducible for a seed, greedy stays the default and exact, temperature 2
differs from greedy; top-k / top-p filter as specified; bad options are clear errors."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from amk.errors import TraceError  # noqa: E402
from amk.models import from_hf  # noqa: E402
from amk.models.sampling import Sampler, SamplingOptions, filter_logits  # noqa: E402

from tests.models.test_prefill import VOCAB, hf_greedy, tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def hf_and_model():
    hf = tiny_llama(seed=7)
    return hf, from_hf(hf, max_seq=64)


IDS = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(8))


def test_sampling_repeats_for_a_seed_and_temperature_2_differs_from_greedy(hf_and_model):
    hf, model = hf_and_model
    greedy = model.generate(IDS, 24, backend="reference")
    assert greedy == hf_greedy(hf, IDS, 24)                 # the default is exact greedy
    a = model.generate(IDS, 24, backend="reference", temperature=2.0, seed=11)
    b = model.generate(IDS, 24, backend="reference", temperature=2.0, seed=11)
    c = model.generate(IDS, 24, backend="reference", temperature=2.0, seed=12)
    assert a == b
    assert a != greedy and a != c
    assert model.generate(IDS, 24, backend="reference", temperature=2.0, top_k=1, seed=3) == greedy


def test_top_k_and_top_p_keep_the_specified_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    keep = lambda **kw: torch.isfinite(filter_logits(logits, SamplingOptions(1.0, **kw)))[0].tolist()  # noqa: E731
    assert keep(top_k=2) == [True, True, False, False, False]
    assert keep(top_p=0.7) == [True, True, False, False, False]      # 0.5 + 0.2 reaches 0.7
    assert keep(top_p=0.71) == [True, True, True, False, False]
    assert keep(top_p=0.1) == [True, False, False, False, False]     # the top token always stays
    assert keep(top_k=3, top_p=0.6) == [True, True, False, False, False]
    # sampled frequencies follow the filtered distribution
    s = Sampler(SamplingOptions(1.0, top_k=2, seed=0), torch.device("cpu"))
    draws = torch.stack([s.next(logits) for _ in range(2000)]).reshape(-1)
    assert set(draws.tolist()) == {0, 1}
    assert abs((draws == 0).float().mean().item() - 0.5 / 0.7) < 0.05


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=-1.0), "temperature"), (dict(top_k=-2), "top_k"), (dict(top_k=1.5), "top_k"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(seed="x"), "seed")])
def test_bad_sampling_options_are_clear_errors(kw, match):
    with pytest.raises(TraceError, match=match):
        SamplingOptions(**{"temperature": 1.0, **kw})


def test_eos_stops_and_stats_count_what_ran(hf_and_model):
    hf, model = hf_and_model
    greedy = model.generate(IDS, 10, backend="reference")
    eos = greedy[3]
    first = greedy.index(eos)
    out = model.generate(IDS, 10, backend="reference", eos_token_id=eos)
    assert out == greedy[:first + 1]
    s = model.last_stats
    assert s.new_tokens == first + 1 and s.decode_steps == first
    assert s.prompt_tokens == 12 and [c.size for c in s.prefill_chunks] == [16]
    with pytest.raises(TraceError, match="max_new_tokens"):
        model.generate(IDS, 0, backend="reference")


@pytest.mark.parametrize("sync_every", [1, 4])
def test_tokens_kept_on_the_device_between_syncs_change_nothing(hf_and_model, sync_every):
    from amk.models.generate import generate
    hf, model = hf_and_model
    ids = IDS[None].to(torch.int32)
    greedy = model.generate(IDS, 10, backend="reference")
    seen = []
    got = generate(model, ids, 10, backend="reference", sync_every=sync_every,
                   on_token=lambda i, tok, lg: seen.append((i, int(tok[0]))))
    assert got == greedy and seen == list(enumerate(greedy))
    eos = greedy[2]
    got = generate(model, ids, 10, backend="reference", sync_every=sync_every, eos_token_id=eos)
    assert got == greedy[:greedy.index(eos) + 1]
    # steps that ran past the EOS before the sync saw it are counted: they ran
    assert model.last_stats.decode_steps >= len(got) - 1


def test_prompt_ids_outside_the_vocabulary_are_a_clear_error(hf_and_model):
    _, model = hf_and_model
    with pytest.raises(TraceError, match="vocabulary"):
        model.generate([1, VOCAB + 3], 2, backend="reference")
