"""stamp_check: a stamped task touching another block's weights or cache (a structurally valid
program computing the wrong function, which `validate` would pass) is caught, and the plain
pipeline runs; every preset's stamped program passes."""
import warnings

import pytest

from amk.models.presets import PRESETS
from amk.passes import stamp as stamp_mod
from amk.passes.pipeline import run_pipeline
from amk.passes.stamp import stamp_parts, stamped
from amk.passes.stamp_check import stamp_mismatches
from amk.passes.sync import forget
from amk.program.ir import Buffer, new_task

from tests.passes.test_stamp import LOCAL, OPTIONS, SHAPES, decoder_graph


def _parts(graph, opts=OPTIONS["cuda"]):
    made = stamp_parts(graph, opts, LOCAL)
    forget()
    assert made is not None
    return made


def _swapped(program, layer: int, what: str):
    """program with the first task reading layer `layer`'s input `what` (a weight or a cache)
    reading layer+1's instead; (new program, that task's id)."""
    name = {b.name: b.id for b in program.buffers}
    theirs = f"params.layers.{layer}.{what}" if what != "kv" else None
    for t in program.tasks:
        for pos, b in enumerate(t.inputs):
            got = program.buffers[b].name
            if got == theirs or (theirs is None and got.startswith("kv.") and f".{layer}." in got):
                other = name[got.replace(f".{layer}.", f".{layer + 1}.")]
                ins = t.inputs[:pos] + (other,) + t.inputs[pos + 1:]
                tasks = list(program.tasks)
                tasks[t.id] = new_task(t.id, t.op, ins, t.outputs, t.params, t.waits,
                                       t.out_counter, t.name)
                return program.with_(tasks=tuple(tasks)), t.id
    raise AssertionError(f"no task reads layer {layer}'s {what}")


@pytest.mark.parametrize("preset", ["llama-3.2-1b", "qwen3-0.6b", "llama-3-8b"])
def test_every_presets_stamped_program_passes(preset):
    graph = decoder_graph(PRESETS[preset])
    stamp, program = _parts(graph)
    assert stamp_mismatches(program, stamp.full, stamp.origins, len(graph.inputs)) == []


@pytest.mark.parametrize("what", ["wq", "w_down", "attn_norm", "kv"])
def test_a_task_reading_the_next_layers_input_is_caught(what):
    graph = decoder_graph(SHAPES["qwen3"])
    stamp, program = _parts(graph)
    n = len(graph.inputs)
    assert stamp_mismatches(program, stamp.full, stamp.origins, n) == []
    for layer in (0, 2, 3):                     # the first block, stamped middle ones
        bad_program, tid = _swapped(program, layer, what)
        bad = stamp_mismatches(bad_program, stamp.full, stamp.origins, n)
        assert any(f"task {tid} " in line for line in bad), bad


def test_a_renamed_or_reshaped_graph_input_is_caught():
    graph = decoder_graph(SHAPES["1b"])
    stamp, program = _parts(graph)
    n = len(graph.inputs)
    b = program.buffers[3]
    for wrong in (Buffer(b.id, b.name + "x", b.kind, b.dtype, b.shape, b.source),
                  Buffer(b.id, b.name, b.kind, b.dtype, (1,) + tuple(b.shape), b.source)):
        buffers = program.buffers[:3] + (wrong,) + program.buffers[4:]
        bad = stamp_mismatches(program.with_(buffers=buffers), stamp.full, stamp.origins, n)
        assert len(bad) == 1 and bad[0].startswith("buffer 3 ") and b.name in bad[0], bad


def test_a_mismatch_runs_the_plain_pipeline(monkeypatch):
    graph = decoder_graph(SHAPES["1b"])
    right = stamp_mod.Stamp.program

    def wrong(self, *args):
        return _swapped(right(self, *args), 2, "wk")[0]
    monkeypatch.setattr(stamp_mod.Stamp, "program", wrong)
    with pytest.warns(RuntimeWarning, match="plain pipeline runs"):
        assert stamped(graph, OPTIONS["cuda"], LOCAL) is None
    forget()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        stages = run_pipeline(graph, OPTIONS["cuda"], stamp=True)
    assert "lower" in stages                     # the plain pipeline ran
