"""``python -m zk_layout``: inspect a Metaq tree in ZooKeeper (read-only).

::

    python -m zk_layout --zk HOST:PORT[,HOST:PORT...][/chroot] [--zk-root /meta] [--timeout 10]
                        {tree,brokers,topics,groups,group NAME [--brokers],
                         history NAME [--since T] [--partition P]} [--json]

It reads ZooKeeper only, except ``group NAME --brokers``, which also asks each
partition's broker for its log end: lag in bytes and seconds (``_probe``).

Exit codes: 0 done (also when the tree is empty or has damaged nodes, which
are shown), 1 ZooKeeper unreachable or failing, or no such group, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Sequence

from zk_layout._errors import InvalidNameError
from zk_layout._history import read_history
from zk_layout._names import Partition, check_group
from zk_layout._paths import DEFAULT_ROOT, Layout
from zk_layout._probe import PartitionLag, probe_partitions
from zk_layout._render import (
    render_brokers,
    render_group,
    render_groups,
    render_topics,
    render_tree,
    to_json,
    to_jsonable,
)
from zk_layout._snapshot import GroupInfo, Snapshot, read_tree, take_snapshot
from zk_layout._timeline import history_to_json, parse_since, render_history, select_history

__all__ = ["build_parser", "main", "parse_zk_hosts"]

PROG = "python -m zk_layout"
DEFAULT_TIMEOUT = 10.0

_HOST_PORT = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})")


def parse_zk_hosts(text: str) -> str:
    """Validate a kazoo connection string ``host:port[,host:port...][/chroot]``."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    hosts, slash, chroot = text.partition("/")
    for item in hosts.split(","):
        m = _HOST_PORT.fullmatch(item)
        if m is None:
            raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {item!r} in {text!r}")
        if not 1 <= int(m.group(1)) <= 65535:
            raise argparse.ArgumentTypeError(f"port out of range 1..65535 in {item!r}")
    if slash:
        try:
            Layout("/" + chroot)
        except InvalidNameError as e:
            raise argparse.ArgumentTypeError(f"bad chroot in {text!r}: {e.reason}") from None
    return text


def _layout(text: str) -> Layout:
    try:
        return Layout(text)
    except InvalidNameError as e:
        raise argparse.ArgumentTypeError(e.reason) from None


def _timeout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"must be > 0 and <= 3600 seconds, got {text}")
    return value


def _group_name(text: str) -> str:
    try:
        return check_group(text)
    except InvalidNameError as e:
        raise argparse.ArgumentTypeError(e.reason) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Inspect Metaq's ZooKeeper tree (read-only).")
    parser.add_argument("--zk", required=True, type=parse_zk_hosts, metavar="HOST:PORT[/chroot]",
                        help="ZooKeeper connection string (kazoo syntax)")
    parser.add_argument("--zk-root", dest="root", type=_layout, default=Layout(DEFAULT_ROOT),
                        metavar="PATH", help=f"Metaq's zkRoot (default: {DEFAULT_ROOT})")
    parser.add_argument("--root", dest="root", type=_layout, default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)  # the other spelling, as metaq's commands take
    parser.add_argument("--timeout", type=_timeout, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                        help=f"connect and session timeout (default: {DEFAULT_TIMEOUT:g}s)")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="log kazoo's chatter")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    helps = {
        "tree": "every node under the root with its data, damaged nodes flagged",
        "brokers": "brokers: master and slave URIs",
        "topics": "topics: brokers with numParts per registry, and partition lists",
        "groups": "consumer groups: members (live, or static members away) and counts",
        "group": "one consumer group: its members' states (live, static, away and held "
                 "until when) and per partition its owner, committed offset and msgId",
        "history": "one consumer group's rebalance history: each member's rebalances "
                   "(trigger, released, claimed, took) by time; with --partition, who held "
                   "it when and why it moved",
    }
    for name, help_text in helps.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        # SUPPRESS: a --json given before the sub-command is not reset to False here.
        p.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                       help="print machine-readable JSON")
        if name == "history":
            p.add_argument("name", type=_group_name, metavar="NAME", help="the group name")
            p.add_argument("--since", type=_since, metavar="T",
                           help="since T: 30s, 10m, 2h, 1d back from now, ISO-8601 or "
                                "epoch ms")
            p.add_argument("--partition", metavar="P",
                           help="only this partition (topic/0-3, or 0-3 in any topic), "
                                "with its ownership timeline")
        if name == "group":
            p.add_argument("name", type=_group_name, metavar="NAME", help="the group name")
            p.add_argument("--brokers", action="store_true",
                           help="also ask each partition's broker (TCP) for its log end: "
                                "LOG END, LAG (bytes) and LAG S (age of the oldest "
                                "unconsumed message) columns")
    return parser


