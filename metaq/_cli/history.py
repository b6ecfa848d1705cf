"""``metaq group history GROUP [--since T] [--partition P] [--json]``: the group's
rebalance history (``consumers/<group>/history/<consumerId>``, see
:mod:`zk_layout._history`), every member's records merged by time and, with
``--partition``, who held that partition when and why it moved.

Registered under ``metaq group`` by :mod:`metaq._cli.group`.  Exit codes as the
other group commands: 0 done, 1 ZooKeeper failed, 2 bad arguments or no such group.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from contextlib import AbstractContextManager

from kazoo.client import KazooClient

from metaq._errors import ConfigError
from zk_layout import (
    Layout,
    ownership_timeline,
    parse_since,
    read_history,
    render_history,
    timeline_to_json,
)

__all__ = ["add_history_parser"]


def add_history_parser(actions: argparse._SubParsersAction,
                       common: Callable[[argparse.ArgumentParser], None],
                       connect: Callable[[argparse.Namespace],
                                         AbstractContextManager[KazooClient]]) -> None:
    """``history`` under ``metaq group``: ``common`` adds the group commands' flags,
    ``connect`` opens their ZooKeeper client."""
    p = actions.add_parser(
        "history", help="the group's rebalance history: per rebalance of each member its "
                        "trigger (member joined or left, partitions or broker changed, "
                        "session expired, ...), what it released and claimed, how long it "
                        "took; with --partition, who held it when and why it moved")
    common(p)
    p.add_argument("group")
    p.add_argument("--since", metavar="T",
                   help="only rebalances since T: a duration back from now (30s, 10m, 2h, "
                        "1d), ISO-8601 (2026-11-25T14:00:00Z) or epoch ms")
    p.add_argument("--partition", metavar="P",
                   help="only this partition (topic/0-3, or 0-3 in any topic), with its "
                        "ownership timeline")
    p.add_argument("--json", action="store_true",
                   help='{"group", "records": [...], "timeline": {partition: [...]}}')
    p.set_defaults(func=lambda args: group_history(args, connect))


def group_history(args: argparse.Namespace,
                  connect: Callable[[argparse.Namespace],
                                    AbstractContextManager[KazooClient]]) -> int:
    since = None
    if args.since is not None:
        try:
            since = parse_since(args.since)
        except ValueError as e:
            raise ConfigError(f"--since: {e}") from None
    layout = Layout(args.zk_root)
    with connect(args) as client:
        if client.exists(layout.group(args.group)) is None:
            raise ConfigError(f"no consumer group {args.group!r} under "
                              f"{layout.consumer_groups()}")
        everything = read_history(client, layout, args.group)
    # the timeline needs the records before --since (who held it when the window opens)
    timeline = ownership_timeline(everything)
    records = [r for r in everything if since is None or r.end_ms >= since]
    if args.partition:
        wanted = args.partition
        records = [r for r in records if r.damaged or r.touches(wanted)]
        timeline = {p: ivs for p, ivs in timeline.items()
                    if p == wanted or ("/" not in wanted and p.rsplit("/", 1)[-1] == wanted)}
    if since is not None:
        timeline = {p: kept for p, ivs in timeline.items()
                    if (kept := [i for i in ivs if i.end_ms is None or i.end_ms >= since])}
    if args.json:
        print(json.dumps({"group": args.group, "records": [r.to_json() for r in records],
                          "timeline": timeline_to_json(timeline)}, indent=2))
        return 0
    print(render_history(records, timeline if args.partition else None))
    return 0
