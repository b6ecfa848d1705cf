"""State of an embedded ZooKeeper server kept in its data dir: config, pid file, status.

Files kept in a server's data dir::

    zoo.cfg              the server's configuration (written at every start)
    log4j2.properties    logging config: everything goes to zookeeper.log
    zookeeper.log        the server's log
    zookeeper.out        the JVM's stdout/stderr (crashes, JVM errors)
    zookeeper.pid        pid of the running JVM (removed at stop)
    data/                snapshots and transaction logs (``myid`` for an ensemble member)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from metaq._errors import ConfigError
from metaq._zk._process import (
    four_letter_word,
    is_zookeeper_process,
    read_pidfile,
    server_mode,
    stop_pid,
)

__all__ = [
    "CONFIG_FILE",
    "HOST",
    "LOG_FILE",
    "OUT_FILE",
    "PID_FILE",
    "ZooKeeperConfig",
    "ZooKeeperStatus",
    "read_client_port",
    "status",
    "stop",
]

HOST = "127.0.0.1"
CONFIG_FILE = "zoo.cfg"
LOG_FILE = "zookeeper.log"
OUT_FILE = "zookeeper.out"
PID_FILE = "zookeeper.pid"


@dataclass(frozen=True, kw_only=True)
class ZooKeeperConfig:
    """Settings of an embedded ZooKeeper server.  Defaults suit tests: fast ticks, short sessions.

    - ``tick_time_ms`` (200): ZooKeeper's basic time unit; session expiry is checked each tick.
    - ``min_session_timeout_ms`` (1000) / ``max_session_timeout_ms`` (60000): bounds the server
      puts on the session timeout a client asks for.
    - ``init_limit`` (50) / ``sync_limit`` (25): ticks a follower may take to connect / stay in
      sync with the leader (ensemble only).
    - ``force_sync`` (False): fsync the transaction log at each write (off: faster tests).
    - ``heap_mb`` (256): JVM maximum heap.
    - ``start_timeout`` (60.0 s): how long :meth:`ZooKeeperServer.start` waits for the server
      to serve a client.
    - ``stop_timeout`` (10.0 s): how long stop waits after SIGTERM before SIGKILL.
    """

    tick_time_ms: int = 200
    min_session_timeout_ms: int = 1000
    max_session_timeout_ms: int = 60000
    init_limit: int = 50
    sync_limit: int = 25
    force_sync: bool = False
    heap_mb: int = 256
    start_timeout: float = 60.0
    stop_timeout: float = 10.0

    def __post_init__(self) -> None:
        for name in ("tick_time_ms", "min_session_timeout_ms", "max_session_timeout_ms",
                     "init_limit", "sync_limit", "heap_mb"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"ZooKeeperConfig.{name} must be a positive int, got {value!r}")
        for name in ("start_timeout", "stop_timeout"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                raise ConfigError(
                    f"ZooKeeperConfig.{name} must be a positive number, got {value!r}")
        if self.min_session_timeout_ms > self.max_session_timeout_ms:
            raise ConfigError(
                f"ZooKeeperConfig.min_session_timeout_ms ({self.min_session_timeout_ms}) is above "
                f"max_session_timeout_ms ({self.max_session_timeout_ms})")
        if not isinstance(self.force_sync, bool):
            raise ConfigError(f"ZooKeeperConfig.force_sync must be a bool, got {self.force_sync!r}")


@dataclass(frozen=True, kw_only=True)
class ZooKeeperStatus:
    """What :func:`status` found in a data dir."""

    data_dir: Path
    pid: int | None  #: pid of the live server, None when not running
    port: int | None  #: client port from zoo.cfg
    running: bool  #: the JVM of this data dir is alive
    serving: bool  #: it answers ``ruok`` with ``imok``
    mode: str | None  #: ``standalone``/``leader``/``follower`` from ``srvr``

    @property
    def hosts(self) -> str | None:
        return f"{HOST}:{self.port}" if self.port else None


def read_client_port(config_path: Path) -> int | None:
    try:
        for line in config_path.read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "clientPort" and value.strip().isdigit():
                return int(value.strip())
    except OSError:
        return None
    return None


def status(data_dir: str | os.PathLike[str]) -> ZooKeeperStatus:
    """Whether the server of ``data_dir`` runs (pid file + live QuorumPeerMain) and serves."""
    data_dir = Path(data_dir).expanduser().resolve()
    config_path = data_dir / CONFIG_FILE
    port = read_client_port(config_path)
    pid = read_pidfile(data_dir / PID_FILE)
    running = pid is not None and is_zookeeper_process(pid, config_path)
    serving = False
    mode = None
    if running and port:
        try:
            serving = four_letter_word(HOST, port, "ruok", timeout=2.0).strip() == "imok"
        except OSError:
            serving = False
        mode = server_mode(HOST, port) if serving else None
    return ZooKeeperStatus(data_dir=data_dir, pid=pid if running else None, port=port,
                           running=running, serving=serving, mode=mode)


def stop(data_dir: str | os.PathLike[str], *, timeout: float = 10.0) -> bool:
    """Stop the server of ``data_dir`` by its pid file.  Returns False if none was running."""
    data_dir = Path(data_dir).expanduser().resolve()
    pid = read_pidfile(data_dir / PID_FILE)
    stopped = False
    if pid is not None and is_zookeeper_process(pid, data_dir / CONFIG_FILE):
        stopped = stop_pid(pid, timeout=timeout)
    (data_dir / PID_FILE).unlink(missing_ok=True)
    return stopped
