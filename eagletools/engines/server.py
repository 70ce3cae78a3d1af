"""An engine's server process: started on 127.0.0.1, health-checked, always stopped.

The server runs in its own process session, so stopping it signals the whole
group (vLLM forks an engine core; llama-server may spawn nothing, but the
rule costs nothing). SIGTERM first, SIGKILL after a grace period. The caller's
SIGTERM becomes SystemExit while a server is up, so `finally` runs on a kill
as on Ctrl-C, and no engine outlives the command that started it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from eagletools.errors import UserError

HOST = "127.0.0.1"


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port(preferred: int | None = None) -> int:
    """`preferred` if nothing listens there, else a port the kernel hands out."""
    if preferred and port_is_free(preferred):
        return preferred
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 20) -> str:
    if not path.is_file():
        return "(no log)"
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:]) or "(empty log)"


def request(url: str, payload: dict | None = None, timeout: float = 600.0) -> bytes:
    """GET (no payload) or POST JSON; the body of a 200 reply, else an error naming the URL."""
    data = json.dumps(payload).encode() if payload is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as reply:
            return reply.read()
    except urllib.error.HTTPError as err:
        body = err.read().decode(errors="replace")[:500]
        raise UserError(f"{url} answered HTTP {err.code}: {body}") from err


@dataclass
class Server:
    name: str
    url: str  # http://127.0.0.1:PORT
    process: subprocess.Popen
    log: Path


def _wait_ready(server: Server, health: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise UserError(
                f"{server.name} exited with status {server.process.returncode} before it was "
                f"ready; its last log lines ({server.log}):\n{log_tail(server.log)}"
            )
        with contextlib.suppress(OSError, UserError):
            request(server.url + health, timeout=5)
            return
        time.sleep(1.0)
    raise UserError(
        f"{server.name} was not ready after {timeout:.0f} s (raise --engine-timeout if the "
        f"machine is busy); its last log lines ({server.log}):\n{log_tail(server.log)}"
    )


def stop(process: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM to the server's process group, SIGKILL whatever is left after `grace`."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace)
    # children that outlived their parent are still in the group
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(5)


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def serve(
    name: str,
    argv: list[str],
    port: int,
    log: Path,
    health: str = "/health",
    timeout: float = 600.0,
    env: dict[str, str] | None = None,
) -> Iterator[Server]:
    """Start `argv` (which must listen on HOST:port), wait for `health`, stop it on exit."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with _sigterm_exits(), open(log, "w") as out:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        server = Server(name, f"http://{HOST}:{port}", process, log)
        try:
            _wait_ready(server, health, timeout)
            yield server
        finally:
            stop(process)
