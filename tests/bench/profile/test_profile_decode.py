"""bench/profile/profile_decode.py's summary of a profiled step, on the CPU: the tiny Llama's
program as the cuda options schedule it, with made-up profile rows (task, queue, wait start,
wait end, end in ns, SM, ready), FUSED step starts and marks, so every figure it prints is known."""
import importlib.util
from pathlib import Path

import pytest

import amk
from amk.models.model import Model
from amk.models.presets import TINY_LLAMA, random_params
from amk.passes.options import PassOptions
from amk.program.recipe import recipe_of

TOOL = Path(__file__).resolve().parents[3] / "bench" / "profile" / "profile_decode.py"


@pytest.fixture(scope="module")
def pd():
    spec = importlib.util.spec_from_file_location("profile_decode", TOOL)
    mod = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as mp:        # it sets AMK_PROFILE=1 for its own run:
        mp.setenv("AMK_PROFILE", "1")               # undone for the tests after this one
        spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def prog():
    m = Model(TINY_LLAMA, random_params(TINY_LLAMA))
    step = amk.jit(m.fn, backend="reference", donate=("kv",), options=PassOptions.for_backend("cuda"))
    return step.lower(*m.example_args()).program


def _rows(prog, queues=3):
    """Task t on queue t % queues, one after another: 0.1 us of wait, ready 0.05 us later, then
    1 us of run in all."""
    rows, clock = [], [0] * queues
    for t in prog.tasks:
        q = t.id % queues
        w0 = clock[q]
        rows.append((t.id, q, w0, w0 + 100, w0 + 1100, q, w0 + 150))
        clock[q] = w0 + 1100
    return rows


def test_every_task_is_counted_once_under_its_kind(pd, prog):
    s = pd.summarise(prog, _rows(prog))
    kinds = s["kinds"]
    assert sum(d["n"] for d in kinds.values()) == len(prog.tasks)
    assert kinds["attention"]["n"] == TINY_LLAMA.n_layers * 2          # 2 a layer
    assert kinds["wq+RMSNORM"]["run_us"] == pytest.approx(kinds["wq+RMSNORM"]["n"] * 1.0)
    assert kinds["wq+RMSNORM"]["wait_us"] == pytest.approx(kinds["wq+RMSNORM"]["n"] * 0.1)
    assert {"embed", "sample_argmax", "lm_head+RMSNORM"} <= set(kinds)
    per_q = [len([t for t in prog.tasks if t.id % 3 == q]) for q in range(3)]
    assert s["span_us"] == pytest.approx(max(per_q) * 1.1)
    assert [s["per_cta"][q]["run"] for q in range(3)] == pytest.approx(per_q)


def test_stages_are_per_layer_and_fused_steps_per_op(pd, prog):
    wq = [t for t in prog.tasks if pd.task_kind(t, prog.buffers) == "wq+RMSNORM"]
    rows = _rows(prog)
    wait_end = {r[0]: r[3] for r in rows}
    steps = {}
    for t in wq:                                         # norm 0.4 us, then the GEMV 0.6 us
        ops = [st.op for st in recipe_of(t).steps]
        steps[t.id] = [(ops[0], wait_end[t.id]), (ops[1], wait_end[t.id] + 400)]
    s = pd.summarise(prog, rows, steps)
    d = s["kinds"]["wq+RMSNORM"]
    assert d["steps"] == pytest.approx({"0:RMSNORM": 0.4 * len(wq), "1:GEMV_TILE": 0.6 * len(wq)})
    assert pd.steps_line(d) == "steps us/task: 0:RMSNORM 0.40, 1:GEMV_TILE 0.60"
    layers = {k.split(":")[0] for k in s["stages"]}
    assert layers == {"-1"} | {str(i) for i in range(TINY_LLAMA.n_layers)}
    first, last, n = s["stages"]["0:attention"]
    assert n == 2 and last - first >= 1.0


def test_marks_are_averaged_over_the_tasks_that_passed_them(pd, prog):
    """A dead split-KV shard returns after its first AMK_MARK: each interval's mean is over the
    tasks that had it, with their count where it is not every marked task's."""
    attn = [t for t in prog.tasks if pd.task_kind(t, prog.buffers) == "attention"]
    rows = _rows(prog)
    wait_end = {r[0]: r[3] for r in rows}
    live = attn[::2]                                     # every other one: mark 1 at 0.5 us
    marks = {t.id: [(0, 0, wait_end[t.id] + 300)] + ([(0, 1, wait_end[t.id] + 500)] if t in live else [])
             for t in attn}
    d = pd.summarise(prog, rows, marks=marks)["kinds"]["attention"]
    assert d["n"] == d["n_marked"] == len(attn) and len(live) < len(attn)
    dead = len(attn) - len(live)
    assert pd.marks_line(d) == (f"marks us/task ({len(attn)} of {len(attn)} tasks): "
                                f"w>r 0.05, r>0 0.25, 0>1 0.20 [{len(live)}], 1>e 0.50 [{len(live)}], "
                                f"0>e 0.70 [{dead}]")


def test_a_fused_tasks_marks_follow_its_step_starts(pd, prog):
    """A FUSED task's marks are each step's own (step, k): the timeline puts every step's start
    before that step's marks, in the order they were passed (not their numbers'), so the
    intervals name the step they fall in."""
    wq = [t for t in prog.tasks if pd.task_kind(t, prog.buffers) == "wq+RMSNORM"]
    rows = _rows(prog)
    w1 = {r[0]: r[3] for r in rows}
    steps, marks = {}, {}
    for t in wq:          # norm from 0.1 us (mark 0 at 0.2), the GEMV from 0.5 (mark 0 0.6, 1 0.9)
        ops = [st.op for st in recipe_of(t).steps]
        steps[t.id] = [(ops[0], w1[t.id] + 100), (ops[1], w1[t.id] + 500)]
        marks[t.id] = [(0, 0, w1[t.id] + 200), (1, 1, w1[t.id] + 900), (1, 0, w1[t.id] + 600)]
    d = pd.summarise(prog, rows, steps, marks)["kinds"]["wq+RMSNORM"]
    assert pd.marks_line(d) == (f"marks us/task ({len(wq)} of {len(wq)} tasks): w>r 0.05, r>s0 0.05, "
                                "s0>0.0 0.10, 0.0>s1 0.30, s1>1.0 0.10, 1.0>1.1 0.30, 1.1>e 0.10")
