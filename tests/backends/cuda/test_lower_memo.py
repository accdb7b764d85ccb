"""The per-kind memos of a compile give what computing every task afresh gives, on a 4-layer
model whose layers repeat: the CUDA lowering's (lower._FusedMemo), the FUSED regions
(regions._fused_regions), place's costs and the last scan (deps.scan_all)."""
from dataclasses import replace

import pytest

import amk
from amk.backends.cuda import lower
from amk.backends.cuda.folds import fold_steps
from amk.backends.cuda.fused import lower_fused
from amk.models.model import Model
from amk.models.presets import TINY_LLAMA, random_params
from amk.passes import cost, place as place_pass
from amk.program import deps, regions
from amk.program.ir import InstructionKind as K
from amk.program.regions import Region, task_regions


@pytest.fixture(scope="module")
def program():
    cfg = replace(TINY_LLAMA, n_layers=4)
    model = Model(cfg, random_params(cfg, device="meta"))
    step = amk.jit(model.fn, backend="cuda", donate=("kv",))
    return step.lower(*model.example_args(1)).program


def _fields(low):
    return (low.tasks.tobytes(), low.waits.tobytes(), low.ptr_refs.tobytes(), low.variants,
            low.n_program_tasks, low.ranges, low.scratch_bytes, low.queues)


def test_fused_memo_lowers_every_task_as_lowering_it_afresh(program, monkeypatch):
    calls = []

    def counted(t, *a):
        calls.append(t.id)
        return lower_fused(t, *a)

    monkeypatch.setattr(lower, "lower_fused", counted)
    memoised = lower.lower_program(program)
    n_fused = sum(t.op is K.FUSED for t in program.tasks)
    assert 0 < len(calls) < n_fused / 2          # the layers' tasks came from the memo

    def afresh(self, t, ins, outs, scratch):
        fused, used = lower_fused(t, ins, outs, scratch)
        return fold_steps(fused), used

    monkeypatch.setattr(lower._FusedMemo, "lower", afresh)
    monkeypatch.setattr(lower.ArgmaxFolds, "touches", lambda self, t: True)   # no template
    assert _fields(lower.lower_program(program)) == _fields(memoised)


def test_fused_regions_memo_gives_every_task_its_own_regions(program):
    regions.forget_fused_regions()
    memoised = [task_regions(t, program.buffers) for t in program.tasks]
    n_fused = sum(t.op is K.FUSED for t in program.tasks)
    assert 0 < len(regions._FUSED) < n_fused / 2
    for t, got in zip(program.tasks, memoised):
        regions.forget_fused_regions()
        assert got == task_regions(t, program.buffers), t


def test_place_with_the_cost_memo_places_as_without(program, monkeypatch):
    unplaced = program.with_(queues=())
    placed = place_pass.place(unplaced)
    monkeypatch.setattr(place_pass, "cost_ns",
                        lambda t, bufs, target, memo=None: cost.cost_ns(t, bufs, target))
    assert place_pass.place(unplaced).queues == placed.queues


def test_scan_all_reuses_only_a_scan_of_equal_inputs(program):
    bufs, tasks = program.buffers, program.tasks
    regs = [task_regions(t, bufs) for t in tasks]
    first = deps.scan_all(bufs, tasks, regs)
    assert deps.scan_all(bufs, tasks, [task_regions(t, bufs) for t in tasks]) is first
    # one task reads one column less: a new scan, the one scan() gives
    t = next(i for i, (r, _) in enumerate(regs) if r and r[0].hi - r[0].lo > 1)
    r0 = regs[t][0][0]
    changed = list(regs)
    changed[t] = ([Region(r0.buffer, r0.lo, r0.hi - 1)] + regs[t][0][1:], regs[t][1])
    unwritten = []
    again = deps.scan_all(bufs, tasks, changed)
    assert again is not first
    assert again == (deps.scan(bufs, tasks, changed, unwritten, masks=True), unwritten)
    deps.forget_last_scan()
