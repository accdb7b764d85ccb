"""Shapes that are not presets: `with_overrides` (bench/decode.py --set, bench/ab.py --set)
changes a preset's fields with their own types, and refuses what it cannot set, saying which."""
from dataclasses import replace

import pytest
import torch

from amk.models.presets import PRESETS, random_model, with_overrides


def test_overrides_keep_each_fields_type_and_the_rest_of_the_preset():
    base = PRESETS["llama-3.2-1b"]
    cfg = with_overrides(base, ["hidden=1536", "n_heads=12", "n_kv_heads=4", "ffn=6144", "rms_eps=1e-6",
                                "qk_norm=true"])
    assert (cfg.hidden, cfg.n_heads, cfg.ffn, cfg.rms_eps, cfg.qk_norm) == (1536, 12, 6144, 1e-6, True)
    assert cfg.n_kv_heads == 4 and cfg.head_dim == base.head_dim and cfg.vocab == base.vocab and cfg.dtype == base.dtype
    assert with_overrides(base, []) == base


@pytest.mark.parametrize("item, says", [
    ("width=4", "FIELD one of"), ("hidden", "FIELD one of"), ("dtype=fp16", "FIELD one of"),
    ("hidden=1.5", "hidden takes a int"), ("qk_norm=maybe", "qk_norm takes a bool"),
    ("n_kv_heads=5", "multiple of kv heads"), ("n_layers=0", "at least 1"),
])
def test_a_bad_override_says_what_and_which(item, says):
    with pytest.raises(ValueError, match=says):
        with_overrides(PRESETS["llama-3.2-1b"], [item])


def test_an_overridden_shape_runs_a_step():
    cfg = with_overrides(replace(PRESETS["tiny-llama"], max_seq=16), ["hidden=48", "ffn=80", "n_heads=6",
                                                                      "n_kv_heads=3", "head_dim=8"])
    m = random_model(cfg, seed=3)
    tok, logits, _ = m.jit("reference")(m.params, torch.tensor([4], dtype=torch.int32),
                                        torch.tensor([0], dtype=torch.int32), m.new_kv())
    assert logits.reshape(-1).shape == (cfg.vocab,) and torch.isfinite(logits).all()
