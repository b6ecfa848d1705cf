"""``metaq group list|describe|reset-offsets`` and ``metaq topic list|describe``.

Read commands take ``--json``.  Exit codes: 0 done, 1 ZooKeeper or a broker
failed, 2 bad arguments (including an unknown group or topic, and a reset
refused because the group has live members).  ``metaq group history`` is
:mod:`metaq._cli.history`'s.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager

from kazoo.client import KazooClient
from kazoo.handlers.threading import KazooTimeoutError

from metaq._admin import UNWRITTEN_NOTE, describe_group, log_damage, log_ends, reset_offsets
from metaq._cli._zkflags import add_zk_root_arg, add_zk_security_args, security_from_args
from metaq._cli.history import add_history_parser
from metaq._errors import ConfigError, CoordinationError
from metaq._time import parse_time_ms
from metaq._zkclient import make_client
from zk_layout import Layout, take_snapshot

__all__ = ["register"]


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--zk", required=True, metavar="HOST:PORT[/chroot]",
                   help="ZooKeeper connect string")
    add_zk_root_arg(p)
    p.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS",
                   help="ZooKeeper and broker timeout (default 10)")
    add_zk_security_args(p)


def register(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("group", help="consumer groups: list, describe, reset offsets")
    gs = g.add_subparsers(dest="group_command", metavar="ACTION", required=True)
    p = gs.add_parser("list", help="every group with its member and partition counts")
    _common(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=group_list)
    p = gs.add_parser("describe", help="per partition: owner, committed offset and msgId, "
                                       "log end, lag, state (ok, lagging, stalled, unowned, "
                                       "damaged, out of range, data lost, unknown); with "
                                       "static members, each member's state (live, away "
                                       "and held until when, hold expired)")
    _common(p)
    p.add_argument("group")
    p.add_argument("--interval", type=float, default=0.0, metavar="SECONDS",
                   help="sample twice this far apart to tell 'stalled' from 'lagging'")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=group_describe)
    p = gs.add_parser("reset-offsets", help="set a topic's committed offsets "
                                            "(refused while the group has live members)")
    _common(p)
    p.add_argument("group")
    p.add_argument("--topic", required=True)
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--to-earliest", action="store_true")
    target.add_argument("--to-latest", action="store_true")
    target.add_argument("--to-offset", type=int, metavar="N")
    target.add_argument("--to-time", metavar="TIME",
                        help="the first message at or after TIME (ISO-8601, e.g. "
                             "2026-11-25T14:00:00Z, or epoch ms), by msgId time")
    p.add_argument("--dry-run", action="store_true",
                   help="print the old and new positions, write nothing")
    p.set_defaults(func=group_reset)
    add_history_parser(gs, _common, _client)

    t = sub.add_parser("topic", help="topics: list, describe")
    ts = t.add_subparsers(dest="topic_command", metavar="ACTION", required=True)
    p = ts.add_parser("list", help="every topic with its brokers and partition count")
    _common(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=topic_list)
    p = ts.add_parser("describe", help="per partition: broker, log start and end")
    _common(p)
    p.add_argument("topic")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=topic_describe)


@contextmanager
def _client(args: argparse.Namespace) -> Iterator[KazooClient]:
    client = make_client(args.zk, timeout=args.timeout, security=security_from_args(args))
    try:
        client.start(timeout=args.timeout)
    except KazooTimeoutError:
        raise CoordinationError(f"cannot reach ZooKeeper at {args.zk}") from None
    try:
        yield client
    finally:
        client.stop()
        client.close()


def _table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [headers] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in cells)


def group_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        snap = take_snapshot(client, Layout(args.zk_root))
    rows = [{"group": g.group, "members": len(g.members),
             "topics": sorted({t.topic for t in g.topics}),
             "partitions": sum(len(t.partitions) for t in g.topics)} for g in snap.groups]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(_table(["group", "members", "partitions", "topics"],
                     [[r["group"], r["members"], r["partitions"], ",".join(r["topics"])]
                      for r in rows]))
    return 0


def group_describe(args: argparse.Namespace) -> int:
    with _client(args) as client:
        report = describe_group(client, Layout(args.zk_root), args.group, interval=args.interval,
                                timeout=args.timeout)
    if args.json:
        print(json.dumps(report.as_json(), indent=2))
        return 0
    away = [m for m in report.member_states if m.state != "live"]
    print(f"group {report.group}: {len(report.members)} member(s) "
          f"{' '.join(report.members)}"
          + (f"; {len(away)} away static member(s) {' '.join(m.consumer_id for m in away)}"
             if away else ""))
    if report.has_static:  # a group without static members: every member is just live
        print(_table(["member", "instance", "host", "topics", "state"],
                     [[m.consumer_id, m.instance_id, m.host, ",".join(m.topics) or None,
                       m.text] for m in report.member_states]))
        print()
    print(_table(["topic", "partition", "owner", "committed", "msgId", "log end", "lag",
                  "lag s", "state"],
                 [[p.topic, p.partition, p.owner, p.committed, p.msg_id, p.log_end, p.lag,
                   None if p.lag_seconds is None else f"{p.lag_seconds:.1f}",
                   f"{p.state} ({p.note})" if p.note else p.state]
                  for p in report.partitions]))
    print(f"status: {report.status}")
    return 0


def group_reset(args: argparse.Namespace) -> int:
    to: str | int | tuple[str, int]
    if args.to_time is not None:
        to = ("time", parse_time_ms(args.to_time, "--to-time"))
    else:
        to = ("earliest" if args.to_earliest else "latest" if args.to_latest
              else args.to_offset)
    if isinstance(to, int) and to < 0:
        raise ConfigError("--to-offset must be >= 0")
    with _client(args) as client:
        done = reset_offsets(client, Layout(args.zk_root), args.group, args.topic, to=to,
                             timeout=args.timeout, dry_run=args.dry_run)
    if args.dry_run:
        print(f"dry run: nothing written ({args.group}, {args.topic})")
        print(_table(["topic", "partition", "committed", "new"],
                     [[args.topic, part, old, new] for part, (old, new) in done.items()]))
    else:
        for part, (_, value) in done.items():
            print(f"{args.topic} {part} -> {value}")
    return 0


def topic_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        snap = take_snapshot(client, Layout(args.zk_root))
    rows = [{"topic": t.topic, "brokers": sorted({b.broker_id for b in t.brokers}),
             "partitions": len(t.partitions)} for t in snap.topics]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(_table(["topic", "partitions", "brokers"],
                     [[r["topic"], r["partitions"], ",".join(map(str, r["brokers"]))]
                      for r in rows]))
    return 0


def topic_describe(args: argparse.Namespace) -> int:
    layout = Layout(args.zk_root)
    with _client(args) as client:
        if client.exists(layout.topic_sub_dir(args.topic)) is None:
            raise ConfigError(f"no topic {args.topic!r} under {args.zk_root}")
        unwritten: set[str] = set()
        ends = log_ends(client, layout, args.topic, timeout=args.timeout, unwritten=unwritten)
        damage = log_damage(client, layout, args.topic, timeout=args.timeout)
        snap = take_snapshot(client, layout)
    ids = {int(p.split("-", 1)[0]) for p in ends}
    replicas = [_replica_row(b) for b in snap.brokers if b.broker_id in ids]
    rows = [{"partition": p, "broker_id": int(p.split("-", 1)[0]), "log_start": s,
             "log_end": e, "bytes": None if s is None or e is None else e - s,
             "damaged": None if damage.get(p) is None else damage[p][0],
             "damaged_bytes": None if damage.get(p) is None else damage[p][1],
             "note": UNWRITTEN_NOTE if p in unwritten else
             "its broker did not answer" if s is None else None}
            for p, (s, e) in ends.items()]
    if args.json:
        print(json.dumps({"topic": args.topic, "partitions": rows, "replication": replicas},
                         indent=2))
    else:
        print(_table(["partition", "broker", "log start", "log end", "bytes", "damaged",
                      "damaged bytes", "note"],
                     [[r["partition"], r["broker_id"], r["log_start"], r["log_end"],
                       r["bytes"], r["damaged"], r["damaged_bytes"], r["note"]]
                      for r in rows]))
        if any(r["slaves"] or r["epoch"] is not None for r in replicas):
            print()
            print(_table(["broker", "master", "epoch", "mode", "in sync", "slaves", "note"],
                         [[r["broker_id"], r["master"], r["epoch"], r["mode"],
                           ",".join(map(str, r["in_sync"])) or "none",
                           ",".join(map(str, r["slaves"])) or "none", r["note"]]
                          for r in replicas]))
    return 0


def _replica_row(b: object) -> dict:
    """A broker id's replication, as ``topic describe`` shows it."""
    rep = b.replication
    slaves = [n for n, _uri in b.slaves]
    note = None
    if rep is not None and rep.mode == "sync" and not rep.in_sync:
        note = "sync replication with no slave in sync: puts are acknowledged by the " \
               "master alone (or refused, with no_in_sync = refuse)"
    elif rep is not None and any(n not in rep.in_sync for n in slaves):
        note = "slaves " + ",".join(str(n) for n in slaves if n not in rep.in_sync) + \
            " not in sync"
    if b.master is None:
        note = "no master registered" + (f"; {note}" if note else "")
    return {"broker_id": b.broker_id, "master": None if b.master is None else str(b.master),
            "epoch": None if rep is None else rep.epoch,
            "leader_replica": None if rep is None else rep.master,
            "mode": None if rep is None else rep.mode,
            "in_sync": [] if rep is None else list(rep.in_sync), "slaves": slaves,
            "note": note}
