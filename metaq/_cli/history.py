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
    InvalidNameError,
    Layout,
    history_to_json,
    parse_since,
    read_history,
    render_history,
    select_history,
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
    try:
        group_path = layout.group(args.group)
    except InvalidNameError as e:
        raise ConfigError(f"group: {e}") from None
    with connect(args) as client:
        if client.exists(group_path) is None:
            raise ConfigError(f"no consumer group {args.group!r} under "
                              f"{layout.consumer_groups()}")
        records, timeline = select_history(read_history(client, layout, args.group),
                                           since=since, partition=args.partition)
    if args.json:
        print(json.dumps(history_to_json(args.group, records, timeline), indent=2))
        return 0
    print(render_history(records, timeline if args.partition else None))
    return 0
