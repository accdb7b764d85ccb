"""from_pretrained: a saved safetensors folder (sharded, memory-mapped, no transformers model
in memory) gives the same tokens as from_hf on the model it was saved from; its tokenizer
comes along, and `amk generate --model PATH` runs it."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from amk import cli  # noqa: E402
from amk.errors import TraceError  # noqa: E402
from amk.models import from_hf, from_pretrained  # noqa: E402
from amk.models.safetensors_mmap import read_file  # noqa: E402

from test_families import VOCAB, cases, tiny_hf  # noqa: E402


def save(hf, folder, shard="20KB"):
    hf.save_pretrained(folder, max_shard_size=shard)
    return folder


@pytest.mark.parametrize("case", ["gemma2", "gpt2", "phi3"])
def test_saved_sharded_folder_gives_the_same_tokens(case, tmp_path):
    hf = tiny_hf(cases()[case]())
    folder = save(hf, tmp_path / case)
    assert (folder / "model.safetensors.index.json").is_file()       # really sharded
    ids = [5, 17, 3, 42, 9]
    want = from_hf(hf, max_seq=24).generate(ids, 8, backend="reference")
    assert from_pretrained(folder, max_seq=24).generate(ids, 8, backend="reference") == want


def test_llama_folder_and_the_tensors_are_memory_mapped(tmp_path):
    from test_models import tiny_hf as tiny_llama
    hf = tiny_llama(transformers.LlamaConfig)
    folder = save(hf, tmp_path / "llama", shard="10GB")
    t = read_file(folder / "model.safetensors")
    w = t["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(w, hf.model.layers[0].self_attn.q_proj.weight)
    other = t["model.layers.1.mlp.up_proj.weight"]
    storage = w.untyped_storage()                       # one mmap of the whole file for all
    assert storage.data_ptr() == other.untyped_storage().data_ptr()
    assert storage.nbytes() == (folder / "model.safetensors").stat().st_size
    ids = [1, 2, 3]
    assert (from_pretrained(folder, max_seq=16).generate(ids, 6, backend="reference")
            == from_hf(hf, max_seq=16).generate(ids, 6, backend="reference"))


def word_tokenizer(folder):
    """A word-level fast tokenizer over VOCAB made-up words, saved next to the weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                                bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)


def test_the_folder_tokenizer_and_amk_generate_model_path(tmp_path, capsys):
    hf = tiny_hf(cases()["olmo2"]())
    folder = save(hf, tmp_path / "olmo2")
    word_tokenizer(folder)
    m = from_pretrained(folder, max_seq=32)
    assert m.tokenizer is not None
    want = m.decode(m.generate("w5 w6 w7", 6, backend="reference"))
    assert cli.main(["generate", "--model", str(folder), "--prompt", "w5 w6 w7", "--backend",
                     "reference", "--max-new-tokens", "6", "--ignore-eos", "--no-prompt",
                     "--max-seq", "32"]) == 0
    assert capsys.readouterr().out.strip() == want.strip()


def test_a_folder_without_weights_or_config_is_a_clear_error(tmp_path):
    with pytest.raises(TraceError, match="has no config.json"):
        from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2).to_dict()))
    with pytest.raises(TraceError, match="no \\*.safetensors files"):
        from_pretrained(tmp_path)
