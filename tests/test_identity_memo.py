"""amk/identity_memo.py: one computation per (object, rest); equal but distinct objects do not
share an entry; the limit starts the memo again."""
from amk.identity_memo import IdentityMemo


def test_computes_once_per_object_and_rest_and_tells_equal_objects_apart():
    memo, calls = IdentityMemo(), []

    def f(tag):
        calls.append(tag)
        return tag

    a, b = [1, 2], [1, 2]                       # equal, not the same object
    assert memo.get(a, "x", lambda: f("a-x")) == "a-x"
    assert memo.get(a, "x", lambda: f("again")) == "a-x"
    assert memo.get(a, "y", lambda: f("a-y")) == "a-y"
    assert memo.get(b, "x", lambda: f("b-x")) == "b-x"
    assert calls == ["a-x", "a-y", "b-x"]


def test_a_limit_starts_again_and_clear_forgets():
    memo, calls = IdentityMemo(limit=2), []
    objs = [object() for _ in range(3)]
    for o in objs:
        memo.get(o, 0, lambda: calls.append(1))
    memo.get(objs[0], 0, lambda: calls.append(1))   # dropped when the third came in
    assert len(calls) == 4
    memo.clear()
    memo.get(objs[2], 0, lambda: calls.append(1))
    assert len(calls) == 5
