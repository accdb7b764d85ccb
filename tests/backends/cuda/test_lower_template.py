"""The CUDA lowering's per-kind template (lower._FusedMemo.folded: a FUSED task's encoded,
folded and preloaded steps renamed from its kind's first task) gives the tables that lowering
every task on its own path gives (lower_fused + folds, then preload), on decoders of several
shapes, quantized and batched; tasks the argmax fold patches keep their own path."""
from dataclasses import replace

import pytest

import amk
from amk.backends.cuda import lower
from amk.backends.cuda.argmax_fold import ArgmaxFolds
from amk.backends.cuda.folds import fold_steps
from amk.backends.cuda.fused import lower_fused
from amk.backends.cuda.options import CudaOptions
from amk.models.model import Model
from amk.models.presets import PRESETS, random_params
from amk.program.ir import InstructionKind as K

SMALL = dict(vocab=512, hidden=256, n_layers=5, n_heads=8, n_kv_heads=2, head_dim=32, ffn=512,
             max_seq=512)
CASES = {
    "1b": (replace(PRESETS["llama-3.2-1b"], **SMALL), 1, None),
    "qwen3": (replace(PRESETS["qwen3-0.6b"], **{**SMALL, "n_heads": 4, "head_dim": 128}), 1, None),
    "1b-int4": (replace(PRESETS["llama-3.2-1b"], **SMALL), 1, "int4"),
    "1b-fp8": (replace(PRESETS["llama-3.2-1b"], **SMALL), 1, "fp8"),
    "1b-batch4": (replace(PRESETS["llama-3.2-1b"], **SMALL), 4, None),
}


def _program(cfg, batch, quant):
    m = Model(cfg, random_params(cfg, device="meta"))
    if quant:
        m.quantize(quant)
    step = amk.jit(m.fn, backend="cuda", donate=("kv",))
    return step.lower(*m.example_args(batch)).program


def _fields(low):
    return (low.tasks.tobytes(), low.waits.tobytes(), low.ptr_refs.tobytes(), low.variants,
            low.n_program_tasks, low.ranges, low.scratch_bytes, low.queues)


def _afresh(monkeypatch):
    """Every task on its own path: no template, each FUSED task lowered and folded anew."""
    def lowered(self, t, ins, outs, scratch):
        fused, used = lower_fused(t, ins, outs, scratch)
        return fold_steps(fused), used

    monkeypatch.setattr(ArgmaxFolds, "touches", lambda self, t: True)
    monkeypatch.setattr(lower._FusedMemo, "lower", lowered)


@pytest.mark.parametrize("case", sorted(CASES))
def test_templated_lowering_gives_every_task_its_own_tables(case, monkeypatch):
    program = _program(*CASES[case])
    made = []
    instance = lower._Template.instance

    def counted(self, views, scratch):
        made.append(self)
        return instance(self, views, scratch)

    monkeypatch.setattr(lower._Template, "instance", counted)
    templated = lower.lower_program(program)
    n_fused = sum(t.op is K.FUSED for t in program.tasks)
    assert len(made) > n_fused / 2              # most FUSED tasks came from a template
    _afresh(monkeypatch)
    made.clear()
    assert _fields(lower.lower_program(program)) == _fields(templated)
    assert not made


def test_templated_preloads_match_on_every_task(monkeypatch):
    """The folded tasks themselves (steps, zeroed and preloaded ranges), not only the tables."""
    program = _program(*CASES["qwen3"])
    opts = CudaOptions()
    templated = lower.fold_program(program, 132, opts)
    assert any(ft.preload for ft in templated.tasks)
    _afresh(monkeypatch)
    plain = lower.fold_program(program, 132, opts)
    for a, b in zip(templated.tasks, plain.tasks):
        assert (a.steps, a.zero, a.preload, a.preload_step) == \
            (b.steps, b.zero, b.preload, b.preload_step), a.task.name
    assert templated.scratch_bytes == plain.scratch_bytes
