"""CUDA backend on the CPU: render + NVRTC-compile to sm_90a (NVRTC needs no GPU)."""
import re
from dataclasses import replace

import pytest

pytest.importorskip("cuda.bindings")

from amk.errors import CompileError
from amk.program.ir import DType, InstructionKind
from amk.program.recipe import recipe_of
from amk.backends.cuda import abi, codegen, compile_source, examples, render, smem
from amk.backends.cuda.lower import lower_program
from amk.models.presets import LLAMA_3_2_1B, random_model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AMK_CACHE_DIR", str(tmp_path))
    return tmp_path


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
    src = render(examples.combined_program())
    first = compile_source(src, "sm_90a")
    assert not first.cache_hit and first.cubin[:4] == b"\x7fELF"
    assert "amk_megakernel" in first.log
    second = compile_source(src, "sm_90a")
    assert second.cache_hit and second.cubin == first.cubin and second.key == first.key
    assert len(list((cache / "cuda").glob("*.cubin"))) == 1
    assert not list((cache / "cuda").glob(".tmp-*"))


def test_dynamic_smem_starts_1024_byte_aligned_and_fits(cache, monkeypatch):
    """The dynamic shared memory follows the static variables: ptxas pads them to the extern
    array's alignment (1024), so bulk copies and staged rows start on whole lines whatever the
    static variables add up to (NOTES v13a: 16-byte alignment cost 2 us a layer)."""
    monkeypatch.delenv("AMK_CTAS_PER_SM", raising=False)
    res = compile_source(render(examples.combined_program()), "sm_90a")
    static = max(int(m) for m in re.findall(r"(\d+) bytes smem", res.log))
    assert static % 1024 == 0 and static > 0
    assert smem.SMEM_BYTES + static <= 227 * 1024


def test_profile_builds_compile_for_sm90a(cache, monkeypatch):
    """AMK_PROFILE=1 renders the profile build (the marks it records are checked on a GPU:
    tests/gpu/test_cuda_program.py) and it compiles."""
    monkeypatch.setenv("AMK_PROFILE", "1")
    src = render(examples.combined_program())
    assert "#define AMK_PROFILE 1" in src
    assert compile_source(src, "sm_90a").cubin[:4] == b"\x7fELF"


def test_l2_prefetch_is_compiled_out_unless_asked_for(monkeypatch):
    monkeypatch.delenv("AMK_L2_PREFETCH", raising=False)
    assert not lower_program(examples.combined_program()).tasks["n_pf"].any()
    assert "#define AMK_PF 0" in render(examples.combined_program())
    monkeypatch.setenv("AMK_L2_PREFETCH", "3")              # v9's first-round prefetch, opt-in
    assert lower_program(examples.combined_program()).tasks["n_pf"].any()
    assert "#define AMK_PF 1" in render(examples.combined_program())


def test_code_for_unused_features_is_compiled_out(monkeypatch):
    """The weight stream's scheduler code (AMK_STREAM) and the FUSED zero ranges' loop
    (AMK_ZERO) are compiled only for programs that use them: dead code in the hot functions
    cost the 1B step time on the H200 (bench/NOTES.md v16a)."""
    monkeypatch.setenv("AMK_CTAS_PER_SM", "1")
    monkeypatch.setenv("AMK_GEMV_RING", "0")
    src = render(examples.combined_program())            # it zeroes a scratch range
    assert "#define AMK_STREAM 0" in src and "#define AMK_ZERO 1" in src
    cfg = replace(LLAMA_3_2_1B, max_seq=64, n_layers=1)
    src = render(random_model(cfg, device="meta").lower(backend="cuda").program)
    assert "#define AMK_STREAM 0" in src and "#define AMK_ZERO 0" in src
    monkeypatch.setenv("AMK_GEMV_RING", "1")
    assert "#define AMK_STREAM 1" in render(examples.combined_program())


def test_the_1b_kernel_spills_in_no_function(cache, monkeypatch):
    """The whole 16-layer Llama-3.2-1B kernel, as bench/decode.py compiles it: no device function
    spills. Before its rare paths went (rope's separate sin and cos, its powf, the FUSED unstaged
    fallback, unrolled copy loops: bench/NOTES.md v17) the attention spilled 28 B and the
    scheduler 20 B; removing that code made the step 31 us faster on the H200."""
    for knob in ("AMK_CTAS_PER_SM", "AMK_GEMV_RING", "AMK_GEMV_PIPE", "AMK_PRELOAD"):
        monkeypatch.delenv(knob, raising=False)
    cfg = replace(LLAMA_3_2_1B, max_seq=1088)
    res = compile_source(render(random_model(cfg, device="meta").lower(backend="cuda").program), "sm_90a")
    blocks = re.findall(r"Function properties for (\S+)\n(.*)\n", res.log)
    assert any(name == "amk_megakernel" for name, _ in blocks)
    assert len(blocks) > 8
    for name, line in blocks:
        assert "0 bytes spill stores" in line, (name, line)


