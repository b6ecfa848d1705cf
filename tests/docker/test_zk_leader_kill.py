"""A 3-node ZooKeeper ensemble in containers loses its leader to ``docker kill`` while a
metaq producer, a broker and a consumer group run on it.

The ensemble (``helpers.zk_docker.ContainerEnsemble``): three ``metaq-zookeeper:test``
containers (or ``$METAQ_TEST_ZK_IMAGE``) on a user-defined Docker network, each one's 2181
published on the host; the leader is the member whose ``srvr`` says ``Mode: leader``.  An
in-process broker, an in-process ``Producer`` sending all along and three in-process
``MessageConsumer`` members of one group use the three members' addresses.

Checked: a new leader is elected; every member's kazoo client is cut off (SUSPENDED)
and reconnects to a surviving member in the same session (never LOST, so no partition
moves); nothing acknowledged is lost and nothing is delivered twice; the group keeps
consuming what is sent after the kill; at no time do two members own one partition
(their ``on_assigned``/``on_revoked`` intervals never overlap, every delivery falls
inside its member's interval, and ZooKeeper's owner nodes name the members that think
they own them); the broker stays registered; the killed member comes back as a follower.

Named ``test_zk_leader_kill.py``, not ``test_zk_ensemble.py``: that name is
``tests/zk/test_zk_ensemble.py``'s (test file names are unique across rooms,
tests/README.md), which checks plain ZooKeeper writes across a leader stop on the
``zk_ensemble`` fixture (the launcher's ensemble, or containers under
``METAQ_TEST_ZK=docker``).
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.zk_docker import ContainerEnsemble, DockerUnavailable, unavailable, zk_image
from kazoo.client import KazooClient
from kazoo.protocol.states import KazooState

from metaq import MessageConsumer, Producer
from metaq._zk import server_mode
from metaq.broker import Broker, BrokerConfig
from metaq.testing import free_port, wait_until
from zk_layout import Layout

pytestmark = [pytest.mark.docker, pytest.mark.zk, pytest.mark.broker]

TOPIC = "lk"
GROUP = "lk-group"
PARTITIONS = 4


@pytest.fixture(scope="module")
def ensemble() -> Iterator[ContainerEnsemble]:
    try:
        image = zk_image()
    except DockerUnavailable as e:
        unavailable(str(e))
    with ContainerEnsemble(3, image) as e:
        yield e


class Group:
    """Three members; every delivery and every assign/revoke, timed."""

    def __init__(self, zk: str) -> None:
        self.lock = threading.Lock()
        self.deliveries: list[tuple[float, str, str, int, bytes]] = []
        self.events: list[tuple[float, str, str, str]] = []  # (t, member, +/-, partition)
        self.states: list[tuple[float, str, KazooState]] = []  # each member's connection
        self.clients: list[KazooClient] = []
        self.members = [self._member(zk, name) for name in ("m0", "m1", "m2")]

    def _member(self, zk: str, name: str) -> MessageConsumer:
        # the member's own kazoo client, handed to it, so that its states can be watched
        client = KazooClient(hosts=zk, timeout=20.0)

        def state(s: KazooState) -> None:
            with self.lock:
                self.states.append((time.monotonic(), name, s))

        client.add_listener(state)
        client.start(timeout=30)
        self.clients.append(client)

        def listener(m) -> None:  # noqa: ANN001
            with self.lock:
                self.deliveries.append((time.monotonic(), name, m.partition, m.offset,
                                        m.raw_body))

        def assigned(topic: str, partition: str) -> None:
            with self.lock:
                self.events.append((time.monotonic(), name, "+", partition))

        def revoked(topic: str, partition: str) -> None:
            with self.lock:
                self.events.append((time.monotonic(), name, "-", partition))

        c = MessageConsumer(GROUP, client, consumer_id=name, zk_session_timeout=20.0,
                            commit_period=0.5, on_assigned=assigned, on_revoked=revoked)
        c.subscribe(TOPIC, listener)
        return c

    def bodies(self) -> Counter[bytes]:
        with self.lock:
            return Counter(d[4] for d in self.deliveries)

    def settled(self) -> bool:
        owned = sorted(p for c in self.members for p in c.assignment().get(TOPIC, []))
        return (all(c.state.value == "stable" for c in self.members)
                and owned == sorted(f"0-{i}" for i in range(PARTITIONS)))


class Sender(threading.Thread):
    """Sends a numbered body every few milliseconds until stopped; keeps what was acked."""

    def __init__(self, zk: str) -> None:
        super().__init__(name="leader-kill-sender", daemon=True)
        self.zk = zk
        self.stop_flag = threading.Event()
        self.acked: list[tuple[float, bytes]] = []
        self.failed: list[tuple[bytes, str]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with Producer(self.zk) as producer:
                n = 0
                while not self.stop_flag.is_set():
                    body = f"m{n:06d}".encode()
                    n += 1
                    try:
                        producer.send(TOPIC, body)
                        self.acked.append((time.monotonic(), body))
                    except Exception as e:  # not acknowledged: may be lost
                        self.failed.append((body, repr(e)))
                    self.stop_flag.wait(0.005)
        except BaseException as e:
            self.error = e


def _intervals(events: list[tuple[float, str, str, str]], end: float
               ) -> dict[str, list[tuple[float, float, str]]]:
    """partition -> [(assigned at, revoked at (or end), member)] from the callbacks."""
    open_: dict[tuple[str, str], float] = {}
    out: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for t, member, sign, part in sorted(events):
        if sign == "+":
            assert (member, part) not in open_, f"{member} assigned {part} twice"
            open_[(member, part)] = t
        else:
            start = open_.pop((member, part))
            out[part].append((start, t, member))
    for (member, part), start in open_.items():
        out[part].append((start, end, member))
    return out


def test_leader_kill_loses_nothing_acknowledged_and_ownership_stays_exclusive(
        ensemble: ContainerEnsemble, tmp_path: Path) -> None:
    try:
        _scenario(ensemble, tmp_path)
    except BaseException:
        print(ensemble.log_tail(60))  # in the report's captured output
        raise


def _scenario(ensemble: ContainerEnsemble, tmp_path: Path) -> None:
    leader = ensemble.wait_quorum(timeout=60)
    host, port = ensemble.node_hosts(leader).rsplit(":", 1)
    assert server_mode(host, int(port)) == "leader"  # 4lw srvr: Mode: leader

    chroot = f"/leader-kill-{uuid.uuid4().hex[:6]}"
    zk = ensemble.hosts + chroot
    admin = KazooClient(hosts=ensemble.hosts, timeout=20.0)
    admin.start(timeout=30)
    admin.ensure_path(chroot)
    audit = KazooClient(hosts=zk, timeout=20.0)  # watches the owner nodes from ZooKeeper
    audit.start(timeout=30)
    layout = Layout()
    broker = Broker(BrokerConfig(broker_id=0, data_dir=tmp_path / "broker0", port=free_port(),
                                 topics={TOPIC: PARTITIONS}, zk_connect=zk,
                                 zk_session_timeout=20.0))
    group: Group | None = None
    sender: Sender | None = None
    try:
        broker.start()
        group = Group(zk)
        for c in group.members:
            c.start()
        wait_until(group.settled, 60, what="the group to own every partition")
        owned_before = {c.consumer_id: c.assignment() for c in group.members}
        sessions = [c.client_id[0] for c in group.clients]
        with group.lock:
            settled_events = len(group.events)  # the joins' own moves come before

        sender = Sender(zk)
        sender.start()
        wait_until(lambda: len(sender.acked) >= 100, 30, what="100 acknowledged sends")

        killed_at = time.monotonic()
        ensemble.kill_node(leader)  # docker kill: SIGKILL, no goodbye
        assert ensemble.mode(leader) is None
        new_leader = ensemble.wait_quorum(timeout=60)
        assert new_leader != leader
        elected = time.monotonic() - killed_at

        # kazoo reconnects every client to a surviving member, in the same session
        wait_until(lambda: all(c.state.value == "stable" for c in group.members), 60,
                   what="every member stable again")
        wait_until(lambda: all(c.connected for c in group.clients), 30,
                   what="every member's kazoo client connected")
        with group.lock:
            states = [(m, s) for t, m, s in group.states if t > killed_at]
        # every server drops its clients when the quorum loses its leader
        assert {m for m, s in states if s == KazooState.SUSPENDED} == {"m0", "m1", "m2"}
        assert KazooState.LOST not in {s for _, s in states}
        assert [c.client_id[0] for c in group.clients] == sessions
        wait_until(lambda: audit.connected, 30, what="the audit client to reconnect")
        mark = len(sender.acked)
        wait_until(lambda: len(sender.acked) >= mark + 200, 60,
                   what="200 more acknowledged sends after the election")
        sender.stop_flag.set()
        sender.join(30)
        assert sender.error is None, repr(sender.error)

        acked = [body for _, body in sender.acked]
        after_kill = [body for t, body in sender.acked if t > killed_at]
        wait_until(lambda: set(acked) <= set(group.bodies()), 60,
                   what="every acknowledged message delivered")
        end = time.monotonic()

        # nothing acknowledged lost, nothing twice (no session was lost: nothing moved)
        delivered = group.bodies()
        assert not set(acked) - set(delivered)
        assert [b for b, n in delivered.items() if n > 1] == []
        assert after_kill, "nothing was acknowledged after the kill"
        assert {c.consumer_id: c.assignment() for c in group.members} == owned_before
        with group.lock:
            assert group.events[settled_events:] == [], "partitions moved after the kill"

        # exclusive ownership: intervals per partition never overlap; each delivery
        # lies inside its member's interval
        intervals = _intervals(group.events, end)
        for part, spans in intervals.items():
            spans.sort()
            for (_s1, e1, m1), (s2, _e2, m2) in itertools.pairwise(spans):
                assert e1 <= s2, f"{part} owned by {m1} and {m2} at once"
        with group.lock:
            deliveries = list(group.deliveries)
        for t, member, part, _offset, _body in deliveries:
            assert any(m == member and s <= t <= e for s, e, m in intervals[part]), (
                f"{member} delivered from {part} outside its ownership")
        # ZooKeeper's owner nodes name the members that think they own the partitions
        owners_dir = layout.owners_dir(GROUP, TOPIC)
        zk_owners = {p: audit.get(f"{owners_dir}/{p}")[0].decode()
                     for p in audit.get_children(owners_dir)}
        believed = {p: c.consumer_id for c in group.members
                    for p in c.assignment().get(TOPIC, [])}
        assert zk_owners == believed
        # the broker's registration survived (its session too)
        assert audit.exists(layout.broker_id(0)) is not None

        # the killed member comes back and follows the new leader
        ensemble.start_node(leader)
        wait_until(lambda: ensemble.mode(leader) == "follower", 60,
                   what="the old leader to rejoin as a follower")
        print(f"leader node {leader} killed; node {new_leader} elected after "
              f"{elected:.1f}s; {len(acked)} acknowledged ({len(after_kill)} after the "
              f"kill), {len(sender.failed)} sends failed, all delivered once")
    finally:
        if sender is not None:
            sender.stop_flag.set()
            sender.join(30)
        if group is not None:
            for c in group.members:
                c.close()
            for k in group.clients:
                k.stop()
                k.close()
        broker.stop()
        audit.stop()
        audit.close()
        try:
            admin.delete(chroot, recursive=True)
        except Exception:  # noqa: BLE001 - a unique chroot: harmless if left
            pass
        admin.stop()
        admin.close()
