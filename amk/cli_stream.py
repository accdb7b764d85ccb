"""Streaming text for `amk generate`: print each new token's text as it arrives.

A token can end in the middle of a UTF-8 character (byte-level BPE) or change how the text
before it decodes, so the whole continuation is decoded each time and only the new suffix is
printed; text ending in an incomplete character (U+FFFD) waits for the next token.
"""
from __future__ import annotations

import sys


class TextStream:
    def __init__(self, decode, out=None):
        self.decode = decode          # list[int] -> str
        self.out = out or sys.stdout
        self.ids: list[int] = []
        self.printed = ""

    def add(self, token_id: int) -> None:
        self.ids.append(int(token_id))
        text = self.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        self._emit(text)

    def close(self) -> None:
        """Print whatever is left (even an incomplete character) and end the line."""
        self._emit(self.decode(self.ids))
        self.out.write("\n")
        self.out.flush()

    def _emit(self, text: str) -> None:
        # Printed text cannot be taken back: if an earlier piece now decodes differently
        # (rare), only what lies past the printed length is new.
        new = text[len(self.printed):]
        if new:
            self.out.write(new)
            self.out.flush()
            self.printed = text
