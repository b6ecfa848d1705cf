"""Rebalance settle time: 8 consumers over 64 partitions, a graceful join and a graceful leave.

Settled = every partition owned by exactly one member and every member STABLE
(claimed and fetching).  Timed from the joiner's ``start()`` / the leaver's
``close()`` call until settled, polled every millisecond.

In-run baseline (the raw limit): one kazoo client doing the least ZooKeeper
work any rebalance of that size needs, sequentially — read the member list,
delete the moved owner nodes and create them again — so the ratio shows what
our coordination costs on top of ZooKeeper's own round trips.

Run: ``.venv/bin/python bench/bench_rebalance.py [--runs 7]``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

from kazoo.client import KazooClient

from metaq import MessageConsumer
from metaq._zk import ZooKeeperServer
from metaq.consumer import State
from zk_layout import Layout, TopicBroker, encode_topic_broker

L = Layout()
TOPIC = "bench"
BROKERS, PARTS_PER_BROKER, MEMBERS = 2, 32, 8


def settled(consumers: list[MessageConsumer], parts: set[str]) -> bool:
    owned = [p for c in consumers for p in c.assignment().get(TOPIC, [])]
    return (len(owned) == len(parts) and set(owned) == parts
            and all(c.state is State.STABLE for c in consumers))


def wait_settled(consumers: list[MessageConsumer], parts: set[str], timeout: float = 20) -> float:
    start = time.perf_counter()
    while not settled(consumers, parts):
        if time.perf_counter() - start > timeout:
            state = {c.consumer_id: (c.state.value, c.generation, c.assignment(), c.waiting())
                     for c in consumers}
            raise TimeoutError(f"group did not settle: {state}")
        time.sleep(0.001)
    return time.perf_counter()


def one_run(hosts: str, run: int, strategy: str) -> tuple[float, float, float]:
    chroot = f"/bench-{strategy}-{run}"
    admin = KazooClient(hosts=hosts)
    admin.start()
    admin.ensure_path(chroot)
    admin.stop()
    zk = hosts + chroot
    client = KazooClient(hosts=zk)
    client.start()
    for b in range(BROKERS):
        client.create(L.topic_sub(TOPIC, b),
                      encode_topic_broker(TopicBroker(num_parts=PARTS_PER_BROKER, broker_id=b)),
                      makepath=True)
    parts = {f"{b}-{i}" for b in range(BROKERS) for i in range(PARTS_PER_BROKER)}

    def member(i: int) -> MessageConsumer:
        c = MessageConsumer("g", zk, consumer_id=f"m{i}", strategy=strategy,
                            fetch_runner_count=1, commit_period=60.0)
        c.subscribe(TOPIC, lambda m: None)
        return c

    members = [member(i) for i in range(MEMBERS - 1)]
    for c in members:
        c.start()
    wait_settled(members, parts)
    joiner = member(MEMBERS - 1)
    t0 = time.perf_counter()
    joiner.start()
    members.append(joiner)
    join = wait_settled(members, parts) - t0
    leaver = members.pop(0)
    t0 = time.perf_counter()
    leaver.close()
    leave = wait_settled(members, parts) - t0

    # baseline: the bare ZooKeeper work of moving P/C partitions, one client, sequential
    moved = len(parts) // MEMBERS
    t0 = time.perf_counter()
    client.get_children(L.consumer_ids("g"))
    for p in sorted(parts)[:moved]:
        path = L.owner("g-baseline", TOPIC, p)
        client.create(path, b"x", ephemeral=True, makepath=True)
    for p in sorted(parts)[:moved]:
        client.delete(L.owner("g-baseline", TOPIC, p))
    base = time.perf_counter() - t0
    for c in members:
        c.close()
    client.stop()
    client.close()
    return join, leave, base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with ZooKeeperServer() as zk:
        print(f"rebalance settle, {MEMBERS} consumers x {BROKERS * PARTS_PER_BROKER} partitions, "
              f"{args.runs} runs, medians")
        print(f"{'strategy':<10} {'join ms':>9} {'leave ms':>9} {'zk floor ms':>12} "
              f"{'join/floor':>11} {'leave/floor':>12}")
        for strategy in ("default", "sticky"):
            runs = [one_run(zk.hosts, r, strategy) for r in range(args.runs)]
            join = statistics.median(r[0] for r in runs) * 1000
            leave = statistics.median(r[1] for r in runs) * 1000
            base = statistics.median(r[2] for r in runs) * 1000
            print(f"{strategy:<10} {join:>9.1f} {leave:>9.1f} {base:>12.1f} "
                  f"{join / base:>10.1f}x {leave / base:>11.1f}x")


if __name__ == "__main__":
    main()
