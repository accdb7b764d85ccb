"""CUDA backend on the CPU: render + NVRTC-compile to sm_90a (NVRTC needs no GPU)."""
import re
from dataclasses import replace

import pytest

pytest.importorskip("cuda.bindings")

from amk.errors import CompileError
from amk.program.ir import DType, InstructionKind
from amk.program.recipe import recipe_of
from amk.backends.cuda import CudaOptions, abi, codegen, compile_source, render, smem
from amk.testing import cuda_examples as examples
from amk.backends.cuda.lower import lower_program
from amk.models.presets import LLAMA_3_2_1B, random_model


@pytest.fixture
def cache(tmp_path):
    """Options with a fresh disk cache."""
    return CudaOptions(cache_dir=tmp_path)


def test_abi_header_is_generated_from_the_enums():
    h = abi.render_header()
    for k in InstructionKind:
        assert f"#define OP_{k.name} {int(k)}\n" in h
    for d in DType:
        assert f"#define DT_{d.name} {int(d)}\n" in h
    assert f"static_assert(sizeof(TaskDesc) == {abi.TASK_DTYPE.itemsize}" in h


def test_examples_cover_every_opcode():
    ops = {t.op for c in examples.cases() for t in c.program.tasks}
    assert ops == set(InstructionKind)


def test_waits_carry_the_per_step_stride():
    b = examples.Builder()
    x = b.buf("x", examples.BK.IO_INPUT, DType.F32, (4,))
    y = b.buf("y", examples.BK.IO_OUTPUT, DType.F32, (4,))
    c = b.counter()
    for i in range(4):       # 4 tiles share one counter; the consumer waits for the first 2
        b.task(InstructionKind.COPY, [x], [y], {"n_off": i, "N_tile": 1}, out_counter=c)
    b.task(InstructionKind.NOP, [], [], waits=[(c, 2)])
    low = lower_program(b.program(), n_ctas=2)
    assert low.waits["threshold"].tolist() == [2] and low.waits["stride"].tolist() == [4]
    assert low.queues == [[0, 2, 4], [1, 3]]


def test_a_descriptor_carries_its_first_waits_as_the_table_has_them():
    """The scheduler polls the first abi.INLINE_WAITS waits from the TaskDesc (no global load
    before the poll): they must equal the waits table's rows; later waits only in the table."""
    b = examples.Builder()
    x = b.buf("x", examples.BK.IO_INPUT, DType.F32, (4,))
    y = b.buf("y", examples.BK.IO_OUTPUT, DType.F32, (4,))
    n = abi.INLINE_WAITS + 2
    cs = [b.task(InstructionKind.COPY, [x], [y], {"n_off": 0, "N_tile": 1}) for _ in range(n)]
    b.task(InstructionKind.NOP, [], [], waits=[(c, 1) for c in cs])
    b.task(InstructionKind.NOP, [], [], waits=[(cs[2], 1)])
    low = lower_program(b.program(), n_ctas=2)
    for t in low.tasks:
        rows = low.waits[int(t["wait_begin"]):int(t["wait_begin"]) + int(t["n_waits"])]
        k = min(len(rows), abi.INLINE_WAITS)
        assert t["wait_c"][:k].tolist() == rows["counter"][:k].tolist()
        assert t["wait_t"][:k].tolist() == rows["threshold"][:k].tolist()
        assert t["wait_s"][:k].tolist() == rows["stride"][:k].tolist()
    assert [int(t["n_waits"]) for t in low.tasks][n:] == [n, 1]
    assert low.tasks[n]["wait_c"].tolist() == cs[:abi.INLINE_WAITS]


def test_all_cases_compile_for_sm90a_and_hit_the_cache(cache):
    src = render(examples.combined_program(), cache)
    first = compile_source(src, "sm_90a", cuda_options=cache)
    assert not first.cache_hit and first.cubin[:4] == b"\x7fELF"
    assert "amk_megakernel" in first.log
    second = compile_source(src, "sm_90a", cuda_options=cache)
    assert second.cache_hit and second.cubin == first.cubin and second.key == first.key
    assert len(list((cache.cache_dir / "cuda").glob("*.cubin"))) == 1
    assert not list((cache.cache_dir / "cuda").glob(".tmp-*"))


