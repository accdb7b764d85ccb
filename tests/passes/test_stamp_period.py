"""The periodic stamp (passes/stamp_period.py: plan_memory and allocate_counters on six or seven
blocks, the last one or two middle blocks copied) gives the plain pipeline's program, every
field, on decoders of several shapes, layer counts (even and odd), backends' options (periods 1
and 2), quantized weights and a batch; where it cannot copy, the compile stamps the local
passes only; a copy that got a fixed object wrong would not pass these tests."""
from dataclasses import replace

import pytest
import torch

from amk.passes import stamp_period
from amk.passes.pipeline import PERIODIC_UPTO, PIPELINE, STAMPED_UPTO, run_pipeline
from amk.passes.repeat import find_repeat, small_graph
from amk.passes.stamp import ABS
from amk.passes.stamp_period import periodic_parts, stamped_periodic
from amk.passes.sync import forget
from amk.program.ir import BufferKind
from amk.trace import trace
from tests.passes.test_stamp import OPTIONS, SHAPES, _mlp_stack, decoder_graph

NAMES = [n for n, _ in PIPELINE]
FNS = [fn for _, fn in PIPELINE]
LOCAL = FNS[:NAMES.index(STAMPED_UPTO) + 1]
PERIODIC = FNS[NAMES.index(STAMPED_UPTO) + 1:NAMES.index(PERIODIC_UPTO) + 1]


def _plain(graph, opts):
    forget()
    got = run_pipeline(graph, opts, stop_after=PERIODIC_UPTO)[PERIODIC_UPTO]
    forget()
    return got


def assert_periodic_equal(graph, opts, period=None):
    made = periodic_parts(graph, opts, LOCAL, PERIODIC)
    forget()
    assert made is not None, "expected the small program to repeat"
    stamp, program = made
    if period is not None:
        assert stamp.p == period
    plain = _plain(graph, opts)
    assert program == plain
    assert repr(program) == repr(plain)
    assert stamped_periodic(graph, opts, LOCAL, PERIODIC) == plain      # the check passes
    forget()
    # and the whole pipeline, as a compile runs it (place and the proof on the stamped program)
    whole = run_pipeline(graph, opts, stamp=True)
    assert set(whole) == {"place"}               # stamped through PERIODIC_UPTO
    forget()
    assert repr(whole["place"]) == repr(run_pipeline(graph, opts)["place"])
    forget()


@pytest.mark.parametrize("layers", [8, 9, 12])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_decoders_stamp_periodically_to_the_plain_program(shape, layers):
    assert_periodic_equal(decoder_graph(replace(SHAPES[shape], n_layers=layers)), OPTIONS["cuda"],
                          period=1)


@pytest.mark.parametrize("shape", ["1b", "qwen2_bias"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_a_period_of_two_blocks_stamps_to_the_plain_program(shape, backend):
    # these options share the activations between every other block (the 8B's cuda period)
    assert_periodic_equal(decoder_graph(replace(SHAPES[shape], n_layers=10)), OPTIONS[backend],
                          period=2)


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_a_quantized_decoder_stamps_periodically(quant):
    assert_periodic_equal(decoder_graph(replace(SHAPES["1b"], n_layers=9), quant=quant),
                          OPTIONS["cuda"])


def test_a_batch_stamps_periodically():
    assert_periodic_equal(decoder_graph(replace(SHAPES["qwen3"], n_layers=8), batch=4),
                          OPTIONS["cuda"])


def test_a_batch_split_over_k_stamps_periodically():
    """Down in K slices (tile.split_k): its partial buffers share storage across blocks too."""
    assert_periodic_equal(decoder_graph(replace(SHAPES["1b"], n_layers=8), batch=16),
                          OPTIONS["cuda"].with_(k_split=2))


def test_a_step_whose_storage_does_not_repeat_stamps_the_local_passes():
    # the MLP stack's activations (two classes, several a block) share storage with no period
    # of one or two blocks: the small program says so, and the compile is the plain one
    f = lambda *s: torch.empty(s, device="meta")   # noqa: E731
    blocks = [{"norm": f(32), "up": f(64, 32), "down": f(32, 64)} for _ in range(10)]
    args = [{"blocks": blocks, "scale": f(1, 64), "head": f(48, 32)}, f(1, 32)]
    g, _ = trace(_mlp_stack, args, ["params", "x"], [BufferKind.WEIGHT, BufferKind.IO_INPUT])
    for opts in OPTIONS.values():
        assert periodic_parts(g, opts, LOCAL, PERIODIC) is None
        forget()
        whole = run_pipeline(g, opts, stamp=True)
        assert "plan_memory" in whole and "fuse" not in whole
        forget()
        assert repr(whole["place"]) == repr(run_pipeline(g, opts)["place"])
        forget()


def test_the_small_graph_keeps_the_first_blocks_and_the_last():
    g = decoder_graph(replace(SHAPES["1b"], n_layers=9))
    rep = find_repeat(g)
    s, p = rep.start, rep.size
    small = small_graph(g, rep, 7)
    assert small.eqns[:s + 6 * p] == g.eqns[:s + 6 * p]              # blocks 0-5
    assert [e.outputs for e in small.eqns[s + 6 * p:s + 7 * p]] == \
        [e.outputs for e in g.eqns[s + 8 * p:s + 9 * p]]              # the last block
    assert small.eqns[s + 7 * p:] == g.eqns[s + 9 * p:]               # the epilogue


def test_too_few_blocks_stamp_the_local_passes_only():
    g = decoder_graph(SHAPES["1b"])              # 5 layers: fewer than six blocks and two more
    assert periodic_parts(g, OPTIONS["cuda"], LOCAL, PERIODIC) is None
    whole = run_pipeline(g, OPTIONS["cuda"], stamp=True)
    assert set(whole) == set(NAMES[NAMES.index(STAMPED_UPTO) + 1:])
    forget()


def test_no_period_found_stamps_the_local_passes_only(monkeypatch):
    g = decoder_graph(replace(SHAPES["1b"], n_layers=8))
    monkeypatch.setattr(stamp_period, "PERIODS", (3,))   # 6 blocks hold no two periods of 3
    assert periodic_parts(g, OPTIONS["cuda"], LOCAL, PERIODIC) is None
    whole = run_pipeline(g, OPTIONS["cuda"], stamp=True)
    assert "plan_memory" in whole and "fuse" not in whole
    forget()
    assert repr(whole["place"]) == repr(run_pipeline(g, OPTIONS["cuda"])["place"])
    forget()


@pytest.mark.parametrize("backend", ["cuda", "reference"])
def test_fixed_objects_taken_for_relative_ones_are_refused_or_caught(backend, monkeypatch):
    """The tests above would catch a copy that misreads a shared buffer as the block's own:
    with every fixed reference read as relative, the copy refuses or differs from the plain
    program."""
    g = decoder_graph(replace(SHAPES["1b"], n_layers=10))
    real = stamp_period._classify

    def relative(st):
        real(st)
        assert any(m is ABS for m in st.modes.values())      # the shared activations
        st.modes = {k: (k[1] - st.blk[k[0]][k[2]] if m is ABS else m) for k, m in st.modes.items()}
        st.fixed = (set(), set())
    monkeypatch.setattr(stamp_period, "_classify", relative)
    made = periodic_parts(g, OPTIONS[backend], LOCAL, PERIODIC)
    forget()
    assert made is None or made[1] != _plain(g, OPTIONS[backend])
