"""The disk cache of pipeline results: a warm compile skips the passes and returns the same
program; anything that changes the result (options, a patched pass) misses."""

import amk
from amk.models.presets import TINY_LLAMA, random_model
from amk.passes import pipeline
from amk.passes.options import PassOptions


def lower(m, opts):
    return amk.jit(m.fn, donate=("kv",), options=opts).lower(*m.example_args())


def test_warm_compile_hits_the_cache_and_returns_the_same_program(tmp_path, monkeypatch):
    monkeypatch.setenv("AMK_CACHE_DIR", str(tmp_path))
    m = random_model(TINY_LLAMA)
    cold = lower(m, PassOptions.for_backend("reference"))
    warm = lower(m, PassOptions.for_backend("reference"))
    assert not cold.timings["cache_hit"] and warm.timings["cache_hit"]
    assert warm.program == cold.program
    assert amk.validate(warm.program).ok
    assert list(warm.programs) == [name for name, _ in pipeline.PIPELINE]   # recomputed on demand
    assert warm.programs["place"] == cold.program
    # other options: another program, another key
    other = lower(m, PassOptions.for_backend("reference").with_(fuse=False))
    assert not other.timings["cache_hit"] and other.program != cold.program


def test_a_patched_pass_is_a_cache_miss(tmp_path, monkeypatch):
    monkeypatch.setenv("AMK_CACHE_DIR", str(tmp_path))
    m = random_model(TINY_LLAMA)
    lower(m, None)
    name, place = pipeline.PIPELINE[-1]

    def place_reversed(program, opts):          # a different (still valid) placement
        p = place(program, opts)
        return p.with_(queues=tuple(reversed(p.queues)))

    monkeypatch.setattr(pipeline, "PIPELINE", [*pipeline.PIPELINE[:-1], (name, place_reversed)])
    low = lower(m, None)
    assert not low.timings["cache_hit"]


def test_a_corrupt_cache_file_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("AMK_CACHE_DIR", str(tmp_path))
    m = random_model(TINY_LLAMA)
    lower(m, None)
    (f,) = (tmp_path / "programs").glob("*.pkl")
    f.write_bytes(b"not a pickle")
    low = lower(m, None)
    assert not low.timings["cache_hit"] and amk.validate(low.program).ok


def test_a_cache_folder_other_users_can_write_is_never_unpickled(tmp_path, monkeypatch):
    monkeypatch.setenv("AMK_CACHE_DIR", str(tmp_path))
    m = random_model(TINY_LLAMA)
    lower(m, None)
    (tmp_path / "programs").chmod(0o777)           # anyone could have planted the pickle
    assert not lower(m, None).timings["cache_hit"]
    (tmp_path / "programs").chmod(0o700)
    assert lower(m, None).timings["cache_hit"]


def test_the_cached_program_keeps_its_typed_recipes(tmp_path, monkeypatch):
    from amk.program.ir import InstructionKind as K
    from amk.program.recipe import Recipe
    monkeypatch.setenv("AMK_CACHE_DIR", str(tmp_path))
    m = random_model(TINY_LLAMA)
    cold = lower(m, None)
    warm = lower(m, None)
    fused = [t for t in warm.program.tasks if t.op is K.FUSED]
    assert warm.timings["cache_hit"] and fused
    assert all(isinstance(t.params["recipe"], Recipe) for t in fused)
    assert warm.program == cold.program


def test_cold_and_warm_programs_share_the_pass_cache_digest(tmp_path, monkeypatch):
    # the cuda lowered cache keys on program_digest: from the pass cache's key, never a repr
    from amk.program.digest import program_digest
    monkeypatch.setenv("AMK_CACHE_DIR", str(tmp_path))
    m = random_model(TINY_LLAMA)
    cold, warm = lower(m, None), lower(m, None)
    assert warm.timings["cache_hit"]
    assert program_digest(cold.program) == program_digest(warm.program)
    assert program_digest(cold.program).startswith("passes:")
    other = lower(m, PassOptions.for_backend("reference").with_(fuse=False))
    assert program_digest(other.program) != program_digest(cold.program)


def test_a_program_built_elsewhere_is_digested_by_its_content(tmp_path, monkeypatch):
    import pickle
    from amk.program.digest import program_digest
    monkeypatch.setenv("AMK_CACHE_DIR", str(tmp_path))
    p = lower(random_model(TINY_LLAMA), None).program
    a, b = pickle.loads(pickle.dumps(p)), pickle.loads(pickle.dumps(p))     # not the passes'
    assert program_digest(a).startswith("repr:") and program_digest(a) == program_digest(b)
    assert program_digest(a.with_(name="other")) != program_digest(a)


def test_fused_recipes_share_their_operands():
    # one Operand object per (kind, index): a pickled program holds each once
    from amk.program.recipe import Recipe
    p = lower(random_model(TINY_LLAMA), None).program
    ops = [a for t in p.tasks if isinstance(t.params.get("recipe"), Recipe)
           for s in t.params["recipe"].steps for a in (*s.args, s.out)]
    assert ops and len({id(a) for a in ops}) == len(set(ops))
