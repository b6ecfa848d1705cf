"""Low-level helpers of the launcher: four-letter words, pid files, stopping a process by pid."""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import time
from pathlib import Path

from metaq._errors import LauncherError

__all__ = [
    "four_letter_word",
    "free_port",
    "is_zookeeper_process",
    "pid_alive",
    "read_pidfile",
    "server_mode",
    "stop_pid",
]

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def four_letter_word(host: str, port: int, word: str, timeout: float = 2.0) -> str:
    """Send a ZooKeeper four-letter word (``ruok``, ``srvr``, ``conf`` ...) and return the reply.

    Raises ``OSError`` when the server cannot be reached.
    """
    if len(word) != 4:
        raise ValueError(f"a four-letter word has four letters, got {word!r}")
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(word.encode("ascii"))
        s.shutdown(socket.SHUT_WR)
        chunks: list[bytes] = []
        while True:
            data = s.recv(65536)
            if not data:
                break
            chunks.append(data)
    return b"".join(chunks).decode("utf-8", "replace")


def server_mode(host: str, port: int, timeout: float = 2.0) -> str | None:
    """``standalone``/``leader``/``follower``/``observer`` from ``srvr``, or None if not serving."""
    try:
        reply = four_letter_word(host, port, "srvr", timeout)
    except OSError:
        return None
    for line in reply.splitlines():
        if line.startswith("Mode:"):
            return line.split(":", 1)[1].strip()
    return None


def read_pidfile(path: Path) -> int | None:
    """The pid in ``path``, or None when the file is missing or does not hold a pid."""
    try:
        text = path.read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return int(text) if text.isdigit() else None


def pid_alive(pid: int) -> bool:
    """True when ``pid`` names a live (not zombie) process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: trust kill(0)
    state = stat.rsplit(")", 1)[-1].split()[0]
    return state not in ("Z", "X")


def is_zookeeper_process(pid: int, config_path: Path) -> bool:
    """True when ``pid`` is alive and is a QuorumPeerMain started on ``config_path``.

    Guards against pid reuse: a stale pid file must never make us signal a stranger.
    """
    if not pid_alive(pid):
        return False
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return True  # no /proc to check against: trust the pid file
    args = [a.decode("utf-8", "replace") for a in argv if a]
    return any(a.endswith("QuorumPeerMain") for a in args) and str(config_path) in args


def _reap(pid: int) -> None:
    """Collect ``pid`` if it is our child (so it does not linger as a zombie)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    except OSError as e:  # pragma: no cover - defensive
        if e.errno != errno.ECHILD:
            raise


def stop_pid(pid: int, *, timeout: float = 10.0, kill_timeout: float = 5.0) -> bool:
    """SIGTERM ``pid``, wait up to ``timeout``, then SIGKILL and wait up to ``kill_timeout``.

    Returns True when the process was running and is now gone, False if it was not running.
    Raises :class:`LauncherError` when it survives SIGKILL.
    """
    if not pid_alive(pid):
        _reap(pid)
        return False
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, kill_timeout)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            _reap(pid)
            return True
        deadline = time.monotonic() + wait
        delay = 0.005
        while time.monotonic() < deadline:
            _reap(pid)
            if not pid_alive(pid):
                return True
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        log.warning("process %d did not exit %.1fs after %s", pid, wait, sig.name)
    raise LauncherError(f"process {pid} survived SIGKILL for {kill_timeout}s")
