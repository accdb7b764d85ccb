"""IdentityMemo: values keyed by an object's identity (plus a hashable rest), for the compile
path's per-kind memos. A decoder's layers repeat each FUSED task over other buffers, with one
shared recipe object (fuse shares equal recipes): what depends only on the recipe and the
operands' shapes is computed once per kind, not once per task. The memo holds each key object,
so its id cannot be reused by another object while the entry lives."""
from __future__ import annotations

from typing import Callable, Hashable, TypeVar

V = TypeVar("V")


class IdentityMemo:
    def __init__(self, limit: int | None = None):
        self._done: dict[tuple, tuple] = {}
        self._limit = limit             # entries kept at most (then it starts again)

    def get(self, obj: object, rest: Hashable, compute: Callable[[], V]) -> V:
        key = (id(obj), rest)
        hit = self._done.get(key)
        if hit is None:
            if self._limit is not None and len(self._done) >= self._limit:
                self._done.clear()
            hit = self._done[key] = (obj, compute())
        return hit[1]

    def __len__(self) -> int:
        return len(self._done)

    def clear(self) -> None:
        self._done.clear()
