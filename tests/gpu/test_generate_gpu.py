"""On a GPU: generate with a chunked prefill (prompt chunks on the triton backend, decode on the
megakernel) gives transformers' greedy tokens after a 256-token prompt; seeded sampling repeats;
asynchronous megakernel steps raise a fault at the next call, naming the task."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

transformers = pytest.importorskip("transformers")

from amk.errors import DeadlockError, TraceError  # noqa: E402

VOCAB = 96


def _tiny_hf(seed=0, max_pos=512):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=max_pos,
                                   initializer_range=0.15)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval().cuda()
    hf.generation_config.eos_token_id = None
    return hf


def _prompt_and_greedy(hf, n: int, new: int, seed: int):
    """A random n-token prompt on the GPU and transformers' greedy new tokens after it."""
    ids = torch.randint(0, VOCAB, (1, n), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(seed))
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                          do_sample=False, pad_token_id=0)[0, n:].tolist()
    return ids, ref


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_256_token_prompt_gives_transformers_greedy_tokens(backend):
    from amk.models import from_hf
    hf = _tiny_hf()
    ids, ref = _prompt_and_greedy(hf, 256, 16, seed=1)
    m = from_hf(hf, max_seq=288)
    assert m.generate(ids[0], 16, backend=backend) == ref
    s = m.last_stats
    assert [c.size for c in s.prefill_chunks] == [128, 128] and s.decode_steps == 15


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_1000_token_prompt_in_two_512_row_chunks_gives_transformers_tokens(backend):
    # issue 24's prompt length: chunks 512 + 512 (488 real rows), one task per op, each chunk
    # program captured once and replayed for the next chunk and the next call
    from amk.models import from_hf
    from amk.models.prefill import Chunk, chunk_args
    hf = _tiny_hf(seed=4, max_pos=1280)
    ids, ref = _prompt_and_greedy(hf, 1000, 8, seed=7)
    m = from_hf(hf, max_seq=1272)
    assert m.generate(ids[0], 8, backend=backend) == ref
    assert [(c.size, c.tokens) for c in m.last_stats.prefill_chunks] == [(512, 512), (512, 488)]
    step = m.prefill_jit(backend)
    low = step.lower(*chunk_args(m, Chunk(0, 512, 512), m.new_kv()))
    assert len(low.program.tasks) == len(low.programs["lower"].tasks)   # no tiles
    key = next(k for k, v in step._cache.items() if v is low)
    exe = next(e for (k, _), e in step._executables.items() if k == key)
    assert exe.captures == 1        # the second chunk replayed the first one's capture
    assert m.generate(ids[0], 8, backend=backend) == ref
    assert exe.captures <= 2        # a new call's cache: at most one more capture


def test_1000_token_bf16_prefill_on_triton_matches_the_reference_vm():
    # a Llama-3-shaped head (head_dim 64, GQA 4) in bf16: the tensor-core GEMM tiles, the block
    # attention and the last-row LM head of the triton chunks against the reference VM's prefill
    from amk.models import from_hf
    from amk.models.prefill import prefill
    torch.manual_seed(11)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024,
                                   num_hidden_layers=2, num_attention_heads=8,
                                   num_key_value_heads=2, max_position_embeddings=1280,
                                   initializer_range=0.05)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    m = from_hf(hf, max_seq=1272, dtype=torch.bfloat16).to("cuda")
    ids = torch.randint(0, 512, (1000,), generator=torch.Generator().manual_seed(3))
    kv_ref, kv_tri = m.new_kv(), m.new_kv()
    want = prefill(m, ids, kv_ref, "reference").float()
    got = prefill(m, ids, kv_tri, "triton").float()
    assert got.shape == want.shape == (512,)
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()
    # the same token, unless the reference's top two are closer than the tolerance
    assert float(want[int(got.argmax())]) >= float(want.max()) - 2e-2 * float(want.abs().max())
    for a, b in zip(kv_tri, kv_ref):          # every prompt row's K/V (rows past 1000: padding)
        for name in ("k", "v"):
            torch.testing.assert_close(a[name][:1000].float(), b[name][:1000].float(),
                                       rtol=3e-2, atol=3e-2)


