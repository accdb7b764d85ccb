"""The stamped pipeline (passes/stamp.py: the local passes on three blocks, the middle one copied)
gives the plain pipeline's program, every field, on decoders of several shapes and on a step
that is no decoder; where the blocks differ it finds no Repeat and the plain pipeline runs."""
from dataclasses import replace

import pytest
import torch

from amk import ops
from amk.models.llama import DecoderConfig
from amk.models.model import Model
from amk.models.presets import PRESETS, random_params
from amk.passes.options import PassOptions
from amk.passes.pipeline import PIPELINE, STAMPED_UPTO, run_pipeline
from amk.passes.repeat import find_repeat
from amk.passes.stamp import stamped
from amk.passes.sync import forget
from amk.program.ir import BufferKind
from amk.trace import trace

KINDS = [BufferKind.WEIGHT, BufferKind.IO_INPUT, BufferKind.IO_INPUT, BufferKind.KV_CACHE]
SMALL = dict(vocab=512, hidden=256, n_layers=5, n_heads=8, n_kv_heads=2, head_dim=32, ffn=512,
             max_seq=512)
SHAPES = {
    "1b": replace(PRESETS["llama-3.2-1b"], **SMALL),
    "qwen3": replace(PRESETS["qwen3-0.6b"], **{**SMALL, "n_heads": 4, "head_dim": 128}),
    "qwen2_bias": replace(PRESETS["llama-3.2-1b"], **SMALL, qkv_bias=True),
}
OPTIONS = {"cuda": PassOptions.for_backend("cuda"), "reference": PassOptions.for_backend("reference"),
           "triton": PassOptions.for_backend("triton")}
LOCAL = [fn for _, fn in PIPELINE[:[n for n, _ in PIPELINE].index(STAMPED_UPTO) + 1]]


def decoder_graph(cfg: DecoderConfig, batch: int = 1, quant: str | None = None):
    m = Model(cfg, random_params(cfg, device="meta"))
    if quant:
        m.quantize(quant)
    return trace(m.fn, m.example_args(batch), ["params", "token", "pos", "kv"], KINDS)[0]


def assert_stamped_equal(graph, opts):
    small = stamped(graph, opts, LOCAL)
    forget()
    assert small is not None, "expected the blocks to repeat"
    plain = run_pipeline(graph, opts, stop_after=STAMPED_UPTO)[STAMPED_UPTO]
    assert small == plain
    assert repr(small) == repr(plain)
    # and the whole pipeline, as a compile runs it (the later passes on the stamped program)
    whole = run_pipeline(graph, opts, stamp=True)
    assert "lower" not in whole                  # stamped: the local stages are not kept
    assert repr(whole["place"]) == repr(run_pipeline(graph, opts)["place"])


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("backend", sorted(OPTIONS))
def test_decoders_stamp_to_the_plain_program(shape, backend):
    assert_stamped_equal(decoder_graph(SHAPES[shape]), OPTIONS[backend])


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_a_quantized_decoder_stamps_to_the_plain_program(quant):
    assert_stamped_equal(decoder_graph(SHAPES["1b"], quant=quant), OPTIONS["cuda"])


def test_a_batch_stamps_to_the_plain_program():
    assert_stamped_equal(decoder_graph(SHAPES["qwen3"], batch=4), OPTIONS["cuda"])


def _mlp_stack(params, x):
    """No decoder: a residual stack of norm -> linear -> gelu -> linear blocks, one shared scale."""
    h = x
    for w in params["blocks"]:
        y = ops.linear(ops.rmsnorm(h, w["norm"]), w["up"])
        y = y if "plain" in w else ops.gelu(y)        # a block without the gelu differs
        h = ops.add(h, ops.linear(ops.mul(y, params["scale"]), w["down"]))
    return ops.argmax(ops.linear(h, params["head"]))


def _mlp_args(n: int, plain: int = -1):
    f = lambda *s: torch.empty(s, device="meta")   # noqa: E731
    blocks = [{"norm": f(32), "up": f(64, 32), "down": f(32, 64), **({"plain": f(1)} if i == plain else {})}
              for i in range(n)]
    return [{"blocks": blocks, "scale": f(1, 64), "head": f(48, 32)}, f(1, 32)]


def test_a_step_that_is_no_decoder_stamps_too():
    g, _ = trace(_mlp_stack, _mlp_args(6), ["params", "x"], [BufferKind.WEIGHT, BufferKind.IO_INPUT])
    rep = find_repeat(g)
    assert rep is not None and rep.count == 6
    for opts in OPTIONS.values():
        assert_stamped_equal(g, opts)


def test_blocks_that_differ_run_the_plain_pipeline():
    # block 3 has no gelu: no period of four blocks is left
    g, _ = trace(_mlp_stack, _mlp_args(6, plain=3), ["params", "x"],
                 [BufferKind.WEIGHT, BufferKind.IO_INPUT])
    assert find_repeat(g) is None
    assert stamped(g, OPTIONS["cuda"], LOCAL) is None
    whole = run_pipeline(g, OPTIONS["cuda"], stamp=True)
    assert "lower" in whole                      # the plain pipeline ran


def test_a_block_reading_two_blocks_back_is_no_repeat():
    def skip(params, x):
        prev = h = x
        for w in params["blocks"]:
            prev, h = h, ops.add(ops.linear(h, w["up"]), prev)
        return h
    f = lambda *s: torch.empty(s, device="meta")   # noqa: E731
    params = {"blocks": [{"up": f(32, 32)} for _ in range(6)]}
    g, _ = trace(skip, [params, f(1, 32)], ["params", "x"], [BufferKind.WEIGHT, BufferKind.IO_INPUT])
    assert find_repeat(g) is None


def test_a_step_split_over_k_stamps_to_the_plain_program():
    """Down at batch 16 in K slices (tile.split_k): the partial buffers and SUM tasks a layer
    stamp like any other."""
    assert_stamped_equal(decoder_graph(SHAPES["1b"], batch=16), OPTIONS["cuda"].with_(k_split=2))