def test_dynamic_smem_starts_1024_byte_aligned_and_fits():
    """The dynamic shared memory follows the static variables: ptxas pads them to the extern
    array's alignment (1024), so bulk copies and staged rows start on whole lines whatever the
    static variables add up to (NOTES v13a: 16-byte alignment cost 2 us a layer)."""
    res = compile_source(render(examples.combined_program()), "sm_90a")
    static = max(int(m) for m in re.findall(r"(\d+) bytes smem", res.log))
    assert static % 1024 == 0 and static > 0
    assert smem.SMEM_BYTES + static <= 227 * 1024


def test_profile_builds_compile_for_sm90a():
    """The profile build (AMK_PROFILE=1; the marks it records are checked on a GPU:
    tests/gpu/test_cuda_program.py) renders and compiles."""
    prof = CudaOptions(profile=True)
    src = render(examples.combined_program(), prof)
    assert "#define AMK_PROFILE 1" in src and "#define AMK_PROFILE" not in render(examples.combined_program())
    assert compile_source(src, "sm_90a", cuda_options=prof).cubin[:4] == b"\x7fELF"


def test_code_for_unused_features_is_compiled_out():
    """The FUSED zero ranges' loop (AMK_ZERO) is compiled only for programs that use it: dead
    code in the hot functions cost the 1B step time on the H200 (bench/NOTES.md v16a)."""
    src = render(examples.combined_program())            # it zeroes a scratch range
    assert "#define AMK_ZERO 1" in src
    cfg = replace(LLAMA_3_2_1B, max_seq=64, n_layers=1)
    src = render(random_model(cfg, device="meta").lower(backend="cuda").program)
    assert "#define AMK_ZERO 0" in src


def test_the_1b_kernel_spills_in_no_function():
    """The whole 16-layer Llama-3.2-1B kernel, as bench/decode.py compiles it: no device function
    spills. Before its rare paths went (rope's separate sin and cos, its powf, the FUSED unstaged
    fallback, unrolled copy loops: bench/NOTES.md v17) the attention spilled 28 B and the
    scheduler 20 B; removing that code made the step 31 us faster on the H200."""
    cfg = replace(LLAMA_3_2_1B, max_seq=1088)
    res = compile_source(render(random_model(cfg, device="meta").lower(backend="cuda").program), "sm_90a")
    blocks = re.findall(r"Function properties for (\S+)\n(.*)\n", res.log)
    assert any(name == "amk_megakernel" for name, _ in blocks)
    assert len(blocks) > 8
    for name, line in blocks:
        assert "0 bytes spill stores" in line, (name, line)


@pytest.mark.parametrize("kv_heads,npc", [(4, 33), (2, 56)])
def test_a_combine_of_more_partials_than_it_keeps_in_registers_does_not_spill(kv_heads, npc):
    """Few kv heads at an 8K cache split each into 33-56 shards: combine_direct (comb_merge)
    loads their m again with their l past 16 partials, a group at a time in a loop. Keeping
    every m, unrolled, spilled combine_direct 20 / 24 B and the scheduler 32 / 88 B (v47)."""
    cfg = replace(LLAMA_3_2_1B, max_seq=8192, n_layers=2, n_kv_heads=kv_heads)
    src = render(random_model(cfg, device="meta").lower(backend="cuda").program)
    assert f"op_combine<float, bf16, 64, {npc}>" in src
    blocks = dict(re.findall(r"Function properties for (\S+)\n(.*)\n", compile_source(src, "sm_90a").log))
    for name, line in blocks.items():
        if "combine" in name or "run_variant" in name:
            assert "0 bytes spill stores, 0 bytes spill loads" in line, (name, line)
    # the scheduler: no more than the 4 B it keeps at these shapes since before v47
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", blocks["amk_megakernel"])
    assert int(spill.group(1)) <= 4 and int(spill.group(2)) <= 12, blocks["amk_megakernel"]


def test_lineinfo_is_a_separate_cubin_with_a_line_table(cache):
    src = render(examples.cases()[0].program)
    plain = compile_source(src, "sm_90a", cuda_options=cache)
    lined = compile_source(src, "sm_90a", cuda_options=replace(cache, lineinfo=True))
    assert lined.key != plain.key and not lined.cache_hit
    assert b".nv_debug_line_sass" in lined.cubin and b".nv_debug_line_sass" not in plain.cubin