def test_seeded_sampling_repeats_on_the_gpu():
    from amk.models import from_hf
    m = from_hf(_tiny_hf(seed=2), max_seq=64)
    ids = list(range(1, 20))
    a = m.generate(ids, 16, backend="cuda", temperature=2.0, seed=5)
    assert a == m.generate(ids, 16, backend="cuda", temperature=2.0, seed=5)
    assert a != m.generate(ids, 16, backend="cuda")


def test_asynchronous_step_fault_raises_at_the_next_call_naming_the_task():
    import amk
    from amk import ops

    def step(cache, new, pos):
        return ops.kv_update(cache, new, pos)
    f = amk.jit(step, backend="cuda", donate=("cache",))
    cache = torch.zeros(8, 2, 4, device="cuda")
    new = torch.ones(1, 8, device="cuda")
    f(cache, new, torch.tensor([3], dtype=torch.int32, device="cuda"))
    f.sync()
    f(cache, new, torch.tensor([50], dtype=torch.int32, device="cuda"))  # returns: no sync
    torch.cuda.synchronize()
    with pytest.raises(TraceError, match="KV_APPEND position 50"):
        f(cache, new, torch.tensor([4], dtype=torch.int32, device="cuda"))
    f(cache, new, torch.tensor([4], dtype=torch.int32, device="cuda"))    # reset, runs again
    f.sync()
    assert torch.equal(cache[4], torch.ones(2, 4, device="cuda"))


def test_asynchronous_deadlock_raises_at_sync_without_hanging(monkeypatch):
    monkeypatch.setenv("AMK_WATCHDOG_S", "0.2")
    from amk.backends.cuda import CudaProgram
    from amk.program.ir import BufferKind as BK, DType as D, InstructionKind as K
    from amk.testing.cuda_examples import Builder
    b = Builder("stuck")
    x = b.buf("x", BK.IO_INPUT, D.F32, (8,))
    y = b.buf("y", BK.IO_OUTPUT, D.F32, (8,))
    c = b.task(K.COPY, [x], [y])
    b.task(K.COPY, [x], [y], waits=[(c, 5)], name="waits_forever")
    b.outputs = [y]
    cp = CudaProgram(b.program(), "cuda", validate=False, sync_each_run=False)
    cp.run({"x": torch.ones(8, device="cuda")})          # returns at once
    with pytest.raises(DeadlockError, match="waits_forever"):
        cp.check()


# -- the device loop: sync_every steps of the cuda backend captured in one CUDA graph ----------
def _per_step(monkeypatch):
    """Generate without the device loop (the plain per-step path) inside this context."""
    import amk.models.generate as g
    monkeypatch.setattr(g, "device_loop", lambda *a, **k: None)


def _graph_model(seed=3, max_seq=128):
    from amk.models import from_hf
    return from_hf(_tiny_hf(seed=seed), max_seq=max_seq)


@pytest.mark.parametrize("kw", [{}, {"temperature": 1.5, "seed": 7},
                                {"temperature": 1.0, "top_k": 5, "top_p": 0.9, "seed": 1}])
def test_graph_loop_gives_the_per_step_tokens(monkeypatch, kw):
    m = _graph_model()
    ids = list(range(3, 40))
    got = m.generate(ids, 45, backend="cuda", **kw)       # 44 steps: 1 eager, 5 replays, 3 eager
    s = m.last_stats
    assert s.graph_replays == 5 and s.decode_steps == 44 and len(got) == 45
    with monkeypatch.context() as mp:
        _per_step(mp)
        ref = m.generate(ids, 45, backend="cuda", **kw)
        assert m.last_stats.graph_replays == 0
    assert got == ref
    if not kw:
        from amk.models.generate import generate
        assert m.generate(ids, 45, backend="reference") == got   # exact greedy on the oracle too
        two = [torch.tensor(ids, dtype=torch.int32), torch.tensor(ids[::-1], dtype=torch.int32)]
        batch = generate(m, two, 20, backend="cuda")
        assert m.last_stats.graph_replays == 2
        with monkeypatch.context() as mp:
            _per_step(mp)
            assert generate(m, two, 20, backend="cuda") == batch


