"""`amk serve`: a warm server for `amk generate`, the way build tools keep a daemon. It keeps
torch imported and the models it has loaded (compiled steps and prefill chunks with them) in
memory, so a warm `amk generate` pays neither the imports nor the load; the console entry point
(amk_client/main.py) hands it the command line over a Unix socket in AMK's cache dir
(amk_client/protocol.py: the socket, the framing).

One request runs at a time (the models and sys.stdout are shared); others wait their turn with
heartbeats. The command runs exactly as in-process (amk.cli parses and runs it) with its stdout
and stderr sent to the client as they are written. The server exits after `idle_s` without a
request, or on `amk serve --stop`.
"""
from __future__ import annotations

import contextlib
import fcntl
import io
import os
import socket
import subprocess
import sys
import threading
import time
import traceback

from amk.errors import AmkError
from amk_client import protocol

MAX_MODELS = 4               # loaded models kept (the oldest goes first)


class _Pipe(io.TextIOBase):
    """A text stream whose every write is one frame to the client ({"out": ...} / {"err": ...})."""

    def __init__(self, conn, lock, stream: str, tty: bool):
        self.conn, self.lock, self.stream, self.tty = conn, lock, stream, tty

    def write(self, text: str) -> int:
        if text:
            with self.lock:
                protocol.send(self.conn, {self.stream: text})   # a gone client: BrokenPipeError
        return len(text)

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self.tty


class Server:
    def __init__(self, idle_s: float):
        self.idle_s = idle_s
        self.models: dict = {}               # amk.cli.cmd_generate's cache, by what selects a model
        self.run_lock = threading.Lock()     # one command at a time
        self.active = 0                      # connections being handled
        self.count_lock = threading.Lock()
        self.last = time.monotonic()
        self.stopping = threading.Event()
        self.env = {k: v for k, v in os.environ.items() if k.startswith("AMK_")}

    # ---- one connection -----------------------------------------------------------------------
    def handle(self, conn: socket.socket) -> None:
        send_lock = threading.Lock()
        done = threading.Event()

        def heartbeat():
            while not done.wait(protocol.HEARTBEAT_S):
                try:
                    with send_lock:
                        protocol.send(conn, {"alive": 1})
                except OSError:
                    return
        threading.Thread(target=heartbeat, daemon=True).start()
        try:
            conn.settimeout(protocol.REPLY_TIMEOUT_S)
            request = next(protocol.frames(conn))
            if request["op"] == "generate":
                self.generate(conn, send_lock, request)
            else:
                with send_lock:
                    protocol.send(conn, self.control(request["op"]))
                if request["op"] == "stop":
                    self.stopping.set()      # after the answer: the accept loop then returns
        except (OSError, ValueError, KeyError, StopIteration, protocol.ServeError):
            pass                             # the client went away or sent garbage: its loss
        finally:
            done.set()
            conn.close()
            with self.count_lock:
                self.active -= 1
                self.last = time.monotonic()

    def control(self, op: str) -> dict:
        if op == "stop":                     # a request running now is cut off (its client says so)
            return {"text": f"amk serve (pid {os.getpid()}) stopped"}
        models = ", ".join(f"{k[0]} (backend {k[1] or 'default'}, max_seq {k[2]}, {k[4]})"
                           for k in self.models) or "none yet"
        return {"text": f"amk serve (pid {os.getpid()}) on {protocol.socket_path()}; idle timeout "
                        f"{self.idle_s:.0f} s; models loaded: {models}"}

    def generate(self, conn, send_lock, request: dict) -> None:
        from amk import cli
        if request["env"] != self.env:
            with send_lock:
                protocol.send(conn, {"fallback": "the server runs with other AMK_* settings"})
            return
        with self.run_lock:
            with send_lock:
                protocol.send(conn, {"pid": os.getpid()})
            out, err = (_Pipe(conn, send_lock, s, request["tty"]) for s in ("out", "err"))
            rc = 1
            with _redirected(out, err, request["cwd"], request["columns"]):
                try:
                    args = cli._parser().parse_args(request["argv"])
                    if args.cmd != "generate" or args.no_serve:    # an abbreviated --no-serve
                        with send_lock:
                            protocol.send(conn, {"fallback": ""})
                        return
                    rc = cli.run(args, lambda a: cli.cmd_generate(a, self.models))
                except SystemExit as e:                # argparse: usage errors (2), --help (0)
                    rc = e.code if isinstance(e.code, int) else 1
                except BrokenPipeError:
                    return
                except Exception:                      # as in-process: the traceback, exit 1
                    traceback.print_exc(file=err)
                while len(self.models) > MAX_MODELS:
                    self.models.pop(next(iter(self.models)))      # the first loaded goes
            with send_lock:
                protocol.send(conn, {"exit": rc})

    # ---- the accept loop ----------------------------------------------------------------------
    def run(self, listener: socket.socket) -> None:
        listener.settimeout(0.5)
        while not self.stopping.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                with self.count_lock:
                    if self.active == 0 and time.monotonic() - self.last > self.idle_s:
                        return
                continue
            with self.count_lock:
                self.active += 1
            threading.Thread(target=self.handle, args=(conn,), daemon=True).start()


