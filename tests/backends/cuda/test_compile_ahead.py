"""A compile started ahead (NVRTC on a background thread, started before the final proof of the
passes) is the compile that compile_source hands back; its errors surface there; a program
whose proof fails is still refused; only a step that will run on a GPU compiles ahead."""
from dataclasses import replace

import pytest
import torch

import amk
from amk.backends.cuda import CudaOptions, compile as cuda_compile, lowered_cache, render
from amk.backends.cuda.compile import cache_key, compile_source, start_compile
from amk.errors import CompileError, ValidationError
from amk.models.model import Model
from amk.models.presets import TINY_LLAMA, random_params
from amk.passes import pipeline
from amk.passes.options import PassOptions
from amk.testing import cuda_examples as examples


@pytest.fixture(scope="module")
def source():
    return render(examples.combined_program(examples.cases()[:3]), CudaOptions())


def _in_flight(src, opts):
    key = cache_key(src, "sm_90a", cuda_compile._nvrtc_options(None, opts), opts)
    return key in cuda_compile._IN_FLIGHT


def test_compile_source_returns_the_compile_started_ahead(source):
    opts = CudaOptions()                    # no disk cache: the future is the only copy
    start_compile(source, "sm_90a", opts)
    assert _in_flight(source, opts)
    got = compile_source(source, "sm_90a", cuda_options=opts)
    assert not _in_flight(source, opts) and not got.cache_hit and got.seconds > 0
    assert got.cubin == compile_source(source, "sm_90a", use_cache=False, cuda_options=opts).cubin


def test_a_compile_started_ahead_fills_the_disk_cache(source, tmp_path):
    opts = CudaOptions(cache_dir=tmp_path)
    start_compile(source, "sm_90a", opts)
    first = compile_source(source, "sm_90a", cuda_options=opts)
    assert not first.cache_hit and len(list((tmp_path / "cuda").glob("*.cubin"))) == 1
    start_compile(source, "sm_90a", opts)   # cached now: nothing starts
    assert not _in_flight(source, opts)
    again = compile_source(source, "sm_90a", cuda_options=opts)
    assert again.cache_hit and again.cubin == first.cubin


def test_the_error_of_a_compile_started_ahead_is_raised_where_it_is_waited_for():
    bad = "__global__ void amk_megakernel() { this is not C++; }\n"
    start_compile(bad, "sm_90a", CudaOptions())
    with pytest.raises(CompileError, match="NVRTC could not compile"):
        compile_source(bad, "sm_90a", cuda_options=CudaOptions())
    assert not _in_flight(bad, CudaOptions())


def _tiny():
    cfg = replace(TINY_LLAMA, n_layers=2)
    model = Model(cfg, random_params(cfg, device="meta"))
    return amk.jit(model.fn, backend="cuda", donate=("kv",)), model.example_args(1)


def test_ahead_sees_the_final_program_and_a_failed_proof_still_refuses_it(monkeypatch):
    step, args = _tiny()
    graph = step.lower(*args).graph
    opts = PassOptions.for_backend("cuda")
    seen = []
    stages = pipeline.run_pipeline(graph, opts, ahead=seen.append)
    assert len(seen) == 1 and seen[0] is stages[pipeline.PIPELINE[-1][0]]

    name, last = pipeline.PIPELINE[-1]

    def drops_a_wait(program, o):               # a race: the first waiting task waits no more
        p = last(program, o)
        t = next(t for t in p.tasks if t.waits)
        tasks = tuple(replace(x, waits=()) if x is t else x for x in p.tasks)
        return p.with_(tasks=tasks)

    monkeypatch.setattr(pipeline, "PIPELINE", pipeline.PIPELINE[:-1] + [(name, drops_a_wait)])
    seen.clear()
    with pytest.raises(ValidationError, match="invalid"):
        pipeline.run_pipeline(graph, opts, ahead=seen.append)
    assert len(seen) == 1          # the compile started; the program is refused all the same