def test_lineinfo_is_a_separate_cubin_with_a_line_table(cache, monkeypatch):
    src = render(examples.cases()[0].program)
    plain = compile_source(src, "sm_90a")
    monkeypatch.setenv("AMK_LINEINFO", "1")
    lined = compile_source(src, "sm_90a")
    assert lined.key != plain.key and not lined.cache_hit
    assert b".nv_debug_line_sass" in lined.cubin and b".nv_debug_line_sass" not in plain.cubin


def test_template_syntax_error_is_a_compile_error_with_numbered_source(cache, monkeypatch):
    broken = dict(codegen._templates())
    for f in ("gemv.cuh", "gemv_pipe.cuh"):            # every GEMV template (plain, ring, pipe)
        broken[f] = broken[f].replace("d.ip[P_GEMV_N_OFF]", "d.ip[P_GEMV_N_OFF] oops")
    monkeypatch.setattr(codegen, "_templates", lambda: broken)
    prog = examples.cases()[10].program        # a GEMV case
    assert prog.tasks[0].op == InstructionKind.GEMV_TILE
    with pytest.raises(CompileError) as ei:
        compile_source(render(prog), "sm_90a")
    msg = str(ei.value)
    assert "NVRTC log" in msg and "oops" in msg
    assert re.search(r">>\s+\d+ \| .*oops", msg)


def test_unsupported_shapes_are_clear_errors():
    b = examples.Builder()
    x = b.buf("x", examples.BK.IO_INPUT, DType.BF16, (1, 20000))
    w = b.buf("w", examples.BK.WEIGHT, DType.BF16, (4, 20000))
    y = b.buf("y", examples.BK.IO_OUTPUT, DType.BF16, (1, 4))
    b.task(InstructionKind.GEMV_TILE, [x, w], [y], {"K": 20000})
    with pytest.raises(CompileError, match="K=20000"):
        render(b.program())


def test_malformed_recipe_is_refused():
    b = examples.Builder()
    x = b.buf("x", examples.BK.IO_INPUT, DType.F32, (4,))
    y = b.buf("y", examples.BK.IO_OUTPUT, DType.F32, (4,))
    b.task(InstructionKind.FUSED, [x], [y], {"recipe": {"steps": [
        {"op": int(InstructionKind.COPY), "args": [{"s": 3}], "out": "final"}]}})
    with pytest.raises(CompileError, match="scratch"):
        render(b.program())


def _stream_program():
    """Two plain GEMV tiles and a fused gate/up-like task (two GEMVs) on 2 queues."""
    b = examples.Builder()
    x = b.buf("x", examples.BK.IO_INPUT, DType.BF16, (1, 2048))
    w = b.buf("w", examples.BK.WEIGHT, DType.BF16, (64, 2048))
    u = b.buf("u", examples.BK.WEIGHT, DType.BF16, (64, 2048))
    y = b.buf("y", examples.BK.IO_OUTPUT, DType.BF16, (1, 64))
    z = b.buf("z", examples.BK.IO_OUTPUT, DType.BF16, (1, 64))
    b.task(InstructionKind.GEMV_TILE, [x, w], [y], {"n_off": 0, "N_tile": 20, "K": 2048})
    b.task(InstructionKind.GEMV_TILE, [x, w], [y], {"n_off": 20, "N_tile": 44, "K": 2048})
    steps = [{"op": int(InstructionKind.GEMV_TILE), "args": [{"in": 0}, {"in": i}], "out": i - 1,
              "params": {"n_off": 8, "N_tile": 16, "K": 2048}, "out_shape": [1, 64],
              "out_dtype": "bfloat16"} for i in (1, 2)]
    steps.append({"op": int(InstructionKind.SILU_MUL), "args": [{"s": 0}, {"s": 1}], "out": "final",
                  "params": {"n_off": 8, "N_tile": 16}})
    b.task(InstructionKind.FUSED, [x, w, u], [z], {"recipe": {"steps": steps}})
    return b.program([[2, 0], [1]]), w, u


