"""``metaq group list|describe|what-if|reset-offsets`` and ``metaq topic list|describe``.

``describe --audit`` adds the ownership audit, ``describe --catch-up T`` the
capacity hint, ``what-if`` the assignment after a change (all from
:mod:`metaq._insight`; none writes anything).

Read commands take ``--json``.  Exit codes: 0 done, 1 ZooKeeper or a broker
failed, 2 bad arguments (including an unknown group or topic, and a reset
refused because the group has live members).  ``metaq group history`` is
:mod:`metaq._cli.history`'s.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kazoo.client import KazooClient
from kazoo.handlers.threading import KazooTimeoutError

from metaq._admin import UNWRITTEN_NOTE, describe_group, log_damage, log_ends, reset_offsets
from metaq._cli._numbers import duration, non_negative_int
from metaq._cli._zkflags import add_zk_root_arg, add_zk_security_args, security_from_args
from metaq._cli.history import add_history_parser
from metaq._errors import ConfigError, CoordinationError
from metaq._insight import CapacityHint, audit, capacity, read_logs, take_reading, what_if
from metaq._time import parse_time_ms
from metaq._zkclient import make_client
from metaq.consumer import STRATEGIES
from zk_layout import Layout, local_ip, take_snapshot

__all__ = ["register"]


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--zk", required=True, metavar="HOST:PORT[/chroot]",
                   help="ZooKeeper connect string")
    add_zk_root_arg(p)
    p.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS",
                   help="ZooKeeper and broker timeout (default 10)")
    add_zk_security_args(p)


def register(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("group", help="consumer groups: list, describe (audit, catch-up), "
                                        "what-if, reset offsets")
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
    p.add_argument("--audit", action="store_true",
                   help="also flag unowned partitions, owner nodes of gone members, "
                        "partitions held against the strategy, committed offsets beyond "
                        "the log end or inside a message, brokers that do not answer")
    p.add_argument("--strategy", choices=sorted(STRATEGIES),
                   help="the strategy --audit checks owners against (default: the one "
                        "that explains them, else default)")
    p.add_argument("--catch-up", type=duration, metavar="DURATION",
                   help="estimate the catch-up time and the members needed to catch up "
                        "within DURATION (e.g. 10m), from two readings --sample apart")
    p.add_argument("--sample", type=duration, default=5.0, metavar="DURATION",
                   help="the window --catch-up measures rates over (default 5s)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=group_describe)
    p = gs.add_parser("what-if", help="the assignment the group would compute after "
                                      "members join or leave or the strategy changes, "
                                      "the partitions that would move, each member's load "
                                      "(reads only)")
    _common(p)
    p.add_argument("group")
    p.add_argument("--add", type=non_negative_int, default=0, metavar="N",
                   help="N members without a configured id, started on --host")
    p.add_argument("--add-id", action="append", default=[], metavar="CONSUMER_ID",
                   help="a member configured with this consumer_id or instance_id joins "
                        "(its consumer id is <group>_<CONSUMER_ID>); repeatable")
    p.add_argument("--remove", action="append", default=[], metavar="MEMBER",
                   help="this member (its consumer id, or the part after <group>_) "
                        "leaves for good; repeatable")
    p.add_argument("--strategy", choices=sorted(STRATEGIES),
                   help="plan with this strategy (default: the one the group runs, "
                        "inferred from its owners, else default)")
    p.add_argument("--host", default=None,
                   help="the host --add members start on (default: this machine's address)")
    p.add_argument("--topic", action="append", default=None, dest="topics",
                   metavar="TOPIC", help="topics added members subscribe to (default: "
                                         "the group's); repeatable")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=group_what_if)
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
    layout = Layout(args.zk_root)
    findings = hint = None
    with _client(args) as client:
        report = describe_group(client, layout, args.group, interval=args.interval,
                                timeout=args.timeout)
        if args.audit:
            snap = take_snapshot(client, layout)
            findings = audit(snap, args.group, strategy=args.strategy,
                             logs=read_logs(client, layout, snap, args.group,
                                            timeout=args.timeout))
        if args.catch_up is not None:
            first = take_reading(client, layout, args.group, timeout=args.timeout)
            time.sleep(args.sample)  # the sampling window itself, not synchronisation
            second = take_reading(client, layout, args.group, timeout=args.timeout)
            hint = capacity(first, second, target=args.catch_up)
    if args.json:
        out = report.as_json()
        if findings is not None:
            out["audit"] = [f.to_json() for f in findings]
        if hint is not None:
            out["capacity"] = hint.to_json()
        print(json.dumps(out, indent=2))
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
    if findings is not None:
        print()
        print(f"audit: {len(findings)} finding(s)")
        if findings:
            print(_table(["kind", "topic", "partition", "detail"],
                         [[f.kind, f.topic, f.partition, f.detail] for f in findings]))
    if hint is not None:
        print()
        _print_capacity(hint)
    return 0


def _rate(bps: float | None) -> str:
    return "-" if bps is None else f"{bps / 1024:.1f} KiB/s"


def _print_capacity(h: CapacityHint) -> None:
    print(f"capacity over {h.window:.1f}s: produce {_rate(h.produce_rate)}, consume "
          f"{_rate(h.consume_rate)} by {h.members} member(s) ({len(h.busy_members)} behind: "
          f"{_rate(h.per_member_rate)} each), lag {h.lag} bytes")
    cu = h.catch_up_seconds
    print("catch-up: " + ("never at these rates" if cu is None else f"{cu:.0f}s"))
    if h.target_seconds is not None:
        print(f"members needed to catch up within {h.target_seconds:.0f}s: "
              + ("unknown" if h.members_needed is None else str(h.members_needed))
              + f" (partitions: {h.partitions})")
    for note in h.notes:
        print(f"note: {note}")
    print("assumes: " + "; ".join(h.assumptions))


def group_what_if(args: argparse.Namespace) -> int:
    with _client(args) as client:
        snap = take_snapshot(client, Layout(args.zk_root))
    w = what_if(snap, args.group, add=args.add,
                add_ids=[f"{args.group}_{c}" for c in args.add_id], remove=args.remove,
                strategy=args.strategy, host=args.host or local_ip(), topics=args.topics)
    if args.json:
        print(json.dumps(w.to_json(), indent=2))
        return 0
    now = ",".join(w.current_strategies) or "none explains the current owners"
    print(f"group {w.group}: strategy {w.strategy} (current owners fit: {now}); "
          f"{len(w.members)} -> {len(w.new_members)} member(s)"
          + (f", adding {' '.join(w.added)}" if w.added else "")
          + (f", removing {' '.join(w.removed)}" if w.removed else ""))
    now_load: dict[str, int] = {}
    for per in w.current.values():
        for m, ps in per.items():
            now_load[m] = now_load.get(m, 0) + len(ps)
    members = list(dict.fromkeys([*w.new_members, *w.members, *now_load]))
    print(_table(["member", "now", "after", "change"],
                 [[m, now_load.get(m, 0), w.load.get(m, 0) if m in w.load else "gone",
                   "added" if m in w.added else "removed" if m in w.removed else None]
                  for m in members]))
    print()
    print(f"{w.moved} of {w.partitions} partition(s) move")
    if w.moves:
        print(_table(["topic", "partition", "from", "to"],
                     [[m.topic, m.partition, m.from_owner, m.to_owner] for m in w.moves]))
    for note in w.notes:
        print(f"note: {note}")
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
