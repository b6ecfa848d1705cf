"""Orderly mode keeps per-partition order over 100,000 messages through rebalances."""

from __future__ import annotations

from collections import defaultdict

import pytest
from helpers.procs import start_broker
from test_consumer_e2e import ConsumerProc  # the `metaq consume --print` process wrapper

from metaq import Producer
from metaq.testing import wait_until

pytestmark = pytest.mark.broker

TOPIC = "events"  # ConsumerProc consumes this topic in group "g"
N = 100_000


def test_per_partition_order_over_100k_messages_with_rebalances(zk_connect, tmp_path):
    brokers = [start_broker(zk_connect, b, tmp_path / f"b{b}", {TOPIC: 4}) for b in (0, 1)]
    members: list[ConsumerProc] = []
    try:
        with Producer(zk_connect) as p:
            acked = [f.result(timeout=60) for f in
                     [p.send_async(TOPIC, b"%d" % i) for i in range(N)]]
        seq_of = {(r.partition, r.offset): i for i, r in enumerate(acked)}
        members.append(ConsumerProc(zk_connect, "o1", tmp_path))
        members.append(ConsumerProc(zk_connect, "o2", tmp_path))

        def total() -> int:
            return len({(p, o) for m in members for p, o, _, _ in m.lines})

        wait_until(lambda: total() > N // 4, timeout=120, what="a quarter consumed")
        members.append(ConsumerProc(zk_connect, "o3", tmp_path))  # join: rebalance
        wait_until(lambda: total() > N // 2, timeout=120, what="half consumed")
        assert members[0].stop() == 0  # leave: rebalance
        wait_until(lambda: total() == N, timeout=180, what="everything consumed")
    finally:
        for m in members:
            if m.proc.poll() is None:
                m.stop()
        for b in brokers:
            b.stop()
    for m in members:
        runs: dict[str, list[int]] = defaultdict(list)
        for part, offset, _, body in m.lines:
            assert seq_of[(part, offset)] == int(body)  # the right bytes at that offset
            runs[part].append(offset)
        for part, offs in runs.items():
            # a member may lose a partition and get it back later; within its deliveries,
            # offsets only ever go forward except when it restarts from the commit
            backs = [(a, b) for a, b in zip(offs, offs[1:], strict=False) if b <= a]
            assert len(backs) <= 2, (m.name, part, backs[:5])
    got = {(p, o) for m in members for p, o, _, _ in m.lines}
    assert got == set(seq_of)
