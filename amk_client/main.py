"""The `amk` console entry point. `amk generate` goes to a running `amk serve` (torch and the
models already in memory there) when there is one, streaming its stdout and stderr here as they
arrive; otherwise, or under --no-serve, every command runs in-process through amk.cli.
`amk serve --status` / `--stop` are answered here too, without importing torch."""
from __future__ import annotations

import os
import shutil
import sys

from amk_client import protocol


def served(argv: list[str]) -> int | None:
    """Run `amk generate ARGV...` on the server: its exit code, or None to run it in-process."""
    conn = protocol.connect()
    if conn is None:
        return None
    tty = sys.stderr.isatty()
    request = {"op": "generate", "argv": argv, "cwd": os.getcwd(), "tty": tty,
               "columns": shutil.get_terminal_size().columns,
               "env": {k: v for k, v in os.environ.items() if k.startswith("AMK_")}}
    with conn:
        try:
            protocol.send(conn, request)
            for frame in protocol.frames(conn):
                if "out" in frame:
                    sys.stdout.write(frame["out"])
                    sys.stdout.flush()
                elif "err" in frame:
                    sys.stderr.write(frame["err"])
                    sys.stderr.flush()
                elif "pid" in frame:
                    print(f"(served by amk serve, pid {frame['pid']})", file=sys.stderr, flush=True)
                elif "fallback" in frame:
                    if frame["fallback"]:
                        print(f"(amk serve: {frame['fallback']}; running in-process)",
                              file=sys.stderr, flush=True)
                    return None
                elif "exit" in frame:
                    return int(frame["exit"])
        except TimeoutError:
            why = f"sent nothing for {protocol.REPLY_TIMEOUT_S:.0f} s (stuck?)"
        except (OSError, ValueError, protocol.ServeError) as e:
            why = f"failed ({e})"
        else:
            why = "closed the connection mid-request (did it die?)"
    print(f"amk generate: the amk serve server {why}; `amk generate --no-serve` runs in-process",
          file=sys.stderr, flush=True)
    return 1


def serve_control(flag: str) -> int:
    """`amk serve --status` / `--stop`, answered without torch."""
    try:
        reply = protocol.call("status" if flag == "--status" else "stop")
    except protocol.ServeError as e:
        print(f"amk serve: {e}", file=sys.stderr)
        return 1
    if reply is None:
        print("amk serve: no server running", file=sys.stderr)
        return 1 if flag == "--status" else 0
    print(reply.get("text", ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["generate"] and "--no-serve" not in argv:
        rc = served(argv)
        if rc is not None:
            return rc
    if argv[:1] == ["serve"] and argv[1:] in (["--status"], ["--stop"]):
        return serve_control(argv[1])
    from amk.cli import main as in_process
    return in_process(argv)
