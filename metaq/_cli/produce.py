"""``metaq produce``: send messages to a topic from the command line.

One message per line of standard input (or of ``--file``), or ``--count N``
generated messages of ``--size B`` bytes.  Messages are pipelined
(``Producer.send_async``); the last line printed is::

    acknowledged N of M messages

and the exit code is 1 when some message was not acknowledged (the reasons
go to stderr), 0 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import BinaryIO

from metaq._cli._numbers import non_negative_int, positive_float
from metaq._cli._zkflags import add_zk_root_arg
from metaq._errors import ConfigError, MetaqError
from metaq.producer import Producer, ProducerConfig, SendResult

__all__ = ["register", "generated", "lines"]

#: Most futures kept before waiting for the oldest (bounds memory, not speed).
_WINDOW = 100_000


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "produce", help="send messages to a topic (one per input line)",
        description="Send one message per line of standard input (the newline, and a CR "
                    "before it, removed), or of --file, or --count generated messages of "
                    "--size bytes.  Messages are pipelined.  The last line printed is "
                    "'acknowledged N of M messages'; exit 1 when N < M.")
    p.add_argument("--zk", required=True, metavar="HOST:PORT[/CHROOT]",
                   help="ZooKeeper connect string")
    p.add_argument("--topic", required=True)
    add_zk_root_arg(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--file", metavar="FILE", help="read lines from FILE instead of stdin")
    src.add_argument("--count", type=non_negative_int, metavar="N",
                     help="send N generated messages instead of reading lines")
    p.add_argument("--size", type=non_negative_int, default=None, metavar="BYTES",
                   help="body size of generated messages (default 100)")
    p.add_argument("--attribute", default=None, help="attribute string of every message")
    p.add_argument("--key", default=None,
                   help="partition key of every message (implies --partitioner hash)")
    p.add_argument("--partitioner", choices=["roundrobin", "hash"], default=None,
                   help="default roundrobin, or hash when --key is given")
    p.add_argument("--send-timeout", type=positive_float, default=3.0, metavar="SECONDS",
                   help="total time per message, retries included (default %(default)s)")
    p.add_argument("--retries", type=non_negative_int, default=2,
                   help="retries on another partition (default %(default)s)")
    p.add_argument("--max-in-flight", type=non_negative_int, default=16384, metavar="N",
                   help="most messages in flight per broker (default %(default)s)")
    p.add_argument("--sync", action="store_true",
                   help="send one message at a time, waiting for each acknowledgement")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar and the rate on stderr (default: when it is a tty)")
    p.add_argument("--print", dest="print_", action="store_true",
                   help="print '<partition> <offset> <msgId>' per acknowledged message")
    p.set_defaults(func=run)


def lines(stream: BinaryIO) -> Iterator[bytes]:
    """Each line of ``stream`` without its ``\\n`` (and a ``\\r`` before it)."""
    for line in stream:
        if line.endswith(b"\n"):
            line = line[:-2] if line.endswith(b"\r\n") else line[:-1]
        yield line


def _progress(acked: int, sent: int, total: int | None, started: float, *,
              final: bool = False) -> None:
    """One self-overwriting status line on stderr: a bar when the total is known."""
    rate = acked / max(time.monotonic() - started, 1e-6)
    if total:
        filled = 30 * sent // total
        head = f"[{'#' * filled}{'.' * (30 - filled)}] {sent}/{total}"
    else:
        head = f"sent {sent}"
    sys.stderr.write(f"\r{head}  acknowledged {acked}  {rate:,.0f} msg/s"
                     + ("\n" if final else ""))
    sys.stderr.flush()


def generated(count: int, size: int) -> Iterator[bytes]:
    """``count`` distinct bodies of exactly ``size`` bytes: ``"<n> xxx..."``."""
    for i in range(count):
        head = b"%d " % i
        yield (head + b"x" * (size - len(head)))[:size]


class _Tally:
    def __init__(self, print_results: bool) -> None:
        self.sent = 0
        self.acked = 0
        self.errors: collections.Counter[str] = collections.Counter()
        self.examples: dict[str, str] = {}
        self.print_results = print_results
        self.out = sys.stdout

    def error(self, e: BaseException) -> None:
        kind = type(e).__name__
        self.errors[kind] += 1
        self.examples.setdefault(kind, str(e))

    def settle(self, fut: Future) -> None:
        try:
            r = fut.result()
        except MetaqError as e:
            self.error(e)
            return
        self.acked_one(r)

    def acked_one(self, r: SendResult) -> None:
        self.acked += 1
        if self.print_results:
            self.out.write(f"{r.partition} {r.offset} {r.msg_id}\n")


def run(args: argparse.Namespace) -> int:
    if args.count is None and args.size is not None:
        raise ConfigError("--size only applies to generated messages (--count)")
    partitioner = args.partitioner or ("hash" if args.key is not None else "roundrobin")
    config = ProducerConfig(zk_root=args.zk_root, send_timeout=args.send_timeout,
                            retries=args.retries, partitioner=partitioner, codec="bytes",
                            max_in_flight=max(1, args.max_in_flight))
    if args.count is not None:
        source: Iterator[bytes] = generated(args.count, 100 if args.size is None else args.size)
        stream = None
    elif args.file is not None:
        try:
            stream = open(args.file, "rb")  # noqa: SIM115 - closed below
        except OSError as e:
            raise ConfigError(f"cannot read --file {args.file}: {e}") from None
        source = lines(stream)
    else:
        stream = None
        source = lines(sys.stdin.buffer)
    tally = _Tally(args.print_)
    started = time.monotonic()
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    next_show = started + 0.5
    try:
        with Producer(args.zk, config=config) as producer:
            window: collections.deque[Future] = collections.deque()
            for body in source:
                tally.sent += 1
                if show and not tally.sent % 1000 and time.monotonic() >= next_show:
                    next_show = time.monotonic() + 0.5
                    _progress(tally.acked, tally.sent, args.count, started)
                if args.sync:
                    try:
                        tally.acked_one(producer.send(args.topic, body, args.attribute,
                                                      args.key))
                    except MetaqError as e:
                        tally.error(e)
                    continue
                try:
                    fut = producer.send_async(args.topic, body, args.attribute, args.key)
                except MetaqError as e:
                    tally.error(e)
                    continue
                window.append(fut)
                if len(window) >= _WINDOW:
                    tally.settle(window.popleft())
                while window and window[0].done():
                    tally.settle(window.popleft())
            while window:
                tally.settle(window.popleft())
    finally:
        if stream is not None:
            stream.close()
    elapsed = time.monotonic() - started
    if show:
        _progress(tally.acked, tally.sent, args.count, started, final=True)
    for kind, n in tally.errors.most_common():
        print(f"metaq produce: {n} message(s) failed with {kind}: {tally.examples[kind]}",
              file=sys.stderr)
    rate = tally.acked / elapsed if elapsed > 0 else 0.0
    print(f"metaq produce: {elapsed:.2f}s, {rate:,.0f} msg/s", file=sys.stderr)
    print(f"acknowledged {tally.acked} of {tally.sent} messages", flush=True)
    return 0 if tally.acked == tally.sent else 1
