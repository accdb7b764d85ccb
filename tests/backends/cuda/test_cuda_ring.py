"""Kernel v2 (AMK_KERNEL=v2) on the CPU: the weight ring's page order (ring.py, which the
producer and the consumers in templates/ring.cuh both follow), which steps stream through it,
and the v2 kernel of every preset compiled by NVRTC for sm_90a without spills in its hot
functions. The GPU runs it in tests/gpu/test_kernel_v2_gpu.py."""
import re
from dataclasses import replace

import numpy as np
import pytest

from amk.program.ir import InstructionKind as K
from amk.backends.cuda import abi, gemv_batch, ring, smem
from amk.backends.cuda.lower import fold_program, lower_program
from amk.backends.cuda.options import CudaOptions
from amk.models.presets import PRESETS, random_model
from amk.testing import cuda_examples as examples, mma_examples

V2 = CudaOptions(kernel="v2")
# (nmat, n_off, n_tile, row_bytes, pitch): K of 1024 / 2048 / 3072 / 8192 bf16, odd tiles, a row
# shorter than a segment, a pitch wider than the row (a K slice of a wider weight)
SHAPES = [(1, 0, 24, 4096, 4096), (2, 40, 20, 4096, 4096), (1, 3, 7, 2048, 2048),
          (1, 0, 16, 16384, 16384), (2, 0, 5, 6144, 6144), (1, 10, 9, 160, 256), (2, 1, 3, 16, 48),
          (1, 0, 1, 12288, 12288)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_items_copy_each_byte_of_the_tile_once_where_the_consumer_reads_it(shape):
    nmat, n_off, n_tile, rowb, pitch = shape
    slot = ring.slot_bytes([rowb])
    seen = {}                                   # (mat, source byte) -> (item, page byte)
    for it in range(ring.n_items(nmat, n_tile, rowb)):
        copies = ring.item_copies(nmat, n_off, n_tile, rowb, pitch, it)
        assert copies, f"item {it} copies nothing"
        spans = sorted((c.dst, c.dst + c.nbytes) for c in copies)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "copies overlap in the page"
        for c in copies:                        # bulk copies: 16-byte sizes and addresses
            assert c.nbytes % 16 == 0 and c.dst % 16 == 0 and c.src % 16 == 0 and c.nbytes > 0
            assert c.dst + c.nbytes <= slot
            for k in range(0, c.nbytes, 16):
                key = (c.mat, c.src + k)
                assert key not in seen, f"byte {key} copied twice"
                seen[key] = (it, c.dst + k)
        for j in range(2):                      # the consumer's reads land on those bytes
            for v in range(rowb // 16):
                off = ring.consumer_offset(nmat, n_tile, rowb, it, j, v)
                nseg = -(-rowb // ring.SEG_BYTES)
                g = it // nseg
                r = g if nmat == 2 else 2 * g + j
                key = (j if nmat == 2 else 0, (n_off + r) * pitch + v * 16)
                if off is not None:
                    assert seen.get(key) == (it, off), (it, j, v)
    want = {(m, (n_off + r) * pitch + b) for m in range(nmat) for r in range(n_tile)
            for b in range(0, rowb, 16)}
    assert set(seen) == want                    # every vector the GEMV reads, nothing else
    # every vector is read by exactly one (item, row, vector) of the consumer
    reads = [(it, j, v) for it in range(ring.n_items(nmat, n_tile, rowb)) for j in range(2)
             for v in range(rowb // 16) if ring.consumer_offset(nmat, n_tile, rowb, it, j, v) is not None]
    assert len(reads) == len(want)


def test_a_page_is_read_by_one_warp_phase_after_phase():
    """Item q -> page q % pages and warp q % pages: a warp's waits on its page's full barrier
    are for consecutive phases (a parity wait two phases behind would pass at once)."""
    for slot in (512, 4096, 8192):
        n = ring.pages(slot)
        assert 2 <= n <= 16 and n * slot <= smem.RING_BYTES
        for q in range(200):
            assert ring.consumer_warp(q, n) == q % n


def test_the_v2_layout_fits_one_cta_and_keeps_the_combines_staging():
    assert smem.SMEM_BYTES_V2 + smem.STATIC_RESERVE <= smem.CTA_SMEM_MAX
    assert smem.RING_OFF == smem.STAGE_OFF + smem.STAGE_BYTES_V2
    # one 8 KiB page (an item of 2 rows x a 4 KiB segment) for each of the 16 consumer warps
    assert ring.pages(ring.slot_bytes([4096])) == 16 and smem.ATTN_SMEM <= smem.RING_OFF
    # v2's combine into x stages from x's end (1024-aligned, ops_simple.cuh) up to the ring:
    # the 1B's 8 partials of 32 heads x (64 + 2) fp32 after its 32 x 64 fp32 of x, and
    # Qwen3-0.6B's 8 of 16 x (128 + 2) after its 16 x 128
    for heads, hd in ((32, 64), (16, 128)):
        x_end = (heads * hd * 4 + 1023) // 1024 * 1024
        assert 8 * heads * (hd + 2) * 4 <= smem.RING_OFF - x_end
    assert smem.cta_threads("v2") == 640 and smem.cta_threads("v1") == 512


def _ring_steps(low):
    """(queue, position, descriptor) of every lowered step the producer streams, walking the
    tables as ring_produce does."""
    t, gi = low.tasks, abi.ip_index("GEMV", "RING")
    out = []
    for q, queue in enumerate(low.queues):
        for k, tid in enumerate(queue):
            d = t[tid]
            subs = (range(int(d["sub_begin"]), int(d["sub_begin"]) + int(d["n_sub"]))
                    if int(d["op"]) == int(K.FUSED) else [tid])
            for s in subs:
                if int(t[s]["op"]) in (int(K.GEMV_TILE), int(K.GEMM_TILE)) and t[s]["ip"][gi] > 0:
                    out.append((q, k, s))
    return out


def test_v2_streams_exactly_the_steps_whose_variant_takes_the_ring():
    """The producer picks steps by their descriptor (GEMV op, ip RING > 0), the consumers by
    their variant (op_gemv_direct<..., RING>): the two must be the same steps, or the ring's
    item numbers drift apart. A 1B layer: q/k/v, o (after the combine), gate/up, down, LM head."""
    cfg = replace(PRESETS["llama-3.2-1b"], n_layers=1, max_seq=1088)
    m = random_model(cfg, device="meta")
    prog = m.lower(backend="cuda").program
    low = lower_program(prog, 132, V2)
    streamed = {s for _, _, s in _ring_steps(low)}
    ring_vars = {i for i, v in enumerate(low.variants) if v.fn == "op_gemv_direct" and v.arg("ring")}
    takes = {i for i in range(len(low.tasks)) if int(low.tasks[i]["variant"]) in ring_vars}
    assert streamed and streamed == takes
    direct = {i for i, v in enumerate(low.variants) if v.fn == "op_gemv_direct"}
    assert ring_vars == direct                   # every float batch-1 GEMV of the model streams
    ip = low.tasks["ip"]
    pre = abi.ip_index("GEMV", "PRE")
    assert not low.tasks["n_pre"].any() and not ip[list(takes), pre].any()   # no preload under v2
    for s in takes:
        d = low.tasks[s]
        v = low.variants[int(d["variant"])]
        assert ip[s, abi.ip_index("GEMV", "RING")] == v.arg("nmat")
        assert ip[s, abi.ip_index("GEMV", "ROWB")] == ip[s, abi.ip_index("GEMV", "K")] * 2   # bf16
    v1 = lower_program(prog, 132, CudaOptions())
    assert not any(v.arg("ring") for v in v1.variants)
    assert not v1.tasks["ip"][:, abi.ip_index("GEMV", "RING")][
        np.isin(v1.tasks["variant"], [i for i, v in enumerate(v1.variants) if v.fn == "op_gemv_direct"])].any()


def test_the_ring_stall_program_streams_behind_its_stuck_task():
    """tests/gpu's deadlock case for the producer: its GEMV tiles (after the stuck copy, on one
    CTA) stream more items than the ring has pages."""
    low = lower_program(examples.ring_stall_program(), 132, V2)
    steps = _ring_steps(low)
    assert len(steps) == 4 and all(q == 1 for q, _, _ in steps)
    items = sum(ring.n_items(1, 64, 4096) for _ in steps)
    assert items > ring.pages(ring.slot_bytes([4096]))


def test_kernel_knob_is_part_of_every_cuda_cache_key(monkeypatch):
    from amk import knobs
    monkeypatch.delenv("AMK_KERNEL", raising=False)
    assert knobs.cuda_options().kernel == "v1"
    monkeypatch.setenv("AMK_KERNEL", "v2")
    v2 = knobs.cuda_options()
    assert v2.kernel == "v2" and v2.key() != replace(v2, kernel="v1").key()
    monkeypatch.setenv("AMK_KERNEL", "v3")
    with pytest.raises(ValueError, match="AMK_KERNEL"):
        knobs.cuda_options()
    with pytest.raises(ValueError, match="kernel"):
        CudaOptions(kernel="v9")


# The streamed GEMVs and the combine folded into the o tiles: no spill at the consumers' 112
# registers. (At 112 the 1B's staged attention spills 16-20 B.) The scheduler loop (the kernel
# body, at the launch's 96) reloads nothing from local memory: its running entry and FUSED step
# live in shared memory (v21's tree reloaded 52 B at every task end: NOTES kv2b); it stores only
# the calls' return addresses.
HOT = ("op_gemv_direct", "op_combine", "combine_direct")


@pytest.mark.parametrize("name", ["llama-3.2-1b", "qwen3-0.6b", "llama-3-8b"])
def test_v2_kernel_of_each_preset_compiles_for_sm90a_without_spills_in_hot_functions(name):
    """NVRTC + ptxas for sm_90a at a user's cache (8192 rows): 640 threads a CTA (launched with
    96 registers), the consumers' GEMVs allocated with setmaxnreg's 112 registers and no
    spills, the dynamic + static shared memory within the CTA's 227 KiB."""
    pytest.importorskip("cuda.bindings")
    from amk.backends.cuda import compile_source, render
    cfg = replace(PRESETS[name], max_seq=8192, n_layers=2)
    prog = random_model(cfg, device="meta").lower(backend="cuda").program
    src = render(prog, V2)
    assert "#define AMK_KERNEL_V2 1" in src and "#define AMK_CTA_THREADS 640" in src
    assert "setmaxnreg.inc.sync.aligned.u32" in src
    res = compile_source(src, "sm_90a")
    assert res.cubin[:4] == b"\x7fELF"
    assert re.search(r"Used 96 registers, used 2 barriers", res.log)
    static = max(int(m) for m in re.findall(r"(\d+) bytes smem", res.log))
    assert smem.SMEM_BYTES_V2 + static <= smem.CTA_SMEM_MAX
    blocks = re.findall(r"Function properties for (\S+)\n(.*)\n", res.log)
    hot = [(n, line) for n, line in blocks if any(h in n for h in HOT)]
    assert any("op_gemv_direct" in n for n, _ in hot)
    for n, line in hot:
        assert "0 bytes spill stores, 0 bytes spill loads" in line, (n, line)
    body = [line for n, line in blocks if n == "amk_megakernel"]
    assert len(body) == 1 and " 0 bytes spill loads" in body[0], body
    sass = _disassemble(res.cubin)
    if sass is not None:        # one CTA-wide barrier (the prologue's); every other the consumers'
        assert len(re.findall(r"BAR\.SYNC\S* 0x0 ;", sass)) == 1
        assert len(re.findall(r"BAR\.SYNC\S* 0x1, 0x200 ;", sass)) > 8
        assert not re.search(r"BAR\.(SYNC|RED|ARV)\S* (0x0,|0x[2-9a-f])", sass)


def _disassemble(cubin: bytes) -> str | None:
    """The cubin's SASS by nvdisasm (the CUDA toolkit's or the one triton ships), or None."""
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path
    tool = shutil.which("nvdisasm")
    if tool is None:
        try:
            import triton
            found = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
            tool = str(found) if found.exists() else None
        except ImportError:
            pass
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout


def test_every_instruction_case_and_the_profile_build_compile_on_v2():
    """tests/gpu's instruction cases in one v2 kernel (quantized and batched GEMVs, attention,
    combine... on v1's code inside it, the float GEMVs on the ring), as a profile build."""
    pytest.importorskip("cuda.bindings")
    from amk.backends.cuda import compile_source, render
    opts = CudaOptions(kernel="v2", profile=True)
    low = lower_program(examples.combined_program(), 132, opts)
    assert any(v.arg("ring") for v in low.variants)
    assert any(v.fn == "op_gemv" for v in low.variants)              # stays on register loads
    res = compile_source(render(examples.combined_program(), opts), "sm_90a", cuda_options=opts)
    assert res.cubin[:4] == b"\x7fELF"


def _mma_bytes(folded):
    return [gemv_batch.step_bytes(e.variant, e.ip) for ft in folded.tasks for e, _, _ in ft.steps
            if e.is_fn("op_gemv_mma")]


def test_v2_plans_the_batched_gemvs_below_the_ring():
    """A v2 program that streams (the instruction cases: float batch-1 GEMVs on the ring) runs its
    op_gemv_mma steps' work areas below the ring: v1's plans of the mma cases (the 16 x 8192
    bf16 and the int8 batch-64 ones, up to SMEM_BYTES) reach into it, where the producer fills
    pages for later tasks while they run."""
    prog = examples.combined_program(examples.cases() + mma_examples.cases())
    v1 = _mma_bytes(fold_program(prog, 132, CudaOptions()))
    folded = fold_program(prog, 132, V2)
    v2 = _mma_bytes(folded)
    assert any(e.variant.arg("ring") for ft in folded.tasks for e, _, _ in ft.steps if e.is_fn("op_gemv_direct"))
    assert len(v1) == len(v2) and max(v1) > smem.RING_OFF >= max(v2)
    assert [b for b in v1 if b <= smem.RING_OFF] == [b for b, c in zip(v2, v1) if c <= smem.RING_OFF]
