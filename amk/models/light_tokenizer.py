"""A tokenizer straight from a folder's tokenizer.json through the `tokenizers` library: what
`Model.generate` and `amk generate` use (encode, decode, eos_token_id) without importing
transformers, which alone takes seconds. Anything else (a chat template) loads transformers'
tokenizer from the same folder on first use and asks it."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace


class LightTokenizer:
    def __init__(self, folder: str | Path):
        from tokenizers import Tokenizer
        self.folder = Path(folder)
        self._tok = Tokenizer.from_file(str(self.folder / "tokenizer.json"))
        cfg_path = self.folder / "tokenizer_config.json"
        self._config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self._full = None

    @staticmethod
    def available(folder: str | Path) -> bool:
        return (Path(folder) / "tokenizer.json").is_file()

    def _token_id(self, key: str):
        tok = self._config.get(key)
        if isinstance(tok, dict):
            tok = tok.get("content")
        return self._tok.token_to_id(tok) if tok else None

    @property
    def eos_token_id(self):
        return self._token_id("eos_token")

    @property
    def bos_token_id(self):
        return self._token_id("bos_token")

    def __call__(self, text: str):
        return SimpleNamespace(input_ids=self._tok.encode(text).ids)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name):          # e.g. apply_chat_template: the full tokenizer
        if name.startswith("_"):
            raise AttributeError(name)
        if self._full is None:
            from transformers import AutoTokenizer
            self._full = AutoTokenizer.from_pretrained(str(self.folder))
        return getattr(self._full, name)
