"""amk/diskcache.py: atomic writes, and pickles read only from private files and folders."""
import os

import pytest

from amk.diskcache import read_pickle, write_pickle

posix_only = pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX owners and modes")


def test_a_pickle_in_a_private_folder_is_a_hit(tmp_path):
    path = tmp_path / "programs" / "k.pkl"
    write_pickle(path, {"a": (1, 2)})
    assert read_pickle(path) == {"a": (1, 2)}
    assert read_pickle(tmp_path / "programs" / "missing.pkl") is None


@posix_only
def test_new_cache_folders_are_private(tmp_path):
    write_pickle(tmp_path / "new" / "k.pkl", 1)
    assert (tmp_path / "new").stat().st_mode & 0o077 == 0


@posix_only
@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757, 0o1777])
def test_a_pickle_in_a_folder_others_can_write_is_a_miss(tmp_path, mode):
    d = tmp_path / "shared"
    write_pickle(d / "k.pkl", "planted")
    d.chmod(mode)
    assert read_pickle(d / "k.pkl") is None
    d.chmod(0o700)
    assert read_pickle(d / "k.pkl") == "planted"


@posix_only
def test_a_pickle_file_others_can_write_is_a_miss(tmp_path):
    write_pickle(tmp_path / "k.pkl", "x")
    (tmp_path / "k.pkl").chmod(0o666)
    assert read_pickle(tmp_path / "k.pkl") is None


@posix_only
def test_a_pickle_owned_by_another_user_is_a_miss(tmp_path, monkeypatch):
    write_pickle(tmp_path / "k.pkl", "x")
    monkeypatch.setattr(os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)
    assert read_pickle(tmp_path / "k.pkl") is None


def test_pickles_are_written_with_the_gc_paused_and_it_is_restored(tmp_path, monkeypatch):
    import gc
    import pickle as pk
    from amk import diskcache
    seen, real = [], pk.dumps

    def dumps(*a, **k):
        seen.append(gc.isenabled())
        return real(*a, **k)

    monkeypatch.setattr(diskcache.pickle, "dumps", dumps)
    assert gc.isenabled()
    diskcache.write_pickle(tmp_path / "x.pkl", {"a": 1})
    assert seen == [False] and gc.isenabled()
    assert diskcache.read_pickle(tmp_path / "x.pkl") == {"a": 1}