@contextlib.contextmanager
def _redirected(out, err, cwd: str, columns: int):
    """The request's stdout, stderr, working directory and terminal width, for one command."""
    from rich.console import Console
    from amk import cli
    saved = sys.stdout, sys.stderr, os.getcwd(), os.environ.get("COLUMNS"), cli.err
    sys.stdout, sys.stderr = out, err
    os.environ["COLUMNS"] = str(columns)    # argparse and rich wrap to the client's terminal
    try:
        os.chdir(cwd)                       # relative --model paths are the client's
        cli.err = Console(file=err, force_terminal=err.isatty(), width=columns)
        yield
    finally:
        sys.stdout, sys.stderr, _, cols, cli.err = saved
        os.chdir(saved[2])
        if cols is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = cols


def serve(idle_s: float) -> int:
    """Serve in the foreground until idle for idle_s seconds or stopped."""
    sock = protocol.socket_path()
    if len(str(sock).encode()) >= protocol._MAX_UNIX_PATH:
        raise AmkError(f"the socket path {sock} is too long for a Unix socket; "
                       f"set AMK_CACHE_DIR to a shorter folder")
    sock.parent.mkdir(parents=True, exist_ok=True)
    lock = os.open(protocol.lock_path(sock), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(lock)
        raise AmkError(f"a server already runs on {sock} (amk serve --status)") from None
    tmp = sock.with_name(f"{sock.name}.{os.getpid()}")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        tmp.unlink(missing_ok=True)
        listener.bind(str(tmp))
        listener.listen(16)
        os.replace(tmp, sock)               # clients only ever see a listening socket
        print(f"amk serve: pid {os.getpid()} listening on {sock} (idle timeout {idle_s:.0f} s)",
              file=sys.stderr, flush=True)
        Server(idle_s).run(listener)
    finally:
        listener.close()
        sock.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
        os.close(lock)
    print("amk serve: stopped", file=sys.stderr, flush=True)
    return 0


def start_background(idle_s: float, wait_s: float = 120.0) -> int:
    """Start `amk serve` detached (its log next to the socket); return once it answers."""
    running = protocol.call("status")
    if running is not None:
        print(running["text"])
        return 0
    sock = protocol.socket_path()
    sock.parent.mkdir(parents=True, exist_ok=True)
    log = sock.with_suffix(".log")
    with open(log, "ab") as f:
        proc = subprocess.Popen([sys.executable, "-m", "amk.cli", "serve", "--idle-timeout",
                                 str(idle_s)], stdin=subprocess.DEVNULL, stdout=f, stderr=f,
                                start_new_session=True)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AmkError(f"amk serve exited at start (code {proc.returncode}); see {log}")
        reply = protocol.call("status")
        if reply is not None:
            print(reply["text"])
            return 0
        time.sleep(0.2)
    raise AmkError(f"amk serve (pid {proc.pid}) did not answer in {wait_s:.0f} s; see {log}")
