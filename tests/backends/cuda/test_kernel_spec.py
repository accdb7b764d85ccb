"""The kernel spec (what kernel.cu depends on), read off the folded program before packing,
agrees with the packed tables: every case of the switch is a variant the descriptors name, the
preloaded-rows path only where a descriptor reads preloaded rows, the program-wide flags as the
tables have them; and a descriptor with too many operands is refused before NVRTC."""
from dataclasses import replace

import numpy as np
import pytest

from amk.backends.cuda import CudaOptions, abi, kernel_spec as ks
from amk.backends.cuda.codegen import render_lowered, render_spec
from amk.backends.cuda.lower import fold_program, lower_program
from amk.errors import CompileError
from amk.models.model import Model
from amk.models.presets import PRESETS, TINY_LLAMA, random_params
from amk.program.ir import InstructionKind as K
from amk.testing import cuda_examples as examples


# the 1B's shape has preloaded rows; the examples a zeroed scratch; the tiny model neither
PROGRAMS = {"examples": None, "tiny bf16": (TINY_LLAMA, None, 1), "tiny int4": (TINY_LLAMA, "int4", 1),
            "tiny batch 4": (TINY_LLAMA, None, 4), "1B shape": (PRESETS["llama-3.2-1b"], None, 1)}


@pytest.fixture(scope="module", params=list(PROGRAMS))
def program(request):
    """Built when a test asks (not at collection: lowering a step imports the triton backend,
    which must see TRITON_INTERPRET first where the interpreter tests run)."""
    import amk
    if PROGRAMS[request.param] is None:
        return examples.combined_program(examples.cases())
    base, quant, batch = PROGRAMS[request.param]
    cfg = replace(base, n_layers=2)
    model = Model(cfg, random_params(cfg, device="meta"))
    if quant:
        model.quantize(quant)
    step = amk.jit(model.fn, backend="cuda", donate=("kv",))
    return step.lower(*model.example_args(batch)).program


def test_the_spec_agrees_with_the_packed_tables(program):
    opts = CudaOptions()
    low = lower_program(program, 132, opts)
    spec, t = low.spec, low.tasks
    used = sorted(set(int(v) for v in t["variant"]) - {-1})
    assert used == list(range(len(spec.variants)))            # every case named, none missing
    assert len(spec.encoded) == len(spec.variants)            # the same, PRE marks aside
    assert all(v in (e, e.with_(pre=True)) for v, e in zip(spec.variants, spec.encoded))
    pre_rows = t["ip"][:, abi.ip_index("GEMV", "PRE")] > 0
    for i, v in enumerate(spec.variants):
        if v.fn == "op_gemv_direct":
            assert bool(v.arg("pre")) == bool(pre_rows[t["variant"] == i].any()), v
    assert spec.pre == bool(t["n_pre"].any()) and spec.zero == bool(t["n_zero"].any())
    # an early phase only for a plain task: a FUSED task's steps never get one (lower._no_early)
    early = t["ip"][:, abi.ip_index("ATTN", "EARLY")] == 1
    attn = t["op"] == int(K.ATTENTION_TILE)
    steps = np.zeros(len(t), bool)
    for d in t[t["n_sub"] > 0]:
        steps[int(d["sub_begin"]):int(d["sub_begin"]) + int(d["n_sub"])] = True
    assert not (early & attn & steps).any()
    assert spec.early == bool((early & attn & ~steps).any())
    assert spec.too_many == () and (t["n_in"] + t["n_out"] <= abi.MAX_PTRS).all()
    assert ks.kernel_spec(fold_program(program, 132, opts)) == spec     # from the fold alone
    assert render_lowered(low, opts) == render_spec(spec, opts)


def test_nvrtc_can_start_before_the_tables_are_packed(monkeypatch):
    from amk.backends.cuda import lower
    program = examples.combined_program(examples.cases()[:4])
    events = []
    real_pack = lower.pack
    monkeypatch.setattr(lower, "pack", lambda *a: events.append("pack") or real_pack(*a))
    low = lower.lower_program(program, 132, CudaOptions(), on_spec=lambda s: events.append(s))
    assert events == [low.spec, "pack"]


def test_a_descriptor_with_too_many_operands_is_refused_before_nvrtc(monkeypatch):
    program = examples.combined_program(examples.cases()[:4])
    monkeypatch.setattr(ks, "MAX_PTRS", 2)
    spec = ks.kernel_spec(fold_program(program))
    assert spec.too_many
    with pytest.raises(CompileError, match=r"tasks \[.*\] have more than \d+ operands"):
        render_spec(spec)


@pytest.mark.parametrize("batch", [1, 4])
def test_a_decoders_split_kv_attention_reads_pos_and_issues_its_rows_during_the_poll(batch):
    """Its pos is a runtime input and NEW_KV gives it row pos, so its early phase runs
    (AMK_EARLY); a batch's tasks of one sequence each have one too."""
    import amk
    cfg = replace(PRESETS["llama-3.2-1b"], n_layers=1, max_seq=8192)
    model = Model(cfg, random_params(cfg, device="meta"))
    program = amk.jit(model.fn, backend="cuda", donate=("kv",)).lower(*model.example_args(batch)).program
    low = lower_program(program, 132, CudaOptions())
    t = low.tasks
    attn = t[t["op"] == int(K.ATTENTION_TILE)]
    assert len(attn) and (attn["ip"][:, abi.ip_index("ATTN", "EARLY")] == 1).all()
    assert low.spec.early and "#define AMK_EARLY 1" in render_lowered(low, CudaOptions())


def test_an_attention_step_of_a_fused_task_has_no_early_phase():
    """Qwen3-0.6B at batch 4: its attention tasks stay FUSED after the folds (the encoder gave
    the attention step an early phase, but the scheduler runs one only for a plain task), so
    those steps' EARLY is 0 (lower._no_early): the step stages its own K/V rows."""
    import amk
    cfg = replace(PRESETS["qwen3-0.6b"], n_layers=1, max_seq=8192)
    model = Model(cfg, random_params(cfg, device="meta"))
    program = amk.jit(model.fn, backend="cuda", donate=("kv",)).lower(*model.example_args(4)).program
    t = lower_program(program, 132, CudaOptions()).tasks
    steps = np.concatenate([np.arange(int(d["sub_begin"]), int(d["sub_begin"]) + int(d["n_sub"]))
                            for d in t[t["n_sub"] > 0]])
    attn = steps[t["op"][steps] == int(K.ATTENTION_TILE)]
    assert len(attn)
    assert (t["ip"][attn, abi.ip_index("ATTN", "EARLY")] == 0).all()