def test_only_a_step_on_a_gpu_compiles_ahead():
    step, _ = _tiny()
    opts = PassOptions.for_backend("cuda")
    assert step._compile_ahead("cuda", torch.device("cpu"), opts) is None
    assert step._compile_ahead("cuda", torch.device("meta"), opts) is None
    assert step._compile_ahead("reference", torch.device("cuda"), opts) is None
    ahead = step._compile_ahead("cuda", torch.device("cuda"), opts)
    assert ahead.func is cuda_compile.start_program
    assert ahead.keywords["n_ctas"] == opts.target.num_sms
    if not torch.cuda.is_available():
        assert ahead.keywords["arch"] == "sm_90a"


def test_start_program_lowers_once_for_the_runtime(monkeypatch):
    step, args = _tiny()
    program = step.lower(*args).program
    opts = CudaOptions()
    started = []
    monkeypatch.setattr(cuda_compile, "start_compile", lambda src, arch, o: started.append(src))
    cuda_compile.start_program(program, 132, "sm_90a", opts)
    low = lowered_cache.lower_program_cached(program, 132, opts)
    assert lowered_cache.lower_program_cached(program, 132, opts) is low   # the memo, not a copy
    assert lowered_cache.lower_program_cached(program, 66, opts) is not low
    assert started == [render(program, opts)]


def test_a_process_that_ends_while_a_compile_runs_ahead_exits_cleanly(source):
    """A script that lowers for a GPU and ends (or a refused program's process) leaves NVRTC
    running: the process waits for it at exit. The thread is not a daemon: a daemon inside
    NVRTC during interpreter shutdown crashed the process (SIGSEGV or SIGABRT, about one exit
    in four of this script)."""
    import subprocess
    import sys
    import threading
    from pathlib import Path
    start_compile(source, "sm_90a", CudaOptions(lineinfo=True))      # a key no other test uses
    running = [t for t in threading.enumerate() if t.name == "amk-nvrtc"]
    assert running and not any(t.daemon for t in running)
    compile_source(source, "sm_90a", cuda_options=CudaOptions(lineinfo=True))
    code = ("import torch\n"
            "import amk\n"
            "from amk.models.model import Model\n"
            "from amk.models.presets import TINY_LLAMA, random_params\n"
            "m = Model(TINY_LLAMA, random_params(TINY_LLAMA, device='meta'))\n"
            "step = amk.jit(m.fn, backend='cuda', donate=('kv',))\n"
            "gpu = torch.device('cuda')       # as a step on a GPU: NVRTC starts ahead\n"
            "step._compile_ahead = lambda b, d, o: type(step)._compile_ahead(step, b, gpu, o)\n"
            "step.lower(*m.example_args(1))\n")
    root = Path(__file__).resolve().parents[3]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_a_fork_waits_for_the_compile_in_flight_and_the_child_gets_it(source):
    """A process forked while a compile runs ahead has no thread to finish it, and NVRTC is not
    fork-safe (a child that compiled again hung in NVRTC): the fork waits for the compile, and
    the child's compile_source of the same source returns the finished one."""
    import os
    import time
    opts = CudaOptions(spin_ns=64)                       # a key no other test uses
    start_compile(source, "sm_90a", opts)
    time.sleep(0.1)                                       # NVRTC under way in the thread
    pid = os.fork()
    if pid == 0:                                          # the child
        code = 1
        try:
            key = cache_key(source, "sm_90a", cuda_compile._nvrtc_options(None, opts), opts)
            inherited = cuda_compile._IN_FLIGHT.get(key)  # finished before the fork
            got = compile_source(source, "sm_90a", cuda_options=opts)
            code = 0 if inherited is not None and inherited.done() and got.cubin[:4] == b"\x7fELF" else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung in its compile")
    assert os.waitstatus_to_exitcode(status) == 0
    assert compile_source(source, "sm_90a", cuda_options=opts).cubin[:4] == b"\x7fELF"
