"""`amk serve`'s socket: where it lives, how a request and its replies are framed, and the small
status / stop calls. Stdlib only (see amk_client/__init__.py).

One JSON object a line, each way. The client sends one request ({"op": "generate", "argv": ...,
"cwd": ..., "env": ..., "tty": ..., "columns": ...}, or {"op": "status"} / {"op": "stop"}); the
server answers {"pid": N}, then {"out": text} / {"err": text} as the command writes them,
{"alive": 1} every HEARTBEAT_S while it works (so a silent compile is not a dead server), and
last {"exit": code} -- or {"fallback": why} when the client must run the command itself.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import socket
from pathlib import Path

HEARTBEAT_S = 1.0
REPLY_TIMEOUT_S = 30.0       # no frame, not even a heartbeat, for this long: the server is stuck
CONNECT_TIMEOUT_S = 2.0
_MAX_UNIX_PATH = 104         # sun_path is 108 bytes on Linux, 104 on macOS


class ServeError(Exception):
    """The server is unusable or went away mid-request (the client prints it and exits 1)."""


def cache_dir() -> Path:
    """amk.knobs.cache_dir(), read here because importing amk.knobs imports torch (and the
    package may be installed without this one's path: amk never imports amk_client to run)."""
    v = os.environ.get("AMK_CACHE_DIR", "")
    return Path(v) if v else Path.home() / ".cache" / "amk"


def _amk_dir() -> Path:
    """The amk package's folder, found without importing it (importing it imports torch)."""
    spec = importlib.util.find_spec("amk")
    if spec is None or not spec.submodule_search_locations:
        raise ServeError("the amk package is not importable")
    return Path(list(spec.submodule_search_locations)[0]).resolve()


def _version(amk_dir: Path) -> str:
    spec = importlib.util.spec_from_file_location("_amk_version", amk_dir / "version.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)              # amk/version.py imports nothing
    return mod.VERSION


def socket_path() -> Path:
    """One socket per AMK version and per checkout (two worktrees never share a server)."""
    amk_dir = _amk_dir()
    where = hashlib.sha1(str(amk_dir).encode()).hexdigest()[:8]
    return cache_dir() / f"serve-{_version(amk_dir)}-{where}.sock"


def lock_path(sock: Path) -> Path:
    """Held (flock) by the live server for its whole life: who gets it knows none is running."""
    return sock.with_suffix(".lock")


def send(conn: socket.socket, obj: dict) -> None:
    conn.sendall((json.dumps(obj) + "\n").encode())


def frames(conn: socket.socket):
    """The JSON objects the other side sends, one a line, until it closes the connection."""
    buf = b""
    while True:
        chunk = conn.recv(65536)
        if not chunk:
            if buf.strip():
                raise ServeError("amk serve: the connection ended inside a reply")
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield json.loads(line)


def clean_dead(sock: Path) -> bool:
    """Remove a socket file no server listens on (a server killed with -9 leaves one). True if
    it removed one. Only with the server's lock in hand: a server starting now is never hit."""
    lock = lock_path(sock)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False                          # a server holds it: starting, or busy
    try:
        sock.unlink(missing_ok=True)
        return True
    finally:
        os.close(fd)                          # releases the lock


def connect() -> socket.socket | None:
    """A connection to the live server of this version and checkout, or None (dead socket files
    are cleaned on the way)."""
    try:
        sock = socket_path()
    except ServeError:
        return None
    if len(str(sock).encode()) >= _MAX_UNIX_PATH or not sock.exists():
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(CONNECT_TIMEOUT_S)
    try:
        conn.connect(str(sock))
    except (ConnectionRefusedError, FileNotFoundError):
        conn.close()
        clean_dead(sock)
        return None
    except OSError:
        conn.close()
        return None
    conn.settimeout(REPLY_TIMEOUT_S)
    return conn


def call(op: str) -> dict | None:
    """{"op": "status"} or {"op": "stop"}: the server's one-frame answer, None if none runs."""
    conn = connect()
    if conn is None:
        return None
    with conn:
        send(conn, {"op": op})
        try:
            for frame in frames(conn):
                if "alive" not in frame:
                    return frame
        except (OSError, ValueError) as e:
            raise ServeError(f"amk serve did not answer {op!r}: {e}") from None
    raise ServeError(f"amk serve closed the connection without answering {op!r}")
