"""Concurrent vs orderly consumption with an I/O-bound listener (1 ms sleep per message).

One consumer drains N messages already in one broker process (timed from the first
delivery to the last, so joining the group is not counted); the listener sleeps
1 ms per message (an I/O call).  Orderly mode handles a partition's messages one
at a time; concurrent mode hands them to ``consume_threads`` workers.  The in-run
baseline is orderly mode on the same data with the same listener; the figure is
the ratio.  Reported for a 1-partition topic (orderly is strictly serial there)
and a 4-partition topic (orderly runs one message per fetch runner at a time).

Run: ``.venv/bin/python bench/bench_concurrent.py [--runs 3] [--messages 4000]``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from metaq import MessageConsumer, Producer
from metaq._zk import ZooKeeperServer, free_port


def drain(zk: str, topic: str, group: str, n: int, mode: str, threads: int) -> float:
    done = threading.Event()
    count = [0]
    lock = threading.Lock()

    first = [0.0]

    def listener(m) -> None:
        if not first[0]:
            first[0] = time.perf_counter()
        time.sleep(0.001)
        with lock:
            count[0] += 1
            if count[0] == n:
                first.append(time.perf_counter())
                done.set()

    c = MessageConsumer(group, zk, consume_mode=mode, consume_threads=threads,
                        commit_period=1.0, recover_dir=tempfile.mkdtemp())
    c.subscribe(topic, listener)
    with c:
        c.start()
        if not done.wait(300):
            raise TimeoutError(f"{mode}: only {count[0]} of {n} in 300 s")
    return n / (first[1] - first[0])  # first delivery to last: start-up not counted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--messages", type=int, default=4000)
    ap.add_argument("--threads", type=int, default=16)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    base = Path(tempfile.mkdtemp(prefix="bench-conc-"))
    with ZooKeeperServer(data_dir=base / "zk") as zk:
        port = free_port()
        broker = subprocess.Popen(
            [sys.executable, "-m", "metaq", "broker", "start", "--zk", zk.hosts, "--id", "0",
             "--port", str(port), "--data-dir", str(base / "b0"), "--topic", "one:1",
             "--topic", "four:4"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            from kazoo.client import KazooClient

            from metaq.testing import wait_until
            from zk_layout import Layout

            kz = KazooClient(hosts=zk.hosts)
            kz.start()
            wait_until(lambda: all(kz.exists(Layout().topic_pub(t, 0)) for t in ("one", "four")),
                       timeout=60, what="broker registered")
            kz.stop()
            with Producer(zk.hosts) as p:
                for topic in ("one", "four"):
                    for f in [p.send_async(topic, b"x" * 100) for _ in range(args.messages)]:
                        f.result(timeout=60)
            print(f"{args.messages} messages, listener sleeps 1 ms, {args.runs} runs, "
                  f"medians (fetch runners: default = CPU count)")
            print(f"{'topic':<12} {'orderly msg/s':>14} {'concurrent msg/s':>17} "
                  f"{'ratio':>7}")
            run = 0
            for topic, parts in (("one", 1), ("four", 4)):
                o, c = [], []
                for _ in range(args.runs):
                    run += 1
                    o.append(drain(zk.hosts, topic, f"o{run}", args.messages, "orderly", 1))
                    c.append(drain(zk.hosts, topic, f"c{run}", args.messages, "concurrent",
                                   args.threads))
                om, cm = statistics.median(o), statistics.median(c)
                print(f"{topic + f' ({parts}p)':<12} {om:>14,.0f} {cm:>17,.0f} "
                      f"{cm / om:>6.1f}x  ({args.threads} workers)")
        finally:
            broker.terminate()
            broker.wait(30)


if __name__ == "__main__":
    main()
