"""place: every task on one per-SM queue, in program order within a queue, balanced by cost."""
from pass_helpers import SMALL, golden, run_passes

from small_programs import TWO_SMS, mlp_program

GOLDEN = """
tasks:
  t0 EMBED in=(b4,b0) out=(b5) waits=() -> c0 {} # embed(params.embed) @ small_programs.py:N
  t1 FUSED in=(b5,b1,b2,b3) out=(b6) waits=(c0>=1) -> c1 {"recipe": {"steps": [{"op": "RMSNORM", "args": [{"in": 0}, {"in": 1}], "out": 0, "params": {"eps": 1e-05}, "out_shape": [1, 8], "out_dtype": "f32"}, {"op": "GEMV_TILE", "args": [{"s": 0}, {"in": 2}], "out": 1, "params": {"n_off": 0, "N_tile": 8, "K": 8}, "out_shape": [1, 16], "out_dtype": "f32"}, {"op": "ADD", "args": [{"s": 1}, {"in": 3}], "out": "final", "params": {"n_off": 0, "N_tile": 8}}]}} # add(params.b) @ small_programs.py:N[tile 0/2] +rmsnorm+gemv_tile
  t2 FUSED in=(b5,b1,b2,b3) out=(b6) waits=(c0>=1) -> c1 {"recipe": {"steps": [{"op": "RMSNORM", "args": [{"in": 0}, {"in": 1}], "out": 0, "params": {"eps": 1e-05}, "out_shape": [1, 8], "out_dtype": "f32"}, {"op": "GEMV_TILE", "args": [{"s": 0}, {"in": 2}], "out": 1, "params": {"n_off": 8, "N_tile": 8, "K": 8}, "out_shape": [1, 16], "out_dtype": "f32"}, {"op": "ADD", "args": [{"s": 1}, {"in": 3}], "out": "final", "params": {"n_off": 8, "N_tile": 8}}]}} # add(params.b) @ small_programs.py:N[tile 1/2] +rmsnorm+gemv_tile
  t3 SAMPLE_ARGMAX in=(b6) out=(b7) waits=(c1>=2) -> c2 {} # argmax @ small_programs.py:N
queues:
  q0 (t0,t2)
  q1 (t1,t3)
"""


def test_place_golden_text():
    # the two fused tiles (the expensive tasks) run side by side on the two SMs
    golden(run_passes(mlp_program(), TWO_SMS)["place"], GOLDEN, start="tasks:")


def test_place_queues(stages):
    from amk.passes.place import placement_balance
    p = stages["place"]
    assert len(p.queues) == SMALL.num_sms
    flat = sorted(i for q in p.queues for i in q)
    assert flat == list(range(len(p.tasks)))
    assert all(list(q) == sorted(q) for q in p.queues)
    assert 1.0 <= placement_balance(p) < 1.5


def _place_by_lexsort(program, target):
    """The placement as it was computed before the per-run heap: every queue's key each task."""
    import numpy as np
    from amk.passes.cost import cost_ns
    from amk.passes.place import FINISH_TIE_NS
    nq = max(1, min(target.num_sms, len(program.tasks)))
    free, load = np.zeros(nq), np.zeros(nq)
    queues = [[] for _ in range(nq)]
    done, latest = {}, {}
    init = {c.id: c.init for c in program.counters}
    for t in program.tasks:
        ready = 0.0
        for w in t.waits:
            fins = done.get(w.counter, ())
            need = w.threshold - init.get(w.counter, 0)
            if need > 0 and fins:
                ready = max(ready, max(fins) if need >= len(fins) else sorted(fins)[need - 1])
        cost = cost_ns(t, program.buffers, target)
        finish = np.maximum(free, ready) + cost
        q = int(np.lexsort((load, np.floor(finish / FINISH_TIE_NS)))[0])
        free[q] = float(finish[q])
        load[q] += cost
        queues[q].append(t.id)
        done.setdefault(t.out_counter, []).append(float(finish[q]))
        latest[t.out_counter] = max(latest.get(t.out_counter, 0.0), float(finish[q]))
    return tuple(tuple(q) for q in queues)


def test_the_per_run_heap_places_as_every_key_each_task(stages):
    """place keeps a heap of the queues' keys while tasks share their readiness and cost (the
    tiles of one op): the queues equal those of ranking every queue for every task, on the
    tiny Llama over 1-132 SMs, and on Llama-3.2-1B-shaped layers (two of them) on an H100."""
    from dataclasses import replace
    from amk.models.presets import PRESETS
    from amk.passes.options import H100, PassOptions
    from amk.passes.place import place
    from pass_helpers import llama_program
    p = stages["allocate_counters"]
    for sms in (1, 2, 3, 4, 7, 132):
        target = replace(SMALL, num_sms=sms)
        assert place(p, PassOptions(target=target)).queues == _place_by_lexsort(p, target)
    cfg = replace(PRESETS["llama-3.2-1b"], n_layers=2)
    big = run_passes(llama_program(cfg), PassOptions(target=H100))["allocate_counters"]
    assert len(big.tasks) > 1000
    assert place(big, PassOptions(target=H100)).queues == _place_by_lexsort(big, H100)
