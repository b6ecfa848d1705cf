"""Consumer groups end to end: real ZooKeeper, broker processes, consumer processes.

Every message carries a unique sequence number as its body.  Consumers are
``metaq consume --print`` subprocesses; their stdout lines
``<partition> <offset> <msgId> <body>`` are what they delivered.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from helpers.audit import OwnerAudit
from kazoo.client import KazooClient

from metaq import MessageConsumer, Producer
from metaq.testing import ZkProxy, wait_until
from zk_layout import Layout, decode_offset

pytestmark = pytest.mark.broker

L = Layout()
TOPIC = "events"
GROUP = "g"


class ConsumerProc:
    def __init__(self, zk: str, name: str, log_dir: Path, *extra: str,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.lines: list[tuple[str, int, int, str]] = []
        self.lock = threading.Lock()
        self.stderr_path = log_dir / f"consumer-{name}.log"
        args = [sys.executable, "-m", "metaq", "consume", "--zk", zk, "--group", GROUP,
                "--topic", TOPIC, "--print", "--consumer-id", name, "--session-timeout", "4",
                "--commit-period", "0.2", "--fetch-runners", "2", *extra]
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err,
                                         stdin=subprocess.DEVNULL,
                                         env={**os.environ, **(env or {})})
        self.reader = threading.Thread(target=self._read, name=f"reader-{name}", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            part, offset, msg_id, body = raw.decode().rstrip("\n").split(" ", 3)
            with self.lock:
                self.lines.append((part, int(offset), int(msg_id), body))

    def bodies(self) -> list[str]:
        with self.lock:
            return [x[3] for x in self.lines]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(60)
        self.reader.join(10)
        return code

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.reader.join(10)

    def log(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-3000:]


def produce(zk: str, start: int, count: int) -> dict[str, int]:
    """Send bodies start..start+count-1; return {partition: acknowledged count}."""
    per_part: Counter[str] = Counter()
    with Producer(zk) as producer:
        futures = [producer.send_async(TOPIC, str(i).encode()) for i in range(start, start + count)]
        for f in futures:
            per_part[f.result(timeout=30).partition] += 1
    return dict(per_part)


def log_ends(brokers) -> dict[str, int]:
    ends = {}
    for b in brokers:
        with b.connection() as conn:
            for i in range(4):
                ends[f"{b.broker_id}-{i}"] = conn.offset(TOPIC, GROUP, i, 2**63 - 1)
    return ends


def committed(client: KazooClient) -> dict[str, int]:
    d = L.offsets_dir(GROUP, TOPIC)
    if not client.exists(d):
        return {}
    return {p: decode_offset(client.get(f"{d}/{p}")[0]).offset for p in client.get_children(d)}


@pytest.fixture
def brokers(zk_connect, broker_factory):
    return [broker_factory({TOPIC: 4}, broker_id=b, zk_connect=zk_connect, process=True)
            for b in (0, 1)]


@pytest.fixture
def consumers():
    procs: list[ConsumerProc] = []
    yield procs
    for p in procs:
        if p.proc.poll() is None:
            p.kill()


def test_three_consumers_consume_everything_once_with_one_owner_per_partition(
        zk_connect, zk_client, brokers, consumers, tmp_path):
    audit = OwnerAudit(zk_client, GROUP, TOPIC)
    for name in ("c1", "c2"):
        consumers.append(ConsumerProc(zk_connect, name, tmp_path))
    # the third member runs the pure-Python loops (no C speedups): a mixed group
    consumers.append(ConsumerProc(zk_connect, "c3", tmp_path, env={"METAQ_NO_SPEEDUPS": "1"}))
    wait_until(lambda: len(audit.owners()) == 8 and set(audit.owners().values()) ==
               {f"{GROUP}_c1", f"{GROUP}_c2", f"{GROUP}_c3"}, timeout=60,
               what="three members owning all 8 partitions")
    produce(zk_connect, 0, 3000)
    expected = {str(i) for i in range(3000)}
    wait_until(lambda: {b for c in consumers for b in c.bodies()} >= expected, timeout=60,
               what="every message consumed")
    ends = log_ends(brokers)
    wait_until(lambda: committed(zk_client) == ends, timeout=30,
               what="committed offsets at the log ends")
    for c in consumers:
        assert c.stop() == 0, c.log()
    everything = [b for c in consumers for b in c.bodies()]
    assert Counter(everything) == Counter(expected), "lost or duplicated in a stable group"
    # each partition's messages were consumed by one member, in offset order
    by_part: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for c in consumers:
        for part, offset, _, _body in c.lines:
            by_part[part].append((offset, c.name))
    for part, seen in by_part.items():
        assert len({name for _, name in seen}) == 1, part
        offsets = [o for o, _ in seen]
        assert offsets == sorted(offsets)
    members = {f"{GROUP}_{n}" for n in ("c1", "c2", "c3")}
    for part, hist in audit.changes().items():  # no owner node ever names a non-member
        assert all(o is None or o in members for o in hist), (part, hist)
    # clean leave: nothing left registered
    assert zk_client.get_children(L.consumer_ids(GROUP)) == []
    assert zk_client.get_children(L.owners_dir(GROUP, TOPIC)) == []


def test_kill_9_member_partitions_taken_over_nothing_lost(
        zk_connect, zk_client, brokers, consumers, tmp_path):
    for name in ("k1", "k2"):
        consumers.append(ConsumerProc(zk_connect, name, tmp_path))
    audit = OwnerAudit(zk_client, GROUP, TOPIC)
    wait_until(lambda: set(audit.owners().values()) == {f"{GROUP}_k1", f"{GROUP}_k2"}
               and len(audit.owners()) == 8, timeout=60, what="both members own partitions")
    produce(zk_connect, 0, 2000)
    wait_until(lambda: len(consumers[0].bodies()) > 0, timeout=30, what="k1 consuming")
    victim_parts = {p for p, o in audit.owners().items() if o == f"{GROUP}_k1"}
    committed_before_kill = committed(zk_client)
    consumers[0].kill()
    t_kill = time.monotonic()
    produce(zk_connect, 2000, 1000)
    wait_until(lambda: set(audit.owners().values()) == {f"{GROUP}_k2"}
               and len(audit.owners()) == 8, timeout=60,
               what="survivor owning every partition after the session timeout")
    takeover = time.monotonic() - t_kill
    expected = {str(i) for i in range(3000)}
    wait_until(lambda: set(consumers[0].bodies()) | set(consumers[1].bodies()) >= expected,
               timeout=60, what="every message consumed by someone")
    assert consumers[1].stop() == 0, consumers[1].log()
    dupes = Counter(consumers[0].bodies() + consumers[1].bodies())
    duplicated = {b for b, n in dupes.items() if n > 1}
    # duplicates are only messages k1 delivered beyond what it had committed
    # (committed_before_kill is a lower bound of what it had committed at the kill)
    k1_uncommitted = {body for part, offset, _, body in consumers[0].lines
                      if part in victim_parts and offset >= committed_before_kill.get(part, 0)}
    assert duplicated <= k1_uncommitted
    assert takeover < 30
    assert committed(zk_client).keys() >= victim_parts
    assert all(committed(zk_client)[p] >= committed_before_kill.get(p, 0) for p in victim_parts)


def test_session_expiry_stops_member_never_commits_old_session_and_rejoins(
        zk_connect, zk_client, zk_server, brokers):
    chroot = zk_connect[len(zk_server.hosts):]
    proxy = ZkProxy(zk_server.hosts)
    seen_a: list[tuple[str, int, str]] = []
    seen_b: list[tuple[str, int, str]] = []
    offsets_log: list[tuple[str, int]] = []
    offsets_dir = L.offsets_dir(GROUP, TOPIC)

    a = MessageConsumer(GROUP, proxy.hosts + chroot, consumer_id="a", zk_session_timeout=3.0,
                        commit_period=0.1, fetch_runner_count=2)
    a.subscribe(TOPIC, lambda m: seen_a.append((m.partition, m.offset, m.raw_body.decode())))
    b = MessageConsumer(GROUP, zk_connect, consumer_id="b", zk_session_timeout=10.0,
                        commit_period=0.1, fetch_runner_count=2)
    b.subscribe(TOPIC, lambda m: seen_b.append((m.partition, m.offset, m.raw_body.decode())))
    try:
        a.start()
        wait_until(lambda: len(a.assignment().get(TOPIC, [])) == 8, timeout=30,
                   what="a owns everything")
        zk_client.ensure_path(offsets_dir)
        produce(zk_connect, 0, 1000)
        wait_until(lambda: len(seen_a) == 1000, timeout=30, what="a consumed the first batch")
        wait_until(lambda: len(zk_client.get_children(offsets_dir)) == 8, timeout=30,
                   what="a committed every partition")

        def record(part):
            def watch(data, stat):
                if data is not None:
                    offsets_log.append((part, decode_offset(data).offset))
            return watch
        for part in zk_client.get_children(offsets_dir):
            zk_client.DataWatch(f"{offsets_dir}/{part}", record(part))
        a_session = a._client.client_id[0]
        proxy.pause()  # a's ZooKeeper traffic is blackholed; its session expires on the server
        b.start()
        wait_until(lambda: len(b.assignment().get(TOPIC, [])) == 8, timeout=30,
                   what="b takes every partition after a's session expired")
        produce(zk_connect, 1000, 500)
        wait_until(lambda: len({x[2] for x in seen_b}) >= 500, timeout=30,
                   what="b consumed the new messages")
        proxy.resume()
        wait_until(lambda: a._client.client_id and a._client.client_id[0] != a_session,
                   timeout=30, what="a back in a new session")
        wait_until(lambda: sorted(a.assignment().get(TOPIC, []) + b.assignment().get(TOPIC, []))
                   == sorted(f"{x}-{i}" for x in (0, 1) for i in range(4))
                   and a.state.value == "stable" and b.state.value == "stable",
                   timeout=30, what="a rejoined and the group settled")
    finally:
        a.close()
        b.close()
        proxy.close()
    # committed offsets only ever moved forward: no zombie wrote an old position back
    last: dict[str, int] = {}
    for part, off in offsets_log:
        assert off >= last.get(part, 0), (part, off, last.get(part))
        last[part] = off
    # nothing lost
    assert {x[2] for x in seen_a} | {x[2] for x in seen_b} == {str(i) for i in range(1500)}
    assert zk_client.get_children(L.consumer_ids(GROUP)) == []
