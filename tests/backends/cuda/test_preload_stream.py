"""preload.stream_slots: a GEMV tile that polls streams the next tile's preloaded rows into the
preload slot its own rows are not in, slot B only where both tiles' work areas end below it;
every other preload goes to slot A when its host ends, as before. The tables carry the choice
in the host's n_pre flags, and AMK_PRE_CHUNK=0 (CudaOptions.pre_chunk) turns it off."""
from dataclasses import replace

import pytest

from amk.backends.cuda import CudaOptions, abi
from amk.backends.cuda.codegen import render_lowered
from amk.backends.cuda.lower import fold_program, lower_program
from amk.backends.cuda.preload import _gemv_top
from amk.backends.cuda.smem import PRE_B_OFF
from amk.models.presets import LLAMA_3_2_1B, QWEN3_0_6B, random_model


def _program(cfg):
    return random_model(replace(cfg, max_seq=1088, n_layers=2), device="meta").lower(backend="cuda").program


@pytest.fixture(scope="module", params=["1B", "Qwen3-0.6B"])
def program(request):
    return _program(LLAMA_3_2_1B if request.param == "1B" else QWEN3_0_6B)


def test_streamed_rows_never_land_where_a_task_is_working(program):
    folded = fold_program(program, 132, CudaOptions())
    streamed = 0
    for q in folded.queues:
        read = None                                   # the slot the previous task's rows are in
        for h, j in zip(q, q[1:]):
            host, n = folded.tasks[h], folded.tasks[j]
            if not n.preload:
                read = None
                continue
            if n.pre_streamed:
                streamed += 1
                assert _gemv_top(host) is not None    # only a GEMV tile streams while it polls
                assert n.pre_slot != read             # never into the slot its own rows are in
                if n.pre_slot == 1:                   # slot B: below both tiles' work areas
                    assert _gemv_top(host) <= PRE_B_OFF and _gemv_top(n) <= PRE_B_OFF
            else:
                assert n.pre_slot == 0                # issued when the host ends: slot A
            read = n.pre_slot
    # each layer's down tiles streamed by the gate/up tiles before them, and the next layer's
    # q/k/v tiles by the down tiles
    assert streamed > 132


def test_the_tables_carry_the_slots_and_the_switch_turns_them_off(program):
    on = lower_program(program, 132, CudaOptions())
    flags = on.tasks["n_pre"] & ~abi.PRE_COUNT_MASK
    assert (flags & abi.PRE_STREAM).any() and (flags & abi.PRE_SLOT_B).any()
    assert not (flags & ~(abi.PRE_STREAM | abi.PRE_SLOT_B)).any()
    # slot B only for streamed rows
    assert not ((flags & abi.PRE_SLOT_B).astype(bool) & ~(flags & abi.PRE_STREAM).astype(bool)).any()
    assert on.spec.stream and "#define AMK_PRE_STREAM 1" in render_lowered(on)
    off_opts = CudaOptions(pre_chunk=0)
    off = lower_program(program, 132, off_opts)
    assert not (off.tasks["n_pre"] & ~abi.PRE_COUNT_MASK).any() and not off.spec.stream
    assert "#define AMK_PRE_STREAM 0" in render_lowered(off, off_opts)
    # the same ranges either way: only where they land and when they are issued differ
    assert on.ranges == off.ranges
    assert ((on.tasks["n_pre"] & abi.PRE_COUNT_MASK) == off.tasks["n_pre"]).all()