def test_the_captured_loop_is_kept_between_calls(monkeypatch):
    """A second call replays the first call's graph (no capture in its timed decode) and gives
    its own tokens: greedy the same, a new seed its own draws, an old seed its old ones."""
    from amk.models.device_loop import DeviceLoop
    m = _graph_model()
    ids = list(range(3, 40))
    captures = []
    real = DeviceLoop._capture
    monkeypatch.setattr(DeviceLoop, "_capture", lambda self: (captures.append(1), real(self)))
    greedy = m.generate(ids, 30, backend="cuda")
    assert m.generate(ids, 30, backend="cuda") == greedy and len(captures) == 1
    assert m.last_stats.graph_replays == 3
    a = m.generate(ids, 30, backend="cuda", temperature=1.5, seed=1)
    b = m.generate(ids, 30, backend="cuda", temperature=1.5, seed=2)
    assert len(captures) == 2                   # greedy and sampled steps are different graphs
    assert m.generate(ids, 30, backend="cuda", temperature=1.5, seed=1) == a != b
    with monkeypatch.context() as mp:
        _per_step(mp)
        assert m.generate(ids, 30, backend="cuda", temperature=1.5, seed=2) == b
    assert len(captures) == 2
    assert m.generate(ids[:20], 30, backend="cuda") == m.generate(ids[:20], 30, backend="reference")


def test_graph_loop_stops_at_eos_and_keeps_logits(monkeypatch):
    m = _graph_model()
    ids = list(range(5, 30))
    greedy = m.generate(ids, 40, backend="cuda")
    eos = greedy[21]                    # inside the third replay
    cut = greedy[:greedy.index(eos) + 1]
    assert m.generate(ids, 40, backend="cuda", eos_token_id=eos) == cut
    assert m.last_stats.new_tokens == len(cut)
    if len(cut) > 10:                   # the tiny model's tokens repeat: EOS may come early
        assert m.last_stats.graph_replays >= 1
    assert m.generate(ids, 40, backend="cuda", eos_token_id=greedy[0]) == greedy[:1]
    seen = []
    toks, logits = m.generate(ids, 20, backend="cuda", return_logits=True,
                              on_token=lambda i, t, lg: seen.append((i, int(t[0]))))
    assert m.last_stats.graph_replays == 2
    with monkeypatch.context() as mp:
        _per_step(mp)
        ref_toks, ref_logits = m.generate(ids, 20, backend="cuda", return_logits=True)
    assert toks == ref_toks == greedy[:20] and seen == list(enumerate(toks))
    assert len(logits) == 20 and all(torch.equal(a, b) for a, b in zip(logits, ref_logits))
    assert [int(lg.argmax()) for lg in logits] == toks


def test_a_fault_inside_a_replay_raises_and_the_next_generate_runs():
    from amk.models.device_loop import device_loop
    from amk.models.sampling import Sampler, SamplingOptions
    m = _graph_model(max_seq=64)
    step = m.jit("cuda")
    params, token, pos, kv = m.example_args()
    pos.fill_(40)                       # 33 steps reach row 72 of a 64-row cache: replay 3
    sampler = Sampler(SamplingOptions(), m.device)
    loop = device_loop(step, (params, token, pos, kv), sampler, token, 8, None, False)
    assert loop is not None
    with pytest.raises(TraceError, match="KV_APPEND position"):
        loop.run(33, lambda *a: False)
    ids = list(range(3, 20))
    assert m.generate(ids, 20, backend="cuda") == m.generate(ids, 20, backend="reference")


def test_bad_inputs_still_raise_after_fast_calls():
    m = _graph_model()
    step = m.jit("cuda")
    params, token, pos, kv = m.example_args()
    a = step(params, token, pos, kv)[1].clone()
    pos.fill_(0)
    b = step(params, token, pos, kv)[1]                  # the fast path: same tensors
    assert torch.equal(a, b)
    exe, bindings = step.executable(params, token, pos, kv)
    bad = dict(bindings)
    bad["kv.0.k"] = torch.zeros(3, device="cuda", dtype=bindings["kv.0.k"].dtype)
    with pytest.raises(TraceError, match="expects"):
        exe.run(bad)
    bad = dict(bindings)
    bad["token"] = torch.zeros(1, dtype=torch.float32, device="cuda")
    with pytest.raises(TraceError, match="expects"):
        exe.run(bad)
    step.sync()
