"""A model's decode step through the whole pipeline on the reference VM: equal to direct graph
interpretation, independent of the interleaving, mutations refused, text round-trips."""
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import amk
from amk.backends.reference.interp import interpret
from amk.backends.reference.vm import ReferenceVM
from amk.errors import ValidationError
from amk.models.presets import TINY_LLAMA, random_model
from amk.program.ir import BufferKind, InstructionKind as K, Wait
from amk.program.recipe import recipe_of
from amk.program.text import parse_program, program_to_text
from stage_check import args_with_history, assert_every_stage_matches_graph, clone_args, model_bindings

I32 = torch.int32


@pytest.fixture(scope="module")
def tiny():
    m = random_model(TINY_LLAMA, seed=1)
    return m, m.lower(backend="reference")


def test_every_stage_equals_direct_graph_interpretation(tiny):
    m, low = tiny
    assert_every_stage_matches_graph(m, low)


def test_every_stage_of_the_cuda_schedule_equals_direct_graph_interpretation():
    """The cuda backend's pass options (H200 target, one combine folded into every o tile),
    run on the reference VM."""
    m = random_model(replace(TINY_LLAMA, max_seq=300), seed=2)     # 2 KV shards of 150
    low = m.lower(backend="cuda")
    ops = [s.op for t in low.program.tasks if t.op is K.FUSED for s in recipe_of(t).steps]
    assert K.ATTENTION_COMBINE in ops              # folded into the o tiles, never a task
    assert not any(t.op is K.ATTENTION_COMBINE for t in low.program.tasks)
    base = args_with_history(m, pos=200)
    want = interpret(low.graph, model_bindings(clone_args(base)))
    split = None               # flash decoding rounds differently from one softmax: from the
    for name, prog in low.programs.items():        # split on, every stage equals the split one
        assert amk.validate(prog).ok, name
        got = ReferenceVM(prog).run(model_bindings(clone_args(base)))
        if name == "split_kv":
            split = got
        for g, w, s in zip(got, want, split or want):
            if split is None:
                assert torch.equal(g.view(w.shape), w), name
            else:
                assert torch.allclose(g.view(w.shape).float(), w.float(), atol=1e-5), name
                assert torch.equal(g, s), f"stage {name} differs from split_kv"
    assert split is not None


def test_every_stage_of_tiny_qwen3_equals_direct_graph_interpretation():
    transformers = pytest.importorskip("transformers")
    from amk.models import from_hf
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=32, max_position_embeddings=64)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    assert_every_stage_matches_graph(from_hf(hf, max_seq=32))


def test_fifty_random_interleavings_are_bit_identical(tiny):
    m, low = tiny
    base = args_with_history(m)
    ref = ReferenceVM(low.program).run(model_bindings(clone_args(base)))
    orders = set()
    for seed in range(50):
        vm = ReferenceVM(low.program, order="random", seed=seed)
        got = vm.run(model_bindings(clone_args(base)))
        orders.add(tuple(vm.last_stats.exec_order))
        for g, r in zip(got, ref):
            assert torch.equal(g, r), f"seed {seed}"
    assert len(orders) > 10            # the interleavings really differ


def test_steps_reuse_one_program_and_update_the_cache_in_place(tiny):
    m, low = tiny
    step = m.jit("reference")
    params, token, pos, kv = m.example_args()
    k0 = kv[0]["k"]
    for p in range(4):
        pos.fill_(p)
        token, logits, kv = step(params, token, pos, kv)
    assert kv[0]["k"] is k0 and k0[:4].abs().sum() > 0 and k0[4:].abs().sum() == 0
    assert step.trace_count == 1


def _reader_of_activation(prog):
    """A task that waits on a task whose output it reads."""
    for t in prog.tasks:
        for w in t.waits:
            prod = [p for p in prog.tasks if p.out_counter == w.counter]
            if any(set(p.outputs) & set(t.inputs) for p in prod) and all(
                    prog.buffers[b].kind == BufferKind.ACTIVATION for p in prod for b in p.outputs):
                return t
    raise AssertionError("no reader found")


def _refuse(prog, must_name: str):
    res = amk.validate(prog)
    assert not res.ok
    assert must_name in res.report(), res.report()
    with pytest.raises(ValidationError):
        ReferenceVM(prog)


def _replace_task(prog, t):
    tasks = list(prog.tasks)
    tasks[t.id] = t
    return prog.with_(tasks=tuple(tasks))


def test_mutations_are_rejected_naming_the_task(tiny):
    _, low = tiny
    prog = low.program
    t = _reader_of_activation(prog)
    _refuse(_replace_task(prog, t.with_(waits=())), f"t{t.id}")

    # a threshold below the number of incrementers guarantees nothing
    shared = {}
    for x in prog.tasks:
        shared.setdefault(x.out_counter, []).append(x)
    multi = [c for c, xs in shared.items() if len(xs) > 1]
    if multi:
        c = multi[0]
        reader = next(x for x in prog.tasks if any(w.counter == c for w in x.waits))
        waits = tuple(Wait(w.counter, w.threshold - 1) if w.counter == c else w for w in reader.waits)
        _refuse(_replace_task(prog, reader.with_(waits=waits)), f"t{reader.id}")

    # two concurrent writers of one region: a second task writes the first's output, no waits
    first = prog.tasks[0]
    last = prog.tasks[-1]
    _refuse(_replace_task(prog, last.with_(outputs=first.outputs, waits=())), f"t{last.id}")

    # a wait cycle: the first task waits on the last
    _refuse(_replace_task(prog, first.with_(waits=(Wait(last.out_counter, 1),))), "cycle")


def test_text_form_round_trips_for_every_stage(tiny):
    _, low = tiny
    for name, prog in low.programs.items():
        assert parse_program(program_to_text(prog)) == prog, name
        assert low.stages[name] == program_to_text(prog)


def test_dump_ir_writes_every_stage_and_a_repro(tmp_path, monkeypatch):
    monkeypatch.setenv("AMK_DUMP_IR", str(tmp_path))
    m = random_model(replace(TINY_LLAMA, n_layers=1), seed=2)
    low = m.lower(backend="reference")
    (d,) = tmp_path.iterdir()
    names = sorted(p.name for p in d.iterdir())
    assert names[0] == "00_graph.txt" and "repro.py" in names
    assert [n[3:-4] for n in names if n[:2].isdigit()] == ["graph", *low.programs]
    assert (d / "00_graph.txt").read_text().strip() == str(low.graph)
    run = subprocess.run([sys.executable, str(d / "repro.py")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "valid" in run.stdout


def test_debug_levels_print_pass_timings_then_the_schedule(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("AMK_CACHE_DIR", str(tmp_path))          # no cache hit: the passes run
    m = random_model(replace(TINY_LLAMA, n_layers=1), seed=3)
    monkeypatch.setenv("AMK_DEBUG", "1")
    low = m.lower(backend="reference")
    err = capfd.readouterr().err
    for name in low.programs:
        assert f": {name} " in err, name
    assert "schedule:" not in err
    monkeypatch.setenv("AMK_DEBUG", "2")
    monkeypatch.setenv("AMK_CACHE_DIR", str(tmp_path / "2"))
    random_model(replace(TINY_LLAMA, n_layers=1), seed=3).lower(backend="reference")
    assert "[amk] schedule: " in capfd.readouterr().err
