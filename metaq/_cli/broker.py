"""``metaq broker start``: run a Metaq-compatible broker in the foreground;
``metaq broker promote``: make a slave the master of its broker id.

Runs until SIGTERM or SIGINT, then unregisters from ZooKeeper, fsyncs the
logs and exits 0.  Once serving it prints one line to stdout::

    metaq broker <id> serving on <host>:<port>
"""

from __future__ import annotations

import argparse
import sys

import zk_layout
from metaq._cli._numbers import integer, number, size
from metaq._cli._zkflags import add_zk_root_arg, add_zk_security_args, security_from_args
from metaq._errors import ConfigError, CoordinationError
from metaq._zkclient import make_client
from metaq.broker import Broker, load_config, parse_topic_spec, promote

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "broker", help="run a Metaq 1.4-compatible broker",
        description="Run a Metaq 1.4-compatible broker (text protocol, segmented logs, "
                    "ZooKeeper registration).")
    sub = parser.add_subparsers(dest="broker_command", metavar="ACTION")
    sub.required = True
    start = sub.add_parser(
        "start", help="serve in the foreground until SIGTERM/SIGINT",
        description="Serve in the foreground until SIGTERM or SIGINT, then unregister and "
                    "exit 0.  Flags override the config file (TOML, keys named like the "
                    "flags with underscores, topics in a [topics] table).")
    start.add_argument("--config", metavar="FILE", help="TOML config file")
    start.add_argument("--id", dest="broker_id", type=integer, help="broker id, 0..1023")
    start.add_argument("--zk", dest="zk_connect", metavar="HOST:PORT[/CHROOT]",
                       help="ZooKeeper connect string (omit: do not register)")
    add_zk_root_arg(start, default=None, help="Metaq's root node (default /meta)")
    start.add_argument("--host", help="listen address (default 127.0.0.1)")
    start.add_argument("--port", type=integer, help="listen port (default 8123; 0 = any free)")
    start.add_argument("--advertised-host",
                       help="host written to ZooKeeper (default: --host, or this machine)")
    start.add_argument("--data-dir", help="directory of the topic logs")
    start.add_argument("--topic", dest="topics", action="append", default=[],
                       metavar="NAME[:PARTITIONS]", help="serve a topic (repeatable)")
    start.add_argument("--num-partitions", type=integer,
                       help="partitions of a topic given without a count (default 1)")
    start.add_argument("--auto-create-topics", action="store_true", default=None,
                       help="create unknown topics on their first put")
    start.add_argument("--group-commit", action="store_true",
                       help="fsync every put before acknowledging it (unflush threshold 0)")
    start.add_argument("--unflush-threshold", type=integer,
                       help="fsync after this many messages per partition (default 1000)")
    start.add_argument("--unflush-interval", type=number,
                       help="fsync pending messages at least every N seconds (default 10)")
    start.add_argument("--max-segment-size", type=size, help="segment file size (default 1G)")
    start.add_argument("--retention-hours", type=number,
                       help="delete segments older than this (default 168)")
    start.add_argument("--max-transfer-size", type=size,
                       help="largest get reply (default 1M)")
    start.add_argument("--max-message-size", type=size,
                       help="largest put payload accepted")
    start.add_argument("--correct-offsets", action="store_true", default=None,
                       help="answer gets past the end with 301 and the end")
    start.add_argument("--max-connections", type=integer,
                       help="most client connections (default 10000)")
    start.add_argument("--max-connections-per-address", type=integer,
                       help="most connections from one client address (default 1000)")
    start.add_argument("--request-timeout", type=number,
                       help="close a client whose request is incomplete after this many "
                            "seconds (default 30; 0: never)")
    start.add_argument("--idle-timeout", type=number,
                       help="close a client silent for this many seconds (default 600)")
    start.add_argument("--first-request-timeout", type=number,
                       help="close a client that sent no whole request this many seconds "
                            "after connecting (default 30; 0: never)")
    start.add_argument("--no-evict-unused-connections", dest="evict_unused_connections",
                       action="store_const", const=False, default=None,
                       help="at a connection limit refuse newcomers instead of closing "
                            "connections that never sent a request")
    start.add_argument("--max-hold", type=number,
                       help="longest a get at the log end may be held for a metaq-py client, "
                            "seconds (default 30; 0: answer at once, as Metaq does)")
    start.add_argument("--no-time-index", dest="time_index", action="store_const",
                       const=False, default=None,
                       help="do not offer the time index (clients then find offsets for a "
                            "time by searching the log, as against Java Metaq)")
    start.add_argument("--java", metavar="BEHAVIOURS", type=_java_behaviours, default={},
                       help="answer as a Java Metaq 1.4 broker does in these ways, for "
                            "interoperability tests (comma-separated: "
                            f"{', '.join(_JAVA)})")
    rep = start.add_argument_group("replication (README, \"Replication\")")
    rep.add_argument("--slave-of", type=integer, metavar="BROKER_ID",
                     help="start as a slave of this broker id (copies its master; sets --id)")
    rep.add_argument("--slave-id", type=integer, metavar="N",
                     help="this broker's replica number, slave<N> in ZooKeeper (default 1 "
                          "for a slave, 0 for a master)")
    rep.add_argument("--replication", choices=("async", "sync"),
                     help="acknowledge puts once in this log (async, default) or once every "
                          "in-sync slave has them (sync)")
    rep.add_argument("--replication-max-lag", type=number, metavar="SECONDS",
                     help="a slave not caught up for this long leaves the in-sync set "
                          "(default 5)")
    rep.add_argument("--no-in-sync", choices=("continue", "refuse"),
                     help="with sync replication and no slave in sync: continue alone "
                          "(default, reported) or refuse puts")
    rep.add_argument("--auto-promote", action="store_true", default=None,
                     help="as an in-sync slave, take over when the master's ZooKeeper "
                          "session ends")
    rep.add_argument("--copy-by", choices=("fetch", "sync"),
                     help="as a slave, pull the master's partitions (fetch, default) or store "
                          "the sync commands a Samsa-style Java master pushes (sync)")
    rep.add_argument("--zk-session-timeout", type=number, metavar="SECONDS",
                     help="ZooKeeper session timeout (default 10); a failover waits for it")
    add_zk_security_args(start)
    start.set_defaults(func=_start)

    promote = sub.add_parser(
        "promote", help="make a slave the master of its broker id",
        description="Name replica N (a slave, ZooKeeper's slave<N>) master of the broker id's "
                    "next epoch.  The slave stops copying, records its log ends as the epoch's "
                    "start and takes over once the old master let go (a live old master "
                    "steps down at once, cuts its logs back and follows).  Refused for a "
                    "slave that is not in sync unless --force.")
    promote.add_argument("broker_id", type=integer, help="the broker id")
    promote.add_argument("--replica", type=integer, required=True, metavar="N",
                         help="the replica to promote")
    promote.add_argument("--force", action="store_true",
                         help="promote even a slave that is not in sync (it loses what it "
                              "has not copied)")
    promote.add_argument("--zk", dest="zk_connect", metavar="HOST:PORT[/CHROOT]", required=True,
                         help="ZooKeeper connect string")
    add_zk_root_arg(promote)
    add_zk_security_args(promote)
    promote.set_defaults(func=_promote)


