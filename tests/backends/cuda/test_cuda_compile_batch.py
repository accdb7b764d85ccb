"""CPU CI: a decode batch with a position per sequence (pos int32 [B], a cache per sequence)
lowers to batched attention tasks whose descriptors carry their sequences, and renders to CUDA
that NVRTC compiles to an sm_90a cubin (no GPU needed)."""
from dataclasses import replace

import pytest
import torch

pytest.importorskip("cuda.bindings")

from amk.models.presets import LLAMA_3_2_1B, TINY_LLAMA, random_model  # noqa: E402
from amk.program.ir import InstructionKind as K  # noqa: E402


def _lower_batch(cfg, batch, device):
    m = random_model(cfg, device=device)
    token = torch.zeros(batch, dtype=torch.int32, device=m.device)
    pos = torch.zeros(batch, dtype=torch.int32, device=m.device)
    return m.jit("cuda").lower(m.params, token, pos, m.new_kv(batch))


@pytest.mark.parametrize("name,cfg,batch,device,shards", [
    ("tiny-llama bf16 batch 4", replace(TINY_LLAMA, dtype=torch.bfloat16), 4, "cpu", 1),
    ("llama-3.2-1b shape batch 4", replace(LLAMA_3_2_1B, max_seq=8192, n_layers=2), 4, "meta", 4),
    ("llama-3.2-1b shape batch 16", replace(LLAMA_3_2_1B, max_seq=8192), 16, "meta", 1),
])
def test_batch_with_a_position_per_sequence_compiles_for_sm90a(name, cfg, batch, device, shards):
    low = _lower_batch(cfg, batch, device)
    att = [t for t in low.program.tasks if t.op is K.ATTENTION_TILE
           or (t.op is K.FUSED and "ATTENTION_TILE" in str(t.params["recipe"]))]
    assert att and all("b_off" in str(t.params) for t in att)
    folded = str(low.stages["cuda_folded"]).splitlines()
    # each attention task is one instruction that rotates its own sequences' q and new k rows
    # at their own positions; the combines merge the shards' partials, counting the live ones
    # per row (more than one shard; at one shard a sequence the attention writes y: no combine)
    # (on tensor cores for the 1B's one shard a sequence: bf16, head dim 64)
    fn = "op_attention_mma<" if shards == 1 and "1b" in name else "op_attention_smem<"
    at = [i for i, ln in enumerate(folded) if "op_attention_" in ln and "<" in ln]
    assert len(at) == len(att) and all(fn in folded[i] for i in at)
    heads = [folded[i - 1] for i in at]
    assert all("(FUSED, one instruction)" in h or "ATTENTION_TILE" in h for h in heads)
    params = [folded[i + 1] for i in at]
    assert all("Q_ROPE=1" in ln and "K_ROPE=1" in ln and "POS_SEQ=1" in ln for ln in params)
    combine = [folded[i + 1] for i, ln in enumerate(folded) if "op_combine<" in ln]
    assert bool(combine) == (shards > 1) and all(f"P={shards}" in ln for ln in combine)
    assert all("SHARD_ROWS" in ln and "POS_SEQ=1" in ln for ln in combine)
    cubin = low.compile_cuda(arch="sm_90a")
    assert cubin[:4] == b"\x7fELF"
