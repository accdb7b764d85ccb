"""The tiny Llama program through every pass, and its lowered stage's results: shared by the
per-pass tests (computed once per test process)."""
import pytest

from pass_helpers import bindings, llama_program, run, run_passes


@pytest.fixture(scope="session")
def stages():
    return run_passes(llama_program())


@pytest.fixture(scope="session")
def reference(stages):
    b = bindings(stages["lower"])
    return b, run(stages["lower"], b)