def test_weight_stream_is_each_queues_chunks_in_the_order_its_gemvs_take_them(monkeypatch):
    monkeypatch.setenv("AMK_GEMV_RING", "1")
    prog, w, u = _stream_program()
    low = lower_program(prog)
    assert all(v.startswith("op_gemv_ring<") for v in low.variants if "gemv" in v)
    row = 2048 * 2                                    # 8 whole rows per 32 KiB chunk

    def tile(buf, lo, n):                             # (buffer, byte offset, bytes) per chunk
        return [(buf, (lo + r) * row, min(8, n - r) * row) for r in range(0, n, 8)]
    want = [tile(w, 8, 16) + tile(u, 8, 16) + tile(w, 0, 20), tile(w, 20, 44)]
    off = low.stream_off.tolist()
    assert off == [0, len(want[0]), len(want[0]) + len(want[1])]
    for q in range(2):
        got = [(low.ranges[i][0][1], low.ranges[i][1], low.ranges[i][2])
               for i in low.stream[off[q]:off[q + 1]]]
        assert got == want[q]
    monkeypatch.setenv("AMK_GEMV_RING", "0")
    low0 = lower_program(prog)
    assert len(low0.stream) == 0 and low0.stream_off.tolist() == [0, 0, 0]


@pytest.mark.parametrize("ring", ["0", "1"])
def test_all_cases_compile_with_the_weight_stream_on_and_off(cache, monkeypatch, ring):
    monkeypatch.setenv("AMK_GEMV_RING", ring)
    monkeypatch.setenv("AMK_CTAS_PER_SM", "1")                 # the ring needs a whole SM
    src = render(examples.combined_program())
    assert ("op_gemv_ring<" in src) == (ring == "1")
    res = compile_source(src, "sm_90a")
    static = max(int(m) for m in re.findall(r"(\d+) bytes smem", res.log))
    assert smem.SMEM_BYTES + static <= 227 * 1024, "over the 227 KiB a CTA may have"


def test_fused_llama_tasks_skip_needless_zeroing_keep_the_norm_in_smem_and_list_all_pointers(monkeypatch):
    """1B-shaped layer: column-tile scratch that is read only inside its tile is not zeroed,
    norm -> GEMV chains hand x over in shared memory, and each task's pointers (its own, then
    its steps') are one contiguous run of n_ptr_all entries (the scheduler copies them at once)."""
    from dataclasses import replace
    from amk.models.presets import LLAMA_3_2_1B, random_model
    from amk.program.ir import InstructionKind as K
    monkeypatch.setenv("AMK_GEMV_PIPE", "1")                 # gate/up: one 2-matrix pipe GEMV
    prog = random_model(replace(LLAMA_3_2_1B, max_seq=160, n_layers=1), device="meta") \
        .lower(backend="cuda").program
    low = lower_program(prog)
    gi, ni = abi.ip_index("GEMV", "XS_READY"), abi.ip_index("NORM", "TO_SMEM")
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
        gemvs = [s for s in subs if int(s["op"]) == K.GEMV_TILE]   # gate/up: one pipe pair
        if ops == (K.RMSNORM, K.GEMV_TILE, K.GEMV_TILE, K.SILU_MUL):
            assert len(gemvs) == 1 and gemvs[0]["ip"][abi.ip_index("GEMV", "NMAT")] == 2
        if ops[0] == K.RMSNORM and ops[1] == K.GEMV_TILE:
            assert subs[0]["ip"][ni] == 1
            assert all(s["ip"][gi] == 1 for s in gemvs)
        else:
            assert all(s["ip"][gi] == 0 for s in gemvs)
    assert (K.GEMV_TILE, K.ADD) in seen and (K.ROPE, K.ROPE, K.ATTENTION_TILE) in seen
    assert (K.RMSNORM, K.GEMV_TILE, K.GEMV_TILE, K.SILU_MUL) in seen


def test_a_scratch_read_outside_its_tile_is_still_zeroed():
    """A GEMV tile whose scratch a later GEMV reads whole (as x) keeps its zeroing."""
    from amk.backends.cuda.lower import View, REF_SCRATCH, Encoded, _tile_reads_only
    s = View((1, 64), DType.F32, (REF_SCRATCH, 0))
    x = View((1, 64), DType.F32, (0, 1))
    tile = Encoded(int(InstructionKind.GEMV_TILE), "", ip=dict(N_OFF=0, N_TILE=16, M=1, K=64))
    whole = Encoded(int(InstructionKind.GEMV_TILE), "", ip=dict(N_OFF=0, N_TILE=64, M=1, K=64))
    add_in = Encoded(int(InstructionKind.ADD), "", ip=dict(C0=0, C1=16))
    add_out = Encoded(int(InstructionKind.ADD), "", ip=dict(C0=0, C1=32))
    assert _tile_reads_only([(tile, [x], [s]), (add_in, [x, s], [x])], s.ref)
    assert not _tile_reads_only([(tile, [x], [s]), (add_out, [x, s], [x])], s.ref)
    assert not _tile_reads_only([(tile, [x], [s]), (whole, [s], [x])], s.ref)