#: ``--java`` names -> BrokerConfig's java_* fields (README, "Running against an existing
#: Java Metaq cluster")
_JAVA = {"unwritten-404": "java_unwritten_404", "tell-max-offset": "java_tell_max_offset",
         "transfer-cap": "java_transfer_cap"}


def _java_behaviours(text: str) -> dict[str, bool]:
    out = {}
    for name in filter(None, (n.strip() for n in text.split(","))):
        if name not in _JAVA:
            raise argparse.ArgumentTypeError(
                f"unknown Java behaviour {name!r} (known: {', '.join(_JAVA)})")
        out[_JAVA[name]] = True
    return out


def _promote(args: argparse.Namespace) -> int:
    client = make_client(args.zk_connect, timeout=10.0, security=security_from_args(args))
    try:
        client.start(timeout=15.0)
    except Exception as e:  # noqa: BLE001 - reported as the CLI's error
        raise CoordinationError(f"cannot connect to ZooKeeper at {args.zk_connect}: {e}") \
            from None
    try:
        state = promote(client, zk_layout.Layout(args.zk_root), args.broker_id, args.replica,
                        force=args.force)
    finally:
        client.stop()
        client.close()
    print(f"broker {args.broker_id}: replica {state.master} named master of epoch "
          f"{state.epoch}; it takes over once the old master let go", flush=True)
    return 0


def _start(args: argparse.Namespace) -> int:
    if args.group_commit and args.unflush_threshold not in (None, 0):
        raise ConfigError("--group-commit and --unflush-threshold N > 0 contradict each other")
    topics = {}
    for spec in args.topics:
        name, n = parse_topic_spec(spec, args.num_partitions or 1)
        topics[name] = n
    broker_id = args.broker_id
    if args.slave_of is not None:
        if broker_id is not None and broker_id != args.slave_of:
            raise ConfigError(f"--slave-of {args.slave_of} and --id {broker_id} differ: a "
                              f"slave has its master's broker id")
        broker_id = args.slave_of
    config = load_config(
        args.config,
        slave_of=args.slave_of, slave_id=args.slave_id, replication=args.replication,
        replication_max_lag=args.replication_max_lag, no_in_sync=args.no_in_sync,
        auto_promote=args.auto_promote, copy_by=args.copy_by,
        zk_session_timeout=args.zk_session_timeout,
        broker_id=broker_id, zk_connect=args.zk_connect, zk_root=args.zk_root,
        host=args.host, port=args.port, advertised_host=args.advertised_host,
        data_dir=args.data_dir, topics=topics or None, num_partitions=args.num_partitions,
        auto_create_topics=args.auto_create_topics,
        unflush_threshold=0 if args.group_commit else args.unflush_threshold,
        unflush_interval=args.unflush_interval, max_segment_size=args.max_segment_size,
        retention_hours=args.retention_hours, max_transfer_size=args.max_transfer_size,
        max_message_size=args.max_message_size, correct_offsets=args.correct_offsets,
        max_hold=args.max_hold, time_index=args.time_index,
        max_connections=args.max_connections,
        max_connections_per_address=args.max_connections_per_address,
        request_timeout=args.request_timeout, idle_timeout=args.idle_timeout,
        first_request_timeout=args.first_request_timeout,
        evict_unused_connections=args.evict_unused_connections,
        zk_security=security_from_args(args), **args.java)

    def ready(broker: Broker) -> None:
        print(f"metaq broker {config.broker_id} serving on {config.host}:{broker.port}",
              flush=True)

    try:
        Broker(config).run_forever(on_ready=ready)
    except OSError as e:  # e.g. the port is taken
        print(f"metaq: error: broker {config.broker_id} cannot serve on "
              f"{config.host}:{config.port}: {e}", file=sys.stderr)
        return 1
    print(f"metaq broker {config.broker_id} stopped", file=sys.stderr, flush=True)
    return 0
