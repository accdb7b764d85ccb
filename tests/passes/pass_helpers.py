"""Shared by the pass tests: a tiny Llama decode program (traced and lowered), random bindings,
a reference-VM runner, and a FileCheck-style matcher over the program's text."""
from __future__ import annotations

import re
import textwrap

import torch

from amk.graph import Aval
from amk.models.llama import DecoderConfig, make_decode_step
from amk.passes.allocate_counters import allocate_counters
from amk.passes.defer_kv_append import defer_kv_append
from amk.passes.fuse import fuse
from amk.passes.lower import lower
from amk.passes.options import PassOptions, Target
from amk.passes.place import place
from amk.passes.plan_memory import plan_memory
from amk.passes.split_kv import split_kv
from amk.passes.tile import tile
from amk.program.ir import BufferKind, DType, Program
from amk.trace import trace

PASSES = [("tile", tile), ("defer_kv_append", defer_kv_append), ("split_kv", split_kv), ("fuse", fuse), ("plan_memory", plan_memory),
          ("allocate_counters", allocate_counters), ("place", place)]

TINY = DecoderConfig(vocab=96, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                     ffn=64, max_seq=16)
# 4 "SMs", tiles of 16 columns: every GEMV splits, q/k/v tiles are 2 heads wide.
SMALL = Target("small", num_sms=4, smem_bytes=1 << 16, max_tile_bytes=16 * 32 * 4)
OPTS = PassOptions(target=SMALL, attn_splits=3)


def llama_avals(cfg: DecoderConfig, batch: int = 1, dtype: DType = DType.F32):
    H, hd = cfg.hidden, cfg.head_dim
    A = lambda *s: Aval(tuple(s), dtype)  # noqa: E731
    layer = lambda: {"attn_norm": A(H), "wq": A(cfg.n_heads * hd, H),  # noqa: E731
                     "wk": A(cfg.n_kv_heads * hd, H), "wv": A(cfg.n_kv_heads * hd, H),
                     "wo": A(H, cfg.n_heads * hd), "mlp_norm": A(H), "w_gate": A(cfg.ffn, H),
                     "w_up": A(cfg.ffn, H), "w_down": A(H, cfg.ffn)}
    params = {"embed": A(cfg.vocab, H), "norm": A(H), "lm_head": A(cfg.vocab, H),
              "inv_freq": Aval((hd // 2,), DType.F32),
              "layers": [layer() for _ in range(cfg.n_layers)]}
    cache = (cfg.max_seq, cfg.n_kv_heads, hd) if batch == 1 else (batch, cfg.max_seq,
                                                                 cfg.n_kv_heads, hd)
    kv = [{"k": A(*cache), "v": A(*cache)} for _ in range(cfg.n_layers)]
    return [params, Aval((batch,), DType.I32), Aval((1,), DType.I32), kv]


def llama_program(cfg: DecoderConfig = TINY, batch: int = 1, dtype: DType = DType.F32) -> Program:
    g, _ = trace(make_decode_step(cfg), llama_avals(cfg, batch, dtype),
                 ["params", "token", "pos", "kv"],
                 [BufferKind.WEIGHT, BufferKind.IO_INPUT, BufferKind.IO_INPUT, BufferKind.KV_CACHE],
                 name="llama")
    return lower(g)


def run_passes(program: Program, opts: PassOptions = OPTS, upto: str = "place") -> dict:
    stages = {"lower": program}
    for name, fn in PASSES:
        program = fn(program, opts)
        stages[name] = program
        if name == upto:
            break
    return stages


def bindings(program: Program, pos: int = 5, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for b in program.buffers:
        if b.kind not in (BufferKind.IO_INPUT, BufferKind.WEIGHT, BufferKind.CONST,
                          BufferKind.KV_CACHE):
            continue
        if b.source == "pos":
            t = torch.tensor([pos], dtype=torch.int32)
        elif b.source.startswith("token"):
            t = torch.randint(0, 96, b.shape, generator=g, dtype=torch.int32)
        elif b.source.endswith("inv_freq"):
            t = 1.0 / (10000 ** (torch.arange(b.shape[0], dtype=torch.float32) / b.shape[0]))
        elif b.source.endswith("norm"):
            t = 1 + 0.2 * torch.randn(b.shape, generator=g)
        else:
            t = 0.3 * torch.randn(b.shape, generator=g)
        out[b.source] = t.to(b.dtype.torch)
    return out


def run(program: Program, binds, order: str = "program", seed: int = 0) -> list[torch.Tensor]:
    from amk.backends.reference.vm import ReferenceVM
    fresh = {k: v.clone() for k, v in binds.items()}   # KV caches are updated in place
    return [t.clone() for t in ReferenceVM(program, order=order, seed=seed).run(fresh)]


def same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y), (x - y).abs().max() if x.is_floating_point() else (x, y)


def close(a, b):
    for x, y in zip(a, b):
        if x.is_floating_point():
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(x, y)


def text(program: Program) -> str:
    from amk.program.text import program_to_text
    return program_to_text(program)


def check_lines(haystack: str, patterns: list[str]) -> None:
    """FileCheck-style: each regex matches a line, in order (later lines after earlier ones)."""
    lines = haystack.splitlines()
    i = 0
    for p in patterns:
        rx = re.compile(p)
        while i < len(lines) and not rx.search(lines[i]):
            i += 1
        assert i < len(lines), f"no line matching {p!r} (in order) in:\n{haystack[:4000]}"
        i += 1


def golden(program: Program, expected: str, start: str = "program ") -> None:
    """The program's text from its first line starting with `start` ("counters:", "tasks:"
    when the pass leaves what comes before alone) equals `expected` line by line (the first
    differing line is named). Source lines in task names read `small_programs.py:N`."""
    got = [re.sub(r"small_programs\.py:\d+", "small_programs.py:N", line)
           for line in text(program).splitlines()]
    got = got[next(i for i, line in enumerate(got) if line.startswith(start)):]
    want = textwrap.dedent(expected).strip("\n").splitlines()
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"line {i + 1}:\n  got:  {g}\n  want: {w}\nwhole text:\n" + "\n".join(got)
    assert len(got) == len(want), "\n".join(got)
