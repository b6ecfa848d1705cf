"""Broker processes for integration tests: start, wait until registered, kill, restart.

::

    from helpers.procs import start_broker   # tests/ is on sys.path (pyproject pythonpath)

    with start_broker(zk_connect, 0, tmp_path / "b0", {"orders": 4}) as broker:
        ...                     # `metaq broker start` runs, registered in ZooKeeper
        broker.kill()           # SIGKILL; its ephemeral nodes go when its session ends
        broker.restart()        # same id, port, data dir and flags (after a kill, waits
                                # for the old session's nodes to expire first)
    # stopped (SIGTERM, then SIGKILL) on exit

Each broker is a real ``python -m metaq broker start`` subprocess on a port
picked with :func:`metaq.testing.free_port` (kept across restarts, so clients
can reconnect to the same address), with a short ZooKeeper session timeout
(``zk_session_timeout``, 4 s, written to ``<data_dir>.toml``) so that a killed
broker's registration expires quickly.  Its stdout and stderr go to
``<data_dir>.log``; :meth:`BrokerProc.log_tail` shows the end in assertion
messages.  Every wait has a deadline (:func:`metaq.testing.wait_until`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from metaq._errors import BrokerError
from metaq.net import BrokerConnection
from metaq.protocol import RawMessage, iter_messages
from metaq.testing import free_port, wait_until
from zk_layout import Layout, decode_broker_uri, decode_topic_broker

__all__ = ["BrokerProc", "read_partition", "start_broker", "stop_all", "stop_process"]

_STARTUP_TIMEOUT = 30.0


def stop_process(proc: subprocess.Popen | None, timeout: float = 15.0) -> int | None:
    """SIGTERM, then SIGKILL after ``timeout``: the exit status (None: never started)."""
    if proc is None or proc.poll() is not None:
        return None if proc is None else proc.returncode
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(30)


class MemberProc:
    """A consumer member script run as a process (``helpers/consumer_script.py``, the
    asyncio one in ``tests/aio``) that prints ``done <partition> <offset> <body>`` per
    message its handler finished; :meth:`done` parses them, :meth:`kill` is SIGKILL."""

    def __init__(self, script: str, *args: str) -> None:
        self.lines: list[str] = []
        self.p = subprocess.Popen([sys.executable, script, *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        self.t = threading.Thread(target=self._read, name="test-member-output", daemon=True)
        self.t.start()

    def _read(self) -> None:
        for raw in self.p.stdout:
            self.lines.append(raw.decode().rstrip("\n"))

    def done(self) -> list[tuple[str, int, str]]:
        out = []
        for line in list(self.lines):
            if line.startswith("done "):
                _, part, off, body = line.split(" ", 3)
                out.append((part, int(off), body))
        return out

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGKILL)
        self.p.wait(30)
        self.t.join(10)

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM: the member closes (commits what finished) and exits; one still
        running after ``timeout`` is killed (never left behind) and the test fails."""
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"member {self.p.args[2:]} did not exit within "
                                     f"{timeout:g} s of SIGTERM; killed") from None
        self.t.join(10)


