"""``metaq consume``: one group member from the command line."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from metaq._cli._zkflags import add_zk_root_arg, add_zk_security_args, security_from_args
from metaq.consumer import STRATEGIES, ConsumerConfig, Message, MessageConsumer, Rewind

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "consume", help="join a consumer group and consume a topic",
        description="Join GROUP and consume TOPIC until --count messages (or forever). "
                    "SIGTERM/SIGINT close cleanly: commit, release partitions, unregister.")
    p.add_argument("--zk", required=True, metavar="HOST:PORT[/chroot]",
                   help="ZooKeeper connect string")
    p.add_argument("--group", required=True)
    p.add_argument("--topic", required=True, action="append",
                   help="topic to consume (repeatable)")
    p.add_argument("--count", type=int, default=None, metavar="N",
                   help="stop after N messages (default: run until signalled)")
    p.add_argument("--print", dest="print_", action="store_true",
                   help="write '<partition> <offset> <msgId> <body>' per message")
    add_zk_root_arg(p)
    p.add_argument("--consumer-id", default=None,
                   help="suffix of the consumer id (default ip-pid-uuid)")
    p.add_argument("--instance-id", default=None, metavar="NAME",
                   help="static membership: a name stable across restarts (consumer id "
                        "<group>_<NAME>); its partitions wait for it --static-grace seconds")
    p.add_argument("--static-grace", type=float, default=30.0, metavar="SECONDS",
                   help="how long a static member's partitions are held while it is away")
    p.add_argument("--leave", action="store_true",
                   help="with --instance-id: on exit leave the group for good (the others "
                        "rebalance at once) instead of having its partitions held")
    p.add_argument("--strategy", default="default", choices=sorted(STRATEGIES))
    p.add_argument("--start", default="earliest", choices=["earliest", "latest"],
                   help="where a group with no committed offset starts")
    p.add_argument("--read-from", default="master", choices=["master", "slave-preferred"],
                   help="read each broker id from its master when registered, else a slave "
                        "(master, as Java) or from a slave when one is registered")
    p.add_argument("--session-timeout", type=float, default=30.0, metavar="SECONDS")
    p.add_argument("--commit-period", type=float, default=5.0, metavar="SECONDS")
    p.add_argument("--fetch-runners", type=int, default=None, metavar="N")
    p.add_argument("--max-size", type=int, default=1024 * 1024, metavar="BYTES",
                   help="fetch size per request")
    add_zk_security_args(p)
    p.set_defaults(func=run)


def _line(m: Message) -> bytes:
    body = m.raw_body.replace(b"\\", b"\\\\").replace(b"\n", b"\\n").replace(b"\r", b"\\r")
    return b"%s %d %d %s\n" % (m.partition.encode(), m.offset, m.msg_id, body)


def run(args: argparse.Namespace) -> int:
    options = dict(consumer_id=args.consumer_id, instance_id=args.instance_id,
                   static_grace=args.static_grace, zk_root=args.zk_root, strategy=args.strategy,
                   start_position=args.start, zk_session_timeout=args.session_timeout,
                   commit_period=args.commit_period, zk_security=security_from_args(args),
                   read_from=args.read_from)
    if args.fetch_runners is not None:
        options["fetch_runner_count"] = args.fetch_runners
    if args.count is not None and args.count < 1:
        print("metaq consume: error: --count must be >= 1", file=sys.stderr)
        return 2
    config = ConsumerConfig(group=args.group, **options)
    done = threading.Event()
    lock = threading.Lock()
    state = {"n": 0}
    out = sys.stdout.buffer

    def listener(m: Message) -> None:
        with lock:
            if args.count is not None and state["n"] >= args.count:
                done.set()
                raise Rewind()  # leave it for the next member: not acked, not committed
            state["n"] += 1
            if args.print_:
                out.write(_line(m))
                out.flush()
            if args.count is not None and state["n"] >= args.count:
                done.set()

    def on_signal(signum: int, frame: object) -> None:
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    errors: list[BaseException] = []
    consumer = MessageConsumer(args.group, args.zk, config=config, on_error=errors.append)
    try:
        for topic in args.topic:
            consumer.subscribe(topic, listener, max_size=args.max_size)
        consumer.start()
        while not done.wait(0.5):
            if consumer.failed is not None:
                break
    finally:
        consumer.close(leave=args.leave)
    failed = consumer.failed
    for e in errors:
        if e is not failed:
            print(f"metaq consume: background error: {e}", file=sys.stderr)
    print(f"consumed {state['n']} messages", file=sys.stderr)
    if failed is not None:
        print(f"metaq consume: error: {failed}", file=sys.stderr)
        return 1
    return 0
