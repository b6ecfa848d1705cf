"""Transactional sends (issue 17) beside plain ``send_batch`` of the same run.

Setup: a real ZooKeeper (``metaq._zk`` launcher) and one broker process
(``python -m metaq broker start``, Metaq's default flush policy, or
``--group-commit``) serving topic ``bench`` with one partition.

Per run, in this order, each over ``--messages`` messages of ``--size`` bytes:

- **batch** (the baseline): ``Producer.send_batch`` of 100 messages at a time, every
  result read;
- **tx of N** for N in 1, 10, 100: ``with producer.transaction() as tx:`` N
  ``tx.send`` then the commit (BEGIN, N puts and COMMIT_ONE_PHASE written together to
  a ``+txpipe`` broker, then their answers: one round trip per transaction however big).

Reported: messages/s (medians of ``--runs``) and the ratio to the batch figure.
Every run checks the partition grew by exactly what was committed.

Run: ``.venv/bin/python bench/bench_transactions.py [--runs 3] [--messages 20000]``
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kazoo.client import KazooClient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
# the repository root too: else tests/zk_layout/ shadows zk_layout where that is found only
# through an editable install's finder (tests/README.md)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from helpers.procs import start_broker  # noqa: E402

from metaq import Producer  # noqa: E402
from metaq._zk import ZooKeeperServer  # noqa: E402

TOPIC = "bench"


def log_end(broker) -> int:  # noqa: ANN001
    with broker.connection() as c:
        return c.offset(TOPIC, "bench", 0, 2**63 - 1)


def run_batch(producer: Producer, body: bytes, n: int) -> float:
    t = time.perf_counter()
    for lo in range(0, n, 100):
        list(producer.send_batch(TOPIC, [body] * min(100, n - lo)).result(60))
    return n / (time.perf_counter() - t)


def run_tx(producer: Producer, body: bytes, n: int, size: int) -> float:
    t = time.perf_counter()
    for lo in range(0, n, size):
        with producer.transaction() as tx:
            for _ in range(min(size, n - lo)):
                tx.send(TOPIC, body)
    return n / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--group-commit", action="store_true")
    args = ap.parse_args()
    body = b"x" * args.size
    tmp = Path(tempfile.mkdtemp(prefix="metaq-bench-tx-"))
    rates: dict[str, list[float]] = {}
    try:
        with ZooKeeperServer(data_dir=tmp / "zk") as zk:
            admin = KazooClient(hosts=zk.hosts)
            admin.start(30)
            admin.ensure_path("/bench")
            admin.stop()
            admin.close()
            zk_connect = zk.hosts + "/bench"
            broker = start_broker(zk_connect, 0, tmp / "broker", {TOPIC: 1},
                                  group_commit=args.group_commit, zk_session_timeout=30.0)
            try:
                with Producer(zk_connect, send_timeout=30.0) as producer:
                    run_batch(producer, body, 2000)  # warm-up
                    run_tx(producer, body, 2000, 10)
                    for _ in range(args.runs):
                        for name, fn in (("batch", lambda: run_batch(producer, body,
                                                                      args.messages)),
                                         *((f"tx of {k}", lambda k=k: run_tx(
                                             producer, body, args.messages, k))
                                           for k in (1, 10, 100))):
                            n = args.messages
                            # tx of 1 is slow: a tenth of the messages keeps runs short
                            if name == "tx of 1":
                                n = args.messages // 10
                                fn = lambda n=n: run_tx(producer, body, n, 1)  # noqa: E731
                            before = log_end(broker)
                            rates.setdefault(name, []).append(fn())
                            grew = log_end(broker) - before
                            assert grew == n * (20 + args.size), (name, grew)
            finally:
                broker.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    base = statistics.median(rates["batch"])
    policy = "group commit" if args.group_commit else "default flush"
    print(f"{args.size} B messages, {policy}, medians of {args.runs} runs")
    print("| client | msgs/s | vs send_batch |")
    print("|---|---:|---:|")
    for name, values in rates.items():
        m = statistics.median(values)
        print(f"| {name} | {m:,.0f} | {m / base:.3f} |")


if __name__ == "__main__":
    main()
