"""bench/decode.py's peers and inputs on the CPU: the plain-PyTorch decode step equals AMK's
reference backend at batch 1 and batch 3 (logits, argmax and the cache rows it writes), and
--quant quantizes a copy of the weights while the peers keep the bf16 ones."""
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from decode import quantized  # noqa: E402
from torch_llama import torch_decode_step  # noqa: E402

from amk.models.model import Model  # noqa: E402
from amk.models.presets import PRESETS, random_params  # noqa: E402
from amk.quant import QuantizedWeight  # noqa: E402

CFG = replace(PRESETS["tiny-llama"], dtype=torch.float32, max_seq=32)


def test_torch_peer_equals_the_reference_backend_at_batch_1_and_3():
    params = random_params(CFG, seed=0)
    m = Model(CFG, params)
    for batch in (1, 3):
        token = torch.tensor([5, 9, 11][:batch], dtype=torch.int32)
        pos = torch.tensor([6], dtype=torch.int32)
        kv_peer = m.new_kv(batch)
        for layer in kv_peer:
            for t in layer.values():
                t.normal_(generator=torch.Generator().manual_seed(batch))
        kv_amk = [{k: v.clone() for k, v in layer.items()} for layer in kv_peer]
        ids_p, logits_p = torch_decode_step(CFG, params, token, pos, kv_peer)
        ids_a, logits_a, _ = m.jit("reference")(params, token, pos, kv_amk)
        torch.testing.assert_close(logits_p.reshape(batch, -1), logits_a.reshape(batch, -1),
                                   rtol=1e-5, atol=1e-5)
        assert ids_p.reshape(-1).tolist() == ids_a.reshape(-1).tolist()
        for a, b in zip(kv_peer, kv_amk):
            torch.testing.assert_close(a["k"], b["k"])
            torch.testing.assert_close(a["v"], b["v"])


def test_quant_copies_the_weights_and_keeps_the_bf16_ones():
    params = random_params(CFG, seed=1)
    wq = params["layers"][0]["wq"]
    q = quantized(CFG, params, "int8")
    assert isinstance(q["layers"][0]["wq"], QuantizedWeight) and isinstance(q["lm_head"], QuantizedWeight)
    assert params["layers"][0]["wq"] is wq and not isinstance(params["lm_head"], QuantizedWeight)
    assert quantized(CFG, params, None) is params


def test_the_quantized_torch_peer_runs_int8_and_int4_near_the_bf16_step_and_refuses_fp8():
    from torch_quant_peer import peer_params
    cfg = replace(CFG, hidden=128, ffn=256, n_heads=4, n_kv_heads=2, head_dim=32, vocab=256,
                  dtype=torch.bfloat16)
    params = random_params(cfg, seed=2)
    token, pos = torch.tensor([5], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    _, ref = torch_decode_step(cfg, params, token, pos, Model(cfg, params).new_kv(1))
    for fmt, tol in (("int8", 0.03), ("int4", 0.3)):
        q = peer_params(params, fmt)
        assert q["layers"][0]["wq"][0] == fmt and q["layers"][0]["attn_norm"] is params["layers"][0]["attn_norm"]
        _, got = torch_decode_step(cfg, q, token, pos, Model(cfg, params).new_kv(1))
        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        assert 0 < err < tol, (fmt, err)
    with pytest.raises(ValueError, match="no weight-only fp8 kernel"):
        peer_params(params, "fp8")
