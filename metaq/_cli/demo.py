"""``metaq demo``: the whole system on this machine, start to finish, in under a minute.

Starts the embedded ZooKeeper and two broker processes in a temporary
directory, creates an 8-partition topic (4 on each broker), produces messages
with a progress bar, runs a group of 3 consumers, shows the assignment, stops
one consumer and shows the rebalance, drains everything, prints the
per-partition table (owner, committed offset, log end, lag) and stops it all.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from kazoo.client import KazooClient

from metaq._admin import describe_group
from metaq._zk import ZooKeeperServer, free_port
from metaq.consumer import MessageConsumer, State
from metaq.producer import Producer
from zk_layout import Layout

__all__ = ["register"]

TOPIC, GROUP = "demo", "demo-group"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run ZooKeeper, 2 brokers, a producer and 3 consumers",
                       description=__doc__.split("\n\n")[1])
    p.add_argument("--messages", type=int, default=20000, help="messages to produce")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    p.set_defaults(func=run)


def _say(text: str = "") -> None:
    print(text, flush=True)


def _table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [headers] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


#: Single messages sent one at a time for the demo's latency line.
LATENCY_MESSAGES = 20


def _progress(done: int, total: int, started: float) -> None:
    width = 30
    filled = width * done // max(total, 1)
    rate = done / max(time.monotonic() - started, 1e-6)
    line = f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{total}  {rate:,.0f} msg/s"
    if sys.stdout.isatty() or done == total:
        print(line, end="\n" if done == total else "", flush=True)


class _Broker:
    def __init__(self, zk: str, broker_id: int, base: Path) -> None:
        self.broker_id = broker_id
        self.port = free_port()
        self.log = base / f"broker{broker_id}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "metaq", "broker", "start", "--zk", zk, "--id",
                 str(broker_id), "--port", str(self.port), "--data-dir",
                 str(base / f"broker{broker_id}"), "--topic", f"{TOPIC}:4"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(20)


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"demo: timed out waiting for {what}")
        time.sleep(0.05)


def run(args: argparse.Namespace) -> int:
    base = Path(tempfile.mkdtemp(prefix="metaq-demo-"))
    layout = Layout()
    brokers: list[_Broker] = []
    consumers: list[MessageConsumer] = []
    consumed = [0]
    lock = threading.Lock()
    zk: ZooKeeperServer | None = None
    client: KazooClient | None = None
    codes: list[int] = []
    t0 = time.monotonic()
    try:
        _say(f"== metaq demo in {base}")
        zk = ZooKeeperServer(data_dir=base / "zk").start()
        _say(f"ZooKeeper serving at {zk.hosts} (pid {zk.pid})")
        client = KazooClient(hosts=zk.hosts)
        client.start(timeout=30)
        brokers = [_Broker(zk.hosts, i, base) for i in (0, 1)]
        _wait(lambda: len(client.get_children(layout.topic_pub_dir(TOPIC))
                          if client.exists(layout.topic_pub_dir(TOPIC)) else []) == 2,
              30, "both brokers to register")
        _say(f"brokers 0 and 1 serving topic '{TOPIC}' with 4 partitions each "
             f"(ports {brokers[0].port}, {brokers[1].port})")

        _say(f"\n== producing {args.messages} messages")
        started = time.monotonic()
        with Producer(zk.hosts) as producer:
            futures = []
            for i in range(args.messages):
                futures.append(producer.send_async(TOPIC, f"message {i}".encode()))
                if i % 2000 == 1999 and i + 1 < args.messages:
                    _progress(i + 1, args.messages, started)
            for f in futures:
                f.result(timeout=30)
        _progress(args.messages, args.messages, started)

        latencies: list[float] = []

        def listener(message) -> None:
            body = message.body
            if body[:8] == b"latency ":
                with lock:
                    latencies.append(time.monotonic() - float(body[8:]))
                return
            with lock:
                consumed[0] += 1

        _say(f"\n== starting 3 consumers in group '{GROUP}'")
        for name in ("alice", "bob", "carol"):
            c = MessageConsumer(GROUP, zk.hosts, consumer_id=name, commit_period=0.5,
                                fetch_runner_count=2)
            c.subscribe(TOPIC, listener)
            consumers.append(c.start())

        def settled() -> bool:
            owned = sorted(p for c in consumers for p in c.assignment().get(TOPIC, []))
            return len(owned) == 8 and all(c.state is State.STABLE for c in consumers)

        _wait(settled, 30, "the group to settle")
        _say(_table(["consumer", "partitions"],
                    [[c.consumer_id, " ".join(c.assignment().get(TOPIC, []))]
                     for c in consumers]))

        leaving = consumers.pop(1)
        _say(f"\n== stopping {leaving.consumer_id}: its partitions move to the others")
        t_leave = time.monotonic()
        leaving.close()
        _wait(settled, 30, "the group to settle after the leave")
        _say(_table(["consumer", "partitions"],
                    [[c.consumer_id, " ".join(c.assignment().get(TOPIC, []))]
                     for c in consumers]))
        _say(f"rebalanced in {(time.monotonic() - t_leave) * 1000:.0f} ms")

        _say("\n== draining")

        def drained() -> bool:
            report = describe_group(client, layout, GROUP)
            return bool(report.partitions) and all(p.lag == 0 for p in report.partitions)

        _wait(drained, 60, "every partition to be consumed and committed")
        report = describe_group(client, layout, GROUP)
        _say(_table(["partition", "owner", "committed", "log end", "lag", "state"],
                    [[p.partition, p.owner, p.committed, p.log_end, p.lag, p.state]
                     for p in report.partitions]))
        _say(f"consumed {consumed[0]} deliveries of {args.messages} messages "
             f"(a stopped member's uncommitted ones are delivered again: at least once)")

        _say("\n== latency: single messages into the idle group, send -> listener")
        with Producer(zk.hosts) as producer:
            for i in range(LATENCY_MESSAGES):
                producer.send(TOPIC, b"latency %r" % time.monotonic())
                _wait(lambda n=i + 1: len(latencies) >= n, 10, "a latency message")
        ms = sorted(x * 1000 for x in latencies)
        _say(f"{len(ms)} messages: median {ms[len(ms) // 2]:.2f} ms, max {ms[-1]:.2f} ms "
             f"(the brokers hold the consumers' fetches: no polling delay)")
    finally:
        for c in consumers:
            c.close()
        codes = [b.stop() for b in brokers]
        if client is not None:
            client.stop()
            client.close()
        if zk is not None:
            zk.stop()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    _say(f"\n== stopped everything (brokers exited {codes}) in {time.monotonic() - t0:.1f} s")
    return 0