def _since(text: str) -> int:
    try:
        return parse_since(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _history(args: argparse.Namespace, client: object) -> int:
    layout: Layout = args.root
    if client.exists(layout.group(args.name)) is None:  # type: ignore[attr-defined]
        print(f"{PROG}: error: no consumer group {args.name!r} under "
              f"{layout.consumer_groups()}", file=sys.stderr)
        return 1
    records, timeline = select_history(read_history(client, layout, args.name),
                                       since=args.since, partition=args.partition)
    if args.json:
        sys.stdout.write(to_json(history_to_json(args.name, records, timeline)))
    else:
        sys.stdout.write(render_history(records, timeline if args.partition else None))
    sys.stdout.write("\n")
    return 0


def _run(args: argparse.Namespace, client: object) -> int:
    layout: Layout = args.root
    out = sys.stdout
    if args.command == "history":
        return _history(args, client)
    if args.command == "tree":
        nodes = read_tree(client, layout)
        if args.json:
            out.write(to_json({"root": layout.root, "exists": bool(nodes), "nodes": nodes}))
        else:
            out.write(render_tree(nodes, layout.root))
        out.write("\n")
        return 0
    snap = take_snapshot(client, layout)
    if args.command == "group":
        group = snap.group(args.name)
        if group is None:
            print(f"{PROG}: error: no consumer group {args.name!r} under "
                  f"{layout.consumer_groups()}", file=sys.stderr)
            return 1
        lags = _probe_group(snap, group, args.timeout) if args.brokers else None
        if args.json:
            doc = to_jsonable(group)
            if lags is not None:
                doc["lag"] = [{"topic": t, "partition": str(p), **to_jsonable(lag)}
                              for (t, p), lag in lags.items()]
            out.write(to_json(doc))
        else:
            out.write(render_group(group, lags))
        out.write("\n")
        return 0
    if args.json:
        doc = {"root": snap.root, "exists": snap.exists}
        doc[args.command] = to_jsonable(getattr(snap, args.command))
        if args.command == "brokers":
            doc["damaged"] = to_jsonable([d for b in snap.brokers for d in b.damaged])
        elif args.command == "topics":
            doc["damaged"] = to_jsonable([d for t in snap.topics for d in t.damaged])
        else:
            doc["damaged"] = to_jsonable([d for g in snap.groups for d in g.damaged])
        out.write(to_json(doc))
    else:
        render = {"brokers": render_brokers, "topics": render_topics, "groups": render_groups}
        out.write(render[args.command](snap))
    out.write("\n")
    return 0


def _probe_group(snap: Snapshot, group: GroupInfo, timeout: float
                 ) -> dict[tuple[str, Partition], PartitionLag]:
    keys, wanted = [], []
    for t in group.topics:
        for p in t.partitions:
            broker = snap.broker(p.partition.broker_id)
            keys.append((t.topic, p.partition))
            wanted.append((t.topic, p.partition.index,
                           None if broker is None else broker.master,
                           None if p.offset is None else p.offset.offset))
    lags = probe_partitions(wanted, group=group.group, timeout=timeout)
    return dict(zip(keys, lags, strict=True))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # exits 2 on bad arguments
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        logging.getLogger("kazoo").setLevel(logging.CRITICAL)

    from kazoo.client import KazooClient
    from kazoo.exceptions import KazooException
    from kazoo.handlers.threading import KazooTimeoutError

    client = KazooClient(hosts=args.zk, timeout=args.timeout, read_only=True)
    try:
        try:
            client.start(timeout=args.timeout)
        except KazooTimeoutError:
            print(f"{PROG}: error: cannot connect to ZooKeeper at {args.zk} within "
                  f"{args.timeout:g}s", file=sys.stderr)
            return 1
        return _run(args, client)
    except KazooException as e:
        print(f"{PROG}: error: ZooKeeper at {args.zk} failed: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 1
    except BrokenPipeError:  # output piped into e.g. head, which stopped reading
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        client.stop()
        client.close()


if __name__ == "__main__":
    sys.exit(main())
