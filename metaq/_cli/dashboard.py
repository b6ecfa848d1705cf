"""``metaq dashboard``: the web dashboard (see :mod:`metaq.dashboard`).

Binds 127.0.0.1 unless ``--host`` says otherwise; read-only unless
``--allow-writes``.  The ZooKeeper credential (``--zk-auth`` or
``$METAQ_ZK_AUTH``) is used, never shown: the pages name the connect string
without any ``user:password@`` part.  Needs the ``dashboard`` extra (aiohttp).
"""

from __future__ import annotations

import argparse
import logging
import re
import sys

from kazoo.handlers.threading import KazooTimeoutError

from metaq._cli._zkflags import add_zk_root_arg, add_zk_security_args, security_from_args
from metaq._errors import ConfigError, CoordinationError
from metaq._zkclient import make_client
from zk_layout import Layout

__all__ = ["register", "shown_connect_string"]

log = logging.getLogger(__name__)


def shown_connect_string(zk: str) -> str:
    """The connect string as the pages show it: any ``user:password@`` removed."""
    return ",".join(re.sub(r"^[^@/]*@", "", part) for part in zk.split(","))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dashboard", help="web dashboard: brokers, topics, groups and lag, "
                                         "a message browser, a JSON API")
    p.add_argument("--zk", required=True, metavar="HOST:PORT[/chroot]",
                   help="ZooKeeper connect string")
    add_zk_root_arg(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8090, help="port (default 8090; 0: any free)")
    p.add_argument("--allow-writes", action="store_true",
                   help="offer reset-offsets and skip (refused while the group has live "
                        "members; each asks for confirmation and is logged)")
    p.add_argument("--sample-interval", type=float, default=5.0, metavar="SECONDS",
                   help="how often the brokers are asked for log ends and the lag chart "
                        "gets a point (default 5)")
    p.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS",
                   help="ZooKeeper and broker timeout (default 10)")
    add_zk_security_args(p)
    p.set_defaults(func=dashboard)


def dashboard(args: argparse.Namespace) -> int:
    try:
        from metaq.dashboard import Dashboard, serve
    except ImportError as e:
        raise ConfigError(f"metaq dashboard needs the 'dashboard' extra "
                          f"(pip install 'metaq-py[dashboard]'): {e}") from None
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be 0..65535, got {args.port}")
    if args.sample_interval <= 0:
        raise ConfigError(f"--sample-interval must be > 0, got {args.sample_interval}")
    client = make_client(args.zk, timeout=args.timeout, security=security_from_args(args))
    try:
        client.start(timeout=args.timeout)
    except KazooTimeoutError:
        raise CoordinationError(f"cannot reach ZooKeeper at {shown_connect_string(args.zk)}"
                                ) from None
    dash = Dashboard(client, Layout(args.zk_root), zk_display=shown_connect_string(args.zk),
                     sample_interval=args.sample_interval, timeout=args.timeout,
                     allow_writes=args.allow_writes)
    try:
        dash.start(timeout=max(30.0, args.timeout))

        def ready(url: str) -> None:
            mode = "writes allowed" if args.allow_writes else "read-only"
            print(f"metaq dashboard: {url} ({mode})", flush=True)
            if args.host not in ("127.0.0.1", "localhost", "::1"):
                print(f"metaq dashboard: listening on {args.host}: reachable from other "
                      "machines, with no login", file=sys.stderr, flush=True)

        serve(dash, host=args.host, port=args.port, on_ready=ready)
    except OSError as e:
        raise ConfigError(f"cannot listen on {args.host}:{args.port}: {e}") from None
    finally:
        dash.close()
        client.stop()
        client.close()
    return 0