def test_template_syntax_error_is_a_compile_error_with_numbered_source(monkeypatch):
    broken = dict(codegen._templates())
    broken["gemv.cuh"] = broken["gemv.cuh"].replace("d.ip[P_GEMV_N_OFF]", "d.ip[P_GEMV_N_OFF] oops")
    monkeypatch.setattr(codegen, "_templates", lambda: broken)
    prog = next(c for c in examples.cases() if c.name == "gemv_bf16_bias_tile").program
    assert prog.tasks[0].op == InstructionKind.GEMV_TILE
    with pytest.raises(CompileError) as ei:
        compile_source(render(prog), "sm_90a")
    msg = str(ei.value)
    assert "NVRTC log" in msg and "oops" in msg
    assert re.search(r">>\s+\d+ \| .*oops", msg)


def test_unsupported_shapes_are_clear_errors():
    # past smem.GEMV_X_MAX at batch 1 with f32 x, which the tensor-core GEMV does not take
    # (bf16 x and weights run: test_cuda_compile_models.py)
    b = examples.Builder()
    x = b.buf("x", examples.BK.IO_INPUT, DType.F32, (1, 30000))
    w = b.buf("w", examples.BK.WEIGHT, DType.BF16, (4, 30000))
    y = b.buf("y", examples.BK.IO_OUTPUT, DType.BF16, (1, 4))
    b.task(InstructionKind.GEMV_TILE, [x, w], [y], {"K": 30000})
    with pytest.raises(CompileError, match="K=30000 exceeds .* here x is F32"):
        render(b.program())


def test_malformed_recipe_is_refused():
    b = examples.Builder()
    x = b.buf("x", examples.BK.IO_INPUT, DType.F32, (4,))
    y = b.buf("y", examples.BK.IO_OUTPUT, DType.F32, (4,))
    b.task(InstructionKind.FUSED, [x], [y], {"recipe": {"steps": [
        {"op": int(InstructionKind.COPY), "args": [{"s": 3}], "out": "final"}]}})
    with pytest.raises(CompileError, match="scratch"):
        render(b.program())


def test_fused_llama_tasks_skip_needless_zeroing_keep_the_norm_in_smem_and_list_all_pointers(monkeypatch):
    """1B-shaped layer: column-tile scratch that is read only inside its tile is not zeroed,
    norm -> GEMV chains hand x over in shared memory, and each task's pointers (its own, then
    its steps') are one contiguous run of n_ptr_all entries (the scheduler copies them at once)."""
    from dataclasses import replace
    from amk.models.presets import LLAMA_3_2_1B, random_model
    from amk.program.ir import InstructionKind as K
    prog = random_model(replace(LLAMA_3_2_1B, max_seq=160, n_layers=1), device="meta") \
        .lower(backend="cuda").program
    low = lower_program(prog)
    gi = abi.ip_index("GEMV", "XS_READY")
    seen = set()
    for t in prog.tasks:
        d = low.tasks[t.id]
        if t.op != K.FUSED:
            assert d["n_ptr_all"] == d["n_in"] + d["n_out"]
            continue
        ops = tuple(s.op for s in recipe_of(t).steps)
        seen.add(ops)
        assert d["n_zero"] == 0, ops
        subs = low.tasks[d["sub_begin"]:d["sub_begin"] + d["n_sub"]]
        end = d["ptr_begin"] + d["n_in"] + d["n_out"]
        for s in subs:                                   # contiguous, in step order
            assert s["ptr_begin"] == end
            end += s["n_in"] + s["n_out"]
        assert d["n_ptr_all"] == end - d["ptr_begin"]
        steps = list(subs) if len(subs) else [d]         # folded into one instruction: d itself
        if ops[0] == K.RMSNORM and ops[1] == K.GEMV_TILE:
            # the norm runs inside the first GEMV (NORM); the GEMVs after it read its x in smem
            first = low.variants[int(steps[0]["variant"])]
            assert int(steps[0]["op"]) == K.GEMV_TILE and first.arg("norm")
            assert all(s["ip"][gi] == 1 for s in steps[1:] if int(s["op"]) == K.GEMV_TILE)
            if ops == (K.RMSNORM, K.GEMV_TILE, K.GEMV_TILE, K.SILU_MUL):   # gate/up: one pair
                assert len(steps) == 1 and (first.arg("nmat"), first.arg("epi")) == (2, 2)
    assert (K.GEMV_TILE, K.ADD) in seen and (K.ROPE, K.ROPE, K.ATTENTION_TILE) in seen
    assert (K.RMSNORM, K.GEMV_TILE, K.GEMV_TILE, K.SILU_MUL) in seen


