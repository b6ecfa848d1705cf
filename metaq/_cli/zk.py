"""``metaq zk start|stop|status``: run the embedded ZooKeeper server in the background."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from metaq._cli._numbers import port, positive_float
from metaq._errors import ConfigError
from metaq._zk import ZooKeeperConfig, ZooKeeperServer, status, stop

__all__ = ["default_data_dir", "register"]


def default_data_dir() -> Path:
    """``$METAQ_ZK_DATA_DIR``, else ``$XDG_STATE_HOME/metaq/zk``, else ``~/.local/state/metaq/zk``.
    """
    explicit = os.environ.get("METAQ_ZK_DATA_DIR")
    if explicit:
        return Path(explicit).expanduser()
    state = os.environ.get("XDG_STATE_HOME") or os.path.join("~", ".local", "state")
    return Path(state).expanduser() / "metaq" / "zk"


_DATA_DIR_HELP = (
    "the server's data dir (config, log, pid file, snapshots); default: $METAQ_ZK_DATA_DIR, "
    "else $XDG_STATE_HOME/metaq/zk, else ~/.local/state/metaq/zk (now: %(default)s)"
)


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "zk",
        help="run a local ZooKeeper server in the background (start/stop/status)",
        description=(
            "Run a real ZooKeeper server (a JVM, jars from $ZOOKEEPER_HOME, Debian's zookeeper "
            "package or the pyspark wheel) on 127.0.0.1, in the background."),
    )
    sub = parser.add_subparsers(dest="zk_command", metavar="ACTION")
    sub.required = True
    default_dir = str(default_data_dir())

    start = sub.add_parser(
        "start", help="start the server and return once it serves clients",
        description=(
            "Start the server, wait until it serves clients, and leave it running in the "
            "background. The last line printed is the connect string host:port. If a server "
            "already runs on the data dir, report it instead of starting another."))
    start.add_argument("--port", type=port, default=None,
                       help="client port (default: a free port)")
    start.add_argument("--data-dir", default=default_dir, help=_DATA_DIR_HELP)
    start.add_argument("--tick-time-ms", type=int, default=ZooKeeperConfig.tick_time_ms,
                       help="ZooKeeper tickTime in ms (default: %(default)s)")
    start.add_argument("--timeout", type=positive_float, default=ZooKeeperConfig.start_timeout,
                       help="seconds to wait for the server to serve (default: %(default)s)")
    start.set_defaults(func=_start)

    stop_p = sub.add_parser("stop", help="stop the server of a data dir",
                            description="Stop the server of the data dir (SIGTERM, then SIGKILL).")
    stop_p.add_argument("--data-dir", default=default_dir, help=_DATA_DIR_HELP)
    stop_p.add_argument("--timeout", type=positive_float, default=10.0,
                        help="seconds to wait after SIGTERM before SIGKILL (default: %(default)s)")
    stop_p.set_defaults(func=_stop)

    status_p = sub.add_parser(
        "status", help="say where the server runs (exit 0 running, 1 not running)",
        description="Print the server's state; exit 0 when it runs, 1 when it does not.")
    status_p.add_argument("--data-dir", default=default_dir, help=_DATA_DIR_HELP)
    status_p.set_defaults(func=_status)


def _start(args: argparse.Namespace) -> int:
    data_dir = Path(args.data_dir).expanduser().resolve()
    current = status(data_dir)
    if current.running:
        if args.port is not None and args.port != current.port:
            raise ConfigError(
                f"a server already runs on data dir {data_dir} at {current.hosts} (pid "
                f"{current.pid}), not on the requested port {args.port}; stop it first")
        print(f"already running: pid {current.pid}, data dir {data_dir}", file=sys.stderr)
        print(current.hosts, flush=True)
        return 0
    try:
        config = ZooKeeperConfig(tick_time_ms=args.tick_time_ms, start_timeout=args.timeout)
    except ConfigError as e:
        raise ConfigError(f"bad option: {e}") from None
    server = ZooKeeperServer(args.port, data_dir, config=config, stop_at_exit=False)
    server.start()
    print(f"started: pid {server.pid}, data dir {data_dir}, log {server.log_path}",
          file=sys.stderr)
    print(server.hosts, flush=True)
    return 0


def _stop(args: argparse.Namespace) -> int:
    data_dir = Path(args.data_dir).expanduser().resolve()
    current = status(data_dir)
    if stop(data_dir, timeout=args.timeout):
        print(f"stopped: pid {current.pid}, data dir {data_dir}")
    else:
        print(f"not running: data dir {data_dir}")
    return 0


def _status(args: argparse.Namespace) -> int:
    data_dir = Path(args.data_dir).expanduser().resolve()
    current = status(data_dir)
    if not current.running:
        print(f"not running: data dir {data_dir}")
        return 1
    state = f"serving ({current.mode})" if current.serving else "running, not serving"
    print(f"{state}: {current.hosts} pid {current.pid} data dir {data_dir}")
    return 0
