"""ZooKeeper flags shared by every command that talks to ZooKeeper: its security
and the root of the Metaq tree (``--zk-root``, ``--root`` accepted too)."""

from __future__ import annotations

import argparse
import os

from metaq._zkclient import ACL_MODES, ZkSecurity
from zk_layout import DEFAULT_ROOT

__all__ = ["add_zk_root_arg", "add_zk_security_args", "security_from_args"]


def add_zk_root_arg(p: argparse.ArgumentParser, *, default: str | None = DEFAULT_ROOT,
                    help: str = f"ZooKeeper root of the Metaq tree (default {DEFAULT_ROOT})"
                    ) -> None:
    """``--zk-root PATH`` into ``args.zk_root``; ``--root``, its other spelling, is
    accepted too (not shown in the help)."""
    p.add_argument("--zk-root", dest="zk_root", default=default, metavar="PATH", help=help)
    p.add_argument("--root", dest="zk_root", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def add_zk_security_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("ZooKeeper security")
    g.add_argument("--zk-auth", metavar="USER:PASSWORD", default=None,
                   help="digest credential (default: $METAQ_ZK_AUTH; prefer the variable, "
                        "command lines are visible to other users)")
    g.add_argument("--zk-acl", choices=ACL_MODES, default=None,
                   help="ACL of the nodes this command creates (default open)")
    g.add_argument("--zk-tls", action="store_true", help="connect to ZooKeeper with TLS")
    g.add_argument("--zk-ca", metavar="FILE", help="CA bundle for --zk-tls")
    g.add_argument("--zk-cert", metavar="FILE", help="client certificate for --zk-tls")
    g.add_argument("--zk-key", metavar="FILE", help="client key for --zk-tls")


def security_from_args(args: argparse.Namespace) -> ZkSecurity | None:
    auth = args.zk_auth or os.environ.get("METAQ_ZK_AUTH") or None
    if not (auth or args.zk_acl or args.zk_tls or args.zk_ca or args.zk_cert or args.zk_key):
        return None
    return ZkSecurity(auth=auth, acl=args.zk_acl or "open", tls=args.zk_tls,
                      ca_file=args.zk_ca, cert_file=args.zk_cert, key_file=args.zk_key)