class BrokerProc:
    """One ``metaq broker start`` subprocess (see the module doc)."""

    def __init__(self, zk_connect: str, broker_id: int, data_dir: str | os.PathLike,
                 topics: Mapping[str, int], *, port: int | None = None,
                 group_commit: bool = False, unflush_threshold: int | None = None,
                 zk_root: str = "/meta", zk_session_timeout: float = 4.0,
                 extra_args: Iterable[str] = ()) -> None:
        self.zk_connect = zk_connect
        self.broker_id = broker_id
        self.data_dir = Path(data_dir)
        self.topics = dict(topics)
        self.port = port or free_port()
        self._port_picked = port is None  # ours to change if another process takes it
        self.zk_root = zk_root
        self.layout = Layout(zk_root)
        self.log_path = self.data_dir.with_name(self.data_dir.name + ".log")
        self.zk_session_timeout = zk_session_timeout
        self.config_path = self.data_dir.with_name(self.data_dir.name + ".toml")
        args = [sys.executable, "-m", "metaq", "broker", "start",
                "--config", str(self.config_path), "--zk", zk_connect, "--zk-root", zk_root,
                "--id", str(broker_id),
                "--host", "127.0.0.1", "--port", str(self.port),
                "--data-dir", str(self.data_dir)]
        for name, n in self.topics.items():
            args += ["--topic", f"{name}:{n}"]
        if group_commit:
            args.append("--group-commit")
        if unflush_threshold is not None:
            args += ["--unflush-threshold", str(unflush_threshold)]
        args += list(extra_args)
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._killed = False

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, *, wait: bool = True, timeout: float = _STARTUP_TIMEOUT) -> BrokerProc:
        """Spawn the process; with ``wait``, return once it serves and is registered."""
        if self.alive:
            raise RuntimeError(f"broker {self.broker_id} is already running")
        if self._killed:
            # A killed broker's ephemeral nodes live until its session expires; a new
            # process with the same id refuses to start while they are there.
            self.wait_unregistered(timeout=self.zk_session_timeout + timeout)
            self._killed = False
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(f"zk_session_timeout = {float(self.zk_session_timeout)}\n")
        for _attempt in range(5):
            self._spawn()
            if not wait:
                return self
            if not (self.starts == 1 and self._port_picked and self._lost_the_port()):
                break
            # Another process took the port between free_port() and the broker's bind
            # (parallel test runs): a first start may move; a restart keeps its address.
            self.port = free_port()
            self.args[self.args.index("--port") + 1] = str(self.port)
            self.starts = 0
        self.wait_serving(timeout)
        self.wait_registered(timeout)
        return self

    def _lost_the_port(self) -> bool:
        """Wait until the process serves or exits; True when it exited because its port
        was in use."""
        assert self.proc is not None
        def settled() -> bool:
            return self.proc.poll() is not None or b"serving on" in self._log_since_mark()
        wait_until(settled, _STARTUP_TIMEOUT, 0.02,
                   what=f"broker {self.broker_id} to serve or exit (log {self.log_path})")
        return (self.proc.poll() is not None
                and b"address already in use" in self._log_since_mark())

    def _log_since_mark(self) -> bytes:
        with open(self.log_path, "rb") as f:
            f.seek(self._log_mark)
            return f.read()

    def _spawn(self) -> None:
        self.starts += 1
        with open(self.log_path, "ab") as logf:
            logf.write(f"\n=== start #{self.starts}: {' '.join(self.args)}\n".encode())
            logf.flush()
            self._log_mark = logf.tell()
            self.proc = subprocess.Popen(self.args, stdout=logf, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)

    def restart(self, *, timeout: float = _STARTUP_TIMEOUT) -> BrokerProc:
        """Start again after :meth:`kill` or :meth:`stop` (same id, port, data, flags)."""
        if self.alive:
            self.stop()
        return self.start(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL, as a crash: no flush, no unregistration."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
            self._killed = True

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (the broker unregisters and fsyncs), SIGKILL after ``timeout``."""
        return stop_process(self.proc, timeout)

    def pause(self) -> None:
        """SIGSTOP: the process stays connected but answers nothing."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def __enter__(self) -> BrokerProc:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.stop()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    # -- waiting ---------------------------------------------------------------------------

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text("utf-8", "replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def _serving(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"broker {self.broker_id} exited with {self.proc.returncode} "
                                 f"while starting:\n{self.log_tail()}")
        return b"serving on" in self._log_since_mark()

    def wait_serving(self, timeout: float = _STARTUP_TIMEOUT) -> None:
        """Wait for the broker's ``serving on host:port`` line."""
        wait_until(self._serving, timeout, 0.02,
                   what=f"broker {self.broker_id} to print 'serving on' "
                        f"(log {self.log_path})")

    def registered(self, client: KazooClient) -> bool:
        """True when ZooKeeper has this process's master node and every topic's
        ``topics-pub`` node with the right partition count; for a replica (a broker
        given ``--slave-of``), its ``slave<N>`` node or the master node."""
        layout = self.layout
        role = self._our_node(client)
        if role is None:
            return False
        if role != "master":
            return True
        try:
            for topic, n in self.topics.items():
                data, _ = client.get(layout.topic_pub(topic, self.broker_id))
                if decode_topic_broker(data).num_parts != n:
                    return False
        except NoNodeError:
            return False
        return True

    def _our_node(self, client: KazooClient) -> str | None:
        """The child of ``ids/<id>`` holding this process's address (``master``,
        ``slave<N>``), or None."""
        base = self.layout.broker_id(self.broker_id)
        try:
            children = client.get_children(base)
        except NoNodeError:
            return None
        for name in sorted(children):
            if name != "master" and not name.startswith("slave"):
                continue
            try:
                data, _ = client.get(f"{base}/{name}")
                if decode_broker_uri(data).port == self.port:
                    return name
            except (NoNodeError, ValueError):
                continue
        return None

    def wait_registered(self, timeout: float = _STARTUP_TIMEOUT) -> None:
        with _kazoo(self.zk_connect) as client:
            wait_until(lambda: self._alive_or_fail() and self.registered(client), timeout, 0.02,
                       what=f"broker {self.broker_id} to register in ZooKeeper")

    def wait_unregistered(self, timeout: float = _STARTUP_TIMEOUT) -> None:
        """Wait until no node of its broker id holds its address (after kill: when its
        session expires)."""
        with _kazoo(self.zk_connect) as client:
            wait_until(lambda: self._our_node(client) is None, timeout, 0.02,
                       what=f"broker {self.broker_id}'s node (port {self.port}) to go away")

    def _alive_or_fail(self) -> bool:
        if not self.alive:
            code = None if self.proc is None else self.proc.returncode
            raise AssertionError(f"broker {self.broker_id} is not running (exit {code}):\n"
                                 f"{self.log_tail()}")
        return True

    # -- clients ---------------------------------------------------------------------------

    def connection(self, timeout: float = 10.0) -> BrokerConnection:
        """A blocking :class:`BrokerConnection` to this broker (for ``get``)."""
        return BrokerConnection("127.0.0.1", self.port, timeout=timeout)


class _kazoo:
    def __init__(self, hosts: str) -> None:
        self.client = KazooClient(hosts=hosts, timeout=10.0)

    def __enter__(self) -> KazooClient:
        self.client.start(timeout=30)
        return self.client

    def __exit__(self, *exc: object) -> None:
        self.client.stop()
        self.client.close()


def start_broker(zk_connect: str, broker_id: int, data_dir: str | os.PathLike,
                 topics: Mapping[str, int], *, port: int | None = None,
                 group_commit: bool = False, unflush_threshold: int | None = None,
                 zk_root: str = "/meta", zk_session_timeout: float = 4.0,
                 extra_args: Iterable[str] = (), wait: bool = True,
                 timeout: float = _STARTUP_TIMEOUT) -> BrokerProc:
    """Start a broker subprocess; see :class:`BrokerProc`.  Use it as a context
    manager (or call :func:`stop_all`) so it never outlives the test."""
    proc = BrokerProc(zk_connect, broker_id, data_dir, topics, port=port,
                      group_commit=group_commit, unflush_threshold=unflush_threshold,
                      zk_root=zk_root, zk_session_timeout=zk_session_timeout,
                      extra_args=extra_args)
    try:
        return proc.start(wait=wait, timeout=timeout)
    except BaseException:
        proc.kill()
        raise


def stop_all(procs: Iterable[BrokerProc]) -> None:
    """Stop every broker (SIGCONT first, in case one was paused); never raises."""
    for p in procs:
        try:
            if p.alive:
                p.resume()
                p.stop()
        except Exception:
            p.kill()


def read_partition(conn: BrokerConnection, topic: str, partition: int, *, start: int = 0,
                   group: str = "test-reader", max_size: int = 1 << 20) -> list[RawMessage]:
    """Every message of one partition from ``start`` to its end, checksums verified.

    Follows ``get`` until the broker answers 404 (the end); a 301 (offset
    below the log start) restarts at the offset it names.
    """
    out: list[RawMessage] = []
    offset = start
    while True:
        try:
            mv = conn.get(topic, group, partition, offset, max_size)
        except BrokerError as e:
            if e.code == 404:
                return out
            if e.code == 301 and e.detail.strip().isdigit():
                offset = int(e.detail)
                continue
            raise
        msgs = list(iter_messages(mv, offset))
        if not msgs:
            if len(mv) >= max_size:
                max_size *= 2  # one message bigger than max_size
                continue
            if len(mv):
                raise AssertionError(
                    f"{topic}-{partition}: the message at offset {offset} is cut after "
                    f"{len(mv)} bytes by the broker (its max_transfer_size?)")
            return out
        out.extend(msgs)
        offset = msgs[-1].next_offset