def test_a_scratch_read_outside_its_tile_is_still_zeroed():
    """A GEMV tile whose scratch a later GEMV reads whole (as x) keeps its zeroing."""
    from amk.backends.cuda.fused import tile_reads_only
    from amk.backends.cuda.steps import REF_SCRATCH, Encoded, View
    s = View((1, 64), DType.F32, (REF_SCRATCH, 0))
    x = View((1, 64), DType.F32, (0, 1))
    tile = Encoded(int(InstructionKind.GEMV_TILE), None, ip=dict(N_OFF=0, N_TILE=16, M=1, K=64))
    whole = Encoded(int(InstructionKind.GEMV_TILE), None, ip=dict(N_OFF=0, N_TILE=64, M=1, K=64))
    add_in = Encoded(int(InstructionKind.ADD), None, ip=dict(C0=0, C1=16))
    add_out = Encoded(int(InstructionKind.ADD), None, ip=dict(C0=0, C1=32))
    assert tile_reads_only([(tile, [x], [s]), (add_in, [x, s], [x])], s.ref)
    assert not tile_reads_only([(tile, [x], [s]), (add_out, [x, s], [x])], s.ref)
    assert not tile_reads_only([(tile, [x], [s]), (whole, [s], [x])], s.ref)


def test_smem_staged_attention_is_the_default_and_compiles():
    src = render(examples.combined_program())
    assert "op_attention_smem<" in src
    res = compile_source(src, "sm_90a")
    assert res.cubin[:4] == b"\x7fELF"
    assert re.search(r"op_attention_smem.*\n.*0 bytes stack frame", res.log)


def test_staged_attention_takes_the_largest_head_pass_that_divides_a_kv_group():
    passes = {}
    for c in examples.cases():
        var = (lower_program(c.program).variants or [None])[0]
        if var is not None and var.fn == "op_attention_smem":
            passes[c.name] = var.arg("hg")
    # heads a kv group: 4 (Llama-style GQA), 1 (MHA), 3, 12 (two passes of 6)
    assert passes["attention_gqa_bf16"] == 4 and passes["attention_batched_long"] == 1
    assert passes["attention_rep3_f32"] == 3 and passes["attention_rep12_hd128"] == 6


def test_qwen3_q_k_norms_fold_into_the_attention_and_its_kernel_spills_nowhere():
    """Qwen3's per-head q/k RMSNorms (fuse rule RMSNORM -> ROPE) end inside the staged
    attention (folds.norm_into_attention: QKN, the weights as inputs before the inverse
    frequencies), not as steps of their own; the 2-layer kernel at an 8K cache (16 shards a kv
    head, their one combine folded into every o tile, which stages all 16 partials: split_kv's
    fold_fits) compiles for sm_90a without a spill."""
    from amk.backends.cuda.lower import fold_program
    from amk.models.presets import QWEN3_0_6B
    cfg = replace(QWEN3_0_6B, n_layers=2, vocab=4096, max_seq=8192)
    prog = random_model(cfg, device="meta").lower(backend="cuda").program
    attn = [ft for ft in fold_program(prog).tasks
            if any(e.is_fn("op_attention_smem") for e, _, _ in ft.steps)]
    assert len(attn) == 2 * 8 * 16                     # layers x kv heads x shards
    assert not any(t.op is InstructionKind.ATTENTION_COMBINE for t in prog.tasks)
    for ft in attn:
        (e, args, _), = ft.steps                        # the norms and ropes all folded
        assert e.variant.arg("qkn") is True and e.ip["Q_ROPE"] and e.ip["K_ROPE"]
        qn, kn = e.ip["QKN_ARGS"] & 255, e.ip["QKN_ARGS"] >> 8
        assert {qn, kn} == {6, 7} and len(args) == 9     # q..v_new, the weights, inverse freqs
        assert args[qn].numel == args[kn].numel == cfg.head_dim
    res = compile_source(render(prog), "sm_90a")
    for name, line in re.findall(r"Function properties for (\S+)\n(.*)\n", res.log):
        assert "0 bytes spill stores" in line, (name, line)
