"""A warm `amk generate` through `amk serve` against in-process: wall seconds to the first
generated character on stdout and to the end, and CPU seconds of the client and (served) of the
server, for the same command. Starts its own server on AMK_CACHE_DIR (one warm-up request
first), stops it at the end. Run it once before to fill the cache (GGUF folder, programs).

    python bench/serve_start.py                     # smollm2-135m, "Hello", 4 tokens, 3 runs each
    python bench/serve_start.py --backend cuda --runs 5
"""
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from gpu_tool import parser  # noqa: E402

from amk_client import protocol  # noqa: E402


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime


def timed(argv: list[str], prompt: str, server_pid: int | None) -> dict:
    """One `amk ARGV` (the console script's path): wall to the first character after the
    prompt, wall to the end, the client's CPU, the server's CPU."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    s0 = _cpu_s(server_pid) if server_pid else 0.0
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "amk_client", *argv], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    got = proc.stdout.read(len(prompt.encode()) + 1)           # the prompt, then one more byte
    first = time.perf_counter() - t0
    rest, err = proc.communicate()
    total = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"amk {' '.join(argv)} failed:\n{err.decode()}")
    return {"first_token_wall_s": first, "total_wall_s": total,
            "client_cpu_s": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
            "server_cpu_s": (_cpu_s(server_pid) - s0) if server_pid else 0.0,
            "text": (got + rest).decode()}


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt", default="Hello")
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--backend", choices=["reference", "cuda", "triton"], default=None)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default="bench/serve_start.json")
    a = ap.parse_args(argv)
    gen = ["generate", "--model", a.model, "--prompt", a.prompt, "--max-new-tokens",
           str(a.max_new_tokens), "--ignore-eos"] + (["--backend", a.backend] if a.backend else [])
    if protocol.call("status") is not None:
        raise SystemExit("an amk serve already runs here: stop it first (amk serve --stop)")
    server = subprocess.Popen([sys.executable, "-m", "amk.cli", "serve"], env=_env(),
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        while protocol.call("status") is None:
            time.sleep(0.2)
        timed(gen, a.prompt, server.pid)                        # loads and compiles: not timed
        rows = {"served": [timed(gen, a.prompt, server.pid) for _ in range(a.runs)],
                "in-process": [timed(gen + ["--no-serve"], a.prompt, None) for _ in range(a.runs)]}
    finally:
        protocol.call("stop")
        server.wait(timeout=60)
    texts = {r["text"] for rs in rows.values() for r in rs}
    print(f"{'path':<11} {'first token wall s':>19} {'total wall s':>13} {'client cpu s':>13} "
          f"{'server cpu s':>13}   (median of {a.runs})")
    for name, rs in rows.items():
        med = {k: sorted(r[k] for r in rs)[len(rs) // 2] for k in rs[0] if k != "text"}
        print(f"{name:<11} {med['first_token_wall_s']:19.2f} {med['total_wall_s']:13.2f} "
              f"{med['client_cpu_s']:13.2f} {med['server_cpu_s']:13.2f}")
    print(f"same text on every run: {len(texts) == 1} {sorted(texts)!r}")
    Path(a.json).write_text(json.dumps({"command": gen, "runs": rows}, indent=1))
    return 0 if len(texts) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
