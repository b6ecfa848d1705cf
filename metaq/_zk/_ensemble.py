"""A ZooKeeper ensemble of several real servers on localhost, for failover tests."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from metaq._errors import ConfigError, LauncherError
from metaq._zk._classpath import find_java, find_zookeeper_classpath
from metaq._zk._launcher import ZooKeeperServer
from metaq._zk._process import free_port, server_mode
from metaq._zk._state import HOST, ZooKeeperConfig

__all__ = ["ZooKeeperEnsemble", "wait_for_quorum"]


def wait_for_quorum(modes: Callable[[], list[str | None]], timeout: float) -> int:
    """Poll ``modes()`` (each member's ``srvr`` mode, None when it does not serve) until a
    leader serves with a majority of members serving; the leader's index.  LauncherError
    naming the modes seen last when ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while True:
        seen = modes()
        serving = sum(m in ("leader", "follower", "observer") for m in seen)
        if "leader" in seen and serving > len(seen) // 2:
            return seen.index("leader")
        if time.monotonic() >= deadline:
            raise LauncherError(f"no quorum within {timeout:.0f}s: member modes {seen}")
        time.sleep(0.05)  # polling the members' four-letter answers

log = logging.getLogger(__name__)


def _distinct_free_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


class ZooKeeperEnsemble:
    """``size`` ZooKeeper servers on 127.0.0.1 forming one quorum.

    Each server has its own client, quorum and election port and its own data dir under
    ``base_dir`` (a temporary dir removed at :meth:`stop` when not given).  :attr:`hosts` is
    the connect string naming every server.  Use as a context manager or
    :meth:`start`/:meth:`stop`.
    """

    def __init__(
        self,
        size: int = 3,
        base_dir: str | os.PathLike[str] | None = None,
        *,
        config: ZooKeeperConfig | None = None,
    ) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ConfigError(f"ensemble size must be a positive int, got {size!r}")
        self.size = size
        self.config = config or ZooKeeperConfig()
        self._owns_dir = base_dir is None
        self._base_dir = None if base_dir is None else Path(base_dir).expanduser().resolve()
        self._servers: list[ZooKeeperServer] = []

    @property
    def servers(self) -> list[ZooKeeperServer]:
        return list(self._servers)

    @property
    def hosts(self) -> str:
        """``127.0.0.1:P1,127.0.0.1:P2,...`` — every member's client address."""
        if not self._servers:
            raise LauncherError("the ensemble is not started")
        return ",".join(s.hosts for s in self._servers)

    def node_hosts(self, i: int) -> str:
        """Connect string of member ``i`` alone."""
        return self._servers[i].hosts

    def __enter__(self) -> ZooKeeperEnsemble:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> ZooKeeperEnsemble:
        """Start every member and wait until each one serves clients (a quorum has formed)."""
        if self._servers:
            raise LauncherError("the ensemble is already started")
        java = find_java()
        classpath = find_zookeeper_classpath()
        if self._base_dir is None:
            self._base_dir = Path(tempfile.mkdtemp(prefix="metaq-zk-ensemble-")).resolve()
        ports = _distinct_free_ports(3 * self.size)
        quorum = [(i + 1, ports[3 * i], ports[3 * i + 1], ports[3 * i + 2])
                  for i in range(self.size)]
        self._servers = [
            ZooKeeperServer(
                client_port, self._base_dir / f"node{sid}", config=self.config, java=java,
                classpath=classpath, quorum=quorum, server_id=sid,
            )
            for sid, client_port, _, _ in quorum
        ]
        try:
            for server in self._servers:
                server.start(wait=False)
            deadline = time.monotonic() + self.config.start_timeout
            for server in self._servers:
                server.wait_serving(max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        log.info("ZooKeeper ensemble serving on %s (leader: node %s)", self.hosts, self.leader())
        return self

    def stop_node(self, i: int) -> None:
        """Stop member ``i`` (0-based); its data dir is kept for :meth:`start_node`."""
        self._servers[i].stop(clean=False)

    def start_node(self, i: int, *, wait: bool = True) -> None:
        """Start member ``i`` again on its old ports and data; ``wait`` until it serves."""
        server = self._servers[i]
        server.start(wait=False)
        if wait:
            server.wait_serving(self.config.start_timeout)

    def mode(self, i: int) -> str | None:
        """``leader``/``follower`` of member ``i``, or None when it does not serve."""
        server = self._servers[i]
        if server.pid is None:
            return None
        return server_mode(HOST, server.port)

    def leader(self) -> int | None:
        """Index of the member whose ``srvr`` says ``Mode: leader``, or None."""
        for i in range(len(self._servers)):
            if self.mode(i) == "leader":
                return i
        return None

    def wait_quorum(self, timeout: float = 30.0) -> int:
        """Wait until a leader serves with a majority of members serving; return its index."""
        return wait_for_quorum(lambda: [self.mode(i) for i in range(len(self._servers))],
                               timeout)

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(f"=== node {i} ===\n{s.log_tail(lines)}"
                         for i, s in enumerate(self._servers))

    def stop(self) -> None:
        """Stop every member and remove the base dir when it is temporary."""
        errors: list[BaseException] = []
        for server in self._servers:
            try:
                server.stop(clean=False)
            except Exception as e:  # keep stopping the others
                errors.append(e)
        self._servers = []
        if self._owns_dir and self._base_dir is not None:
            shutil.rmtree(self._base_dir, ignore_errors=True)
            self._base_dir = None
        if errors:
            raise errors[0]