def test_smem_staged_attention_is_the_default_and_compiles(cache, monkeypatch):
    monkeypatch.setenv("AMK_ATTN_SMEM", "0")                 # the v5 attention: opt-out
    assert "op_attention_smem<" not in render(examples.combined_program())
    monkeypatch.delenv("AMK_ATTN_SMEM", raising=False)
    src = render(examples.combined_program())
    assert "op_attention_smem<" in src
    res = compile_source(src, "sm_90a")
    assert res.cubin[:4] == b"\x7fELF"
    assert re.search(r"op_attention_smem.*\n.*0 bytes stack frame", res.log)


def test_staged_attention_takes_the_largest_head_pass_that_divides_a_kv_group(monkeypatch):
    monkeypatch.delenv("AMK_ATTN_SMEM", raising=False)
    passes = {}
    for c in examples.cases():
        call = (lower_program(c.program).variants or [""])[0]
        if call.startswith("op_attention_smem<"):
            passes[c.name] = int(re.search(r", (\d+), \d+>\(AMK_ARGS\)$", call).group(1))
    # heads a kv group: 4 (Llama-style GQA), 1 (MHA), 3, 12 (two passes of 6)
    assert passes["attention_gqa_bf16"] == 4 and passes["attention_batched_long"] == 1
    assert passes["attention_rep3_f32"] == 3 and passes["attention_rep12_hd128"] == 6


def test_two_ctas_per_sm_render_256_threads_that_fit_twice_in_an_sm(cache, monkeypatch):
    """AMK_CTAS_PER_SM=2: 256-thread CTAs bounded for 2 per SM, 64 KiB dynamic smem each (no
    ring), the cuda target places on 2 x SMs queues, and the lowered cache keys on the knob."""
    from amk.backends.cuda import lowered_cache
    from amk.passes.options import PassOptions, gpu_target
    monkeypatch.delenv("AMK_GEMV_RING", raising=False)
    prog = examples.combined_program()
    monkeypatch.setenv("AMK_CTAS_PER_SM", "1")
    one = gpu_target(ctas_per_sm=1).num_sms
    key1 = lowered_cache._key(prog, 264)
    assert smem.launch_shape(1) == (512, smem.SMEM_BYTES)
    monkeypatch.setenv("AMK_CTAS_PER_SM", "2")
    assert gpu_target(ctas_per_sm=2).num_sms == 2 * one
    assert PassOptions.for_backend("cuda", ctas_per_sm=2).target.num_sms == 2 * one
    assert PassOptions.for_backend("reference", ctas_per_sm=2).target.num_sms == 4   # CPU target
    assert lowered_cache._key(prog, 264) != key1
    threads, dyn = smem.launch_shape(2)
    assert (threads, dyn) == (256, 64 * 1024)
    src = render(prog)
    assert "#define AMK_NTHREADS 256\n" in src and "#define AMK_CTAS_PER_SM 2\n" in src
    assert "__launch_bounds__(NT, AMK_CTAS_PER_SM)" in src
    res = compile_source(src, "sm_90a")
    static = max(int(m) for m in re.findall(r"(\d+) bytes smem", res.log))
    assert 2 * (dyn + static + 1024) <= 228 * 1024, "two CTAs must fit in an SM's 228 KiB"
    assert "op_gemv<" in src and "op_gemv_ring<" not in src


def test_two_ctas_per_sm_refuse_the_ring_and_other_counts(monkeypatch):
    from amk import knobs
    monkeypatch.setenv("AMK_CTAS_PER_SM", "2")
    monkeypatch.setenv("AMK_GEMV_RING", "1")
    with pytest.raises(CompileError, match="AMK_GEMV_RING=0"):
        render(examples.combined_program())
    monkeypatch.setenv("AMK_CTAS_PER_SM", "3")
    with pytest.raises(ValueError, match="1 or 2"):
        knobs.ctas_per_sm()
