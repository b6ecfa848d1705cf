"""The real Metaq 1.4 Java client (compiled unmodified) against our broker.

The Java programs in ``interop/java/`` are compiled once per session with ``javac``
against the client jars of ``../shared/tools/metaq-java`` (beside the repository, or
wherever ``$METAQ_JAVA_CLIENT`` points) and the Debian packages its README names; every
test here skips, naming what is missing, when any of these is absent.  Each program
prints one line per event on stdout (``SENT <partition> <offset> <msgId> <body>``,
``GOT ...``, ``COMMITTED ...``, ``ERROR ...``, see its doc comment); the tests wait on
those lines, never on sleeps.

- plain: a Java producer to a Python consumer, a Python producer to a Java consumer,
  and both side by side with two groups;
- local transactions (``beginTransaction`` / ``commit`` / ``rollback`` on a producer);
- XA (``XAMetaMessageSessionFactory`` → ``createXAProducer`` → ``getXAResource``), including
  a branch prepared, the broker killed with SIGKILL and restarted, then ``recover()`` and commit;
- the exact wire lines the Java client sends for transactions, recorded by a scripted
  stand-in broker (``java_stub_broker.py``): the contract our broker's ``transaction``
  command has to meet;
- a mixed group (issue 25): Java members killed with SIGKILL and replaced round after
  round beside a ``metaq consume`` member, while a producer sends 200 msg/s; each new Java
  member must deliver from its partitions at once, and nothing is lost.

A Java member's stdout must be read all the time: its listener prints each message, and
once the pipe is full every fetch thread blocks inside the listener, so the member stops
consuming without a word (``JavaProc`` reads it on a thread).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from helpers.group_nodes import owners as group_owners
from helpers.java_client import JavaClient, JavaProc
from helpers.procs import BrokerProc, read_partition
from java_stub_broker import StubBroker
from kazoo.exceptions import NoNodeError

from metaq import MessageConsumer, Producer
from metaq.testing import wait_until
from zk_layout import Layout, decode_offset

# java_client first: a missing toolchain skips before ZooKeeper or a broker starts
pytestmark = [pytest.mark.usefixtures("java_client"), pytest.mark.broker, pytest.mark.zk]

TOPIC = "t"
PARTS = 2
UQ = "metaq-py-interop"   # the XA producer's unique qualifier (no blanks, no ':')


# -- our side ------------------------------------------------------------------------------

@pytest.fixture
def broker(java_client: JavaClient, brokers: Callable[..., BrokerProc]) -> BrokerProc:
    """Our broker (a ``metaq broker start`` process), topic ``t`` with 2 partitions.
    Asks for ``java_client`` first so that a missing toolchain skips before anything starts."""
    return brokers(0, {TOPIC: PARTS})


@dataclass(frozen=True)
class Sent:
    partition: str
    offset: int
    msg_id: int
    body: str


def sent_lines(proc: JavaProc) -> list[Sent]:
    out = []
    for line in proc.output():
        if line.startswith("SENT "):
            _, partition, offset, msg_id, body = line.split(" ", 4)
            out.append(Sent(partition, int(offset), int(msg_id), body))
    return out


def events(proc: JavaProc, *kinds: str) -> list[str]:
    """The program's event lines of these kinds (first word), in order."""
    return [line for line in proc.output() if line.split(" ", 1)[0] in kinds]


class PyConsumer:
    """A Python consumer collecting ``(partition, offset, msg_id, body)``."""

    def __init__(self, zk_connect: str, group: str) -> None:
        self.got: list[tuple[str, int, int, str]] = []
        self._lock = threading.Lock()
        self.consumer = MessageConsumer(group, zk_connect, commit_period=0.2,
                                        zk_session_timeout=10.0)
        self.consumer.subscribe(TOPIC, self._on_message)

    def _on_message(self, m) -> None:  # noqa: ANN001
        with self._lock:
            self.got.append((m.partition, m.offset, m.msg_id, bytes(m.raw_body).decode()))

    def messages(self) -> list[tuple[str, int, int, str]]:
        with self._lock:
            return list(self.got)

    def bodies(self) -> list[str]:
        return [b for _, _, _, b in self.messages()]

    def wait_count(self, n: int, timeout: float = 20.0) -> None:
        wait_until(lambda: len(self.messages()) >= n, timeout,
                   what=f"the Python consumer to get {n} messages")

    def __enter__(self) -> PyConsumer:
        self.consumer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.consumer.close()


def by_partition(items: list[tuple[str, str]]) -> dict[str, list[str]]:
    """``[(partition, body), ...]`` -> bodies per partition, order kept."""
    out: dict[str, list[str]] = {}
    for partition, body in items:
        out.setdefault(partition, []).append(body)
    return out


def partition_log(broker: BrokerProc, index: int) -> list[tuple[int, int, str]]:
    """What partition ``index`` of our broker holds: ``(offset, msg_id, body)``."""
    conn = broker.connection()
    try:
        return [(m.offset, m.msg_id, m.payload.decode())
                for m in read_partition(conn, TOPIC, index)]
    finally:
        conn.close()


def stored_bodies(broker: BrokerProc) -> dict[str, list[str]]:
    """Bodies per partition name, as our broker holds them."""
    return {f"{broker.broker_id}-{i}": [b for _, _, b in partition_log(broker, i)]
            for i in range(PARTS)}


NOTHING_STORED = {f"0-{i}": [] for i in range(PARTS)}


def expected_stored(sent: list[Sent]) -> dict[str, list[str]]:
    """Bodies per partition, in the order sent, every partition present."""
    return {**NOTHING_STORED, **by_partition([(s.partition, s.body) for s in sent])}


def wait_stored(broker: BrokerProc, sent: list[Sent], timeout: float = 10.0) -> None:
    """Wait until our broker's partitions hold exactly ``sent`` (in order per partition):
    a commit's messages may reach the partition a moment after the commit's answer."""
    want = expected_stored(sent)
    got: list[dict[str, list[str]]] = []

    def same() -> bool:
        got[:] = [stored_bodies(broker)]
        return got[0] == want
    try:
        wait_until(same, timeout, 0.05, what="the committed messages in the partitions")
    except AssertionError:
        assert got[0] == want   # pytest shows the difference


def assert_consumed(c: PyConsumer, sent: list[Sent]) -> None:
    """The consumer got exactly ``sent``, in order within each partition."""
    got = by_partition([(p, b) for p, _, _, b in c.messages()])
    assert got == {p: bodies for p, bodies in expected_stored(sent).items() if bodies}


def assert_producer_order(items: list[tuple[str, str]]) -> None:
    """Within each partition, each producer's (body prefix's) messages in send order."""
    for partition, bodies in by_partition(items).items():
        for prefix in {b.rsplit("-", 1)[0] for b in bodies}:
            seq = [int(b.rsplit("-", 1)[1]) for b in bodies if b.rsplit("-", 1)[0] == prefix]
            assert seq == sorted(seq), (partition, prefix, bodies)


# -- plain messages ------------------------------------------------------------------------

def test_java_producer_to_python_consumer(zk_connect, broker, java) -> None:
    n = 40
    prod = java.run("JavaProducer", TOPIC, str(n), "j")
    sent = sent_lines(prod)
    assert [s.body for s in sent] == [f"j-{i}" for i in range(n)], prod.describe()
    assert {s.partition for s in sent} == {"0-0", "0-1"}, "round robin over both partitions"

    with PyConsumer(zk_connect, "py-group") as c:
        c.wait_count(n)
        got = c.messages()
    assert len(got) == n, got
    # Every message where the Java client was told it went: partition, offset, msgId.
    assert sorted(got) == sorted((s.partition, s.offset, s.msg_id, s.body) for s in sent)
    # In order per partition.
    assert by_partition([(p, b) for p, _, _, b in got]) == \
        by_partition([(s.partition, s.body) for s in sent])


def test_python_producer_to_java_consumer(zk_connect, zk_client, broker, java) -> None:
    n = 40
    with Producer(zk_connect) as producer:
        results = [(producer.send(TOPIC, f"py-{i}".encode()), f"py-{i}") for i in range(n)]
    cons = java.run("JavaConsumer", "java-group", TOPIC, str(n), "20")
    got = [line.split(" ", 3)[1:] for line in events(cons, "GOT")]
    assert len(got) == n, cons.describe()
    assert sorted((p, int(mid), b) for p, mid, b in got) == \
        sorted((r.partition, r.msg_id, body) for r, body in results)
    assert by_partition([(p, b) for p, _, b in got]) == \
        by_partition([(r.partition, body) for r, body in results])
    # Its shutdown committed each partition's end to ZooKeeper, as <msgId>-<offset>.
    layout = Layout("/meta")
    for i in range(PARTS):
        log = partition_log(broker, i)
        data, _ = zk_client.get(layout.offset("java-group", TOPIC, f"0-{i}"))
        stored = decode_offset(data)
        end = log[-1][0] + 20 + len(log[-1][2])
        assert stored.offset == end, (i, data, log[-1])
        assert stored.msg_id in (-1, log[-1][1]), (i, data)


def test_java_and_python_side_by_side(zk_connect, broker, java) -> None:
    n = 20
    jcons = java.start("JavaConsumer", "java-side", TOPIC, str(2 * n), "25")
    jcons.wait_line("SUBSCRIBED")
    with PyConsumer(zk_connect, "py-side") as pcons:
        jprod = java.start("JavaProducer", TOPIC, str(n), "j")
        with Producer(zk_connect) as producer:
            for i in range(n):
                producer.send(TOPIC, f"p-{i}".encode())
        assert jprod.finish() == 0, jprod.describe()
        pcons.wait_count(2 * n)
        assert jcons.finish() == 0, jcons.describe()
        py_bodies = pcons.bodies()
        py_items = [(p, b) for p, _, _, b in pcons.messages()]
    expected = sorted([f"j-{i}" for i in range(n)] + [f"p-{i}" for i in range(n)])
    java_bodies = [line.split(" ", 3)[3] for line in events(jcons, "GOT")]
    assert sorted(java_bodies) == expected, jcons.describe()
    assert sorted(py_bodies) == expected
    # Each producer's messages in its own order within a partition, for both groups.
    assert_producer_order([(line.split(" ")[1], line.split(" ")[3])
                           for line in events(jcons, "GOT")])
    assert_producer_order(py_items)


# -- local transactions --------------------------------------------------------------------

def test_local_transaction_commit_and_rollback(zk_connect, broker, java) -> None:
    """commit:4 (held before commit: nothing visible), rollback:3, commit:3."""
    tx = java.start("JavaTxProducer", TOPIC, "tx", "commit:4:wait", "rollback:3", "commit:3")
    tx.wait_line("AWAITING 0")
    # Sent and acknowledged, not committed: not in the partitions yet.
    assert stored_bodies(broker) == NOTHING_STORED, tx.describe()
    tx.proceed()
    assert tx.finish() == 0, tx.describe()
    assert events(tx, "BEGIN", "COMMITTED", "ROLLEDBACK") == [
        "BEGIN 0", "COMMITTED 0", "BEGIN 1", "ROLLEDBACK 1", "BEGIN 2", "COMMITTED 2"]
    sent = sent_lines(tx)
    assert len(sent) == 10, tx.describe()
    committed = [s for s in sent if not s.body.startswith("tx-1-")]

    # The partitions hold exactly the committed messages, each transaction's in its order.
    wait_stored(broker, committed)
    with PyConsumer(zk_connect, "py-tx") as c:
        c.wait_count(len(committed))
        assert_consumed(c, committed)


# -- XA ------------------------------------------------------------------------------------

def _xid_key(gtrid: str) -> str:
    """Metaq's transaction key for JavaXA's xid (format 4660, branch "b1")."""
    return f"XID:4660:{gtrid.encode().hex()}:{b'b1'.hex()}:{UQ}"


def test_xa_two_phase_one_phase_and_rollback(zk_connect, broker, java) -> None:
    xa = java.start("JavaXA", TOPIC, UQ, "commit:g1:3:wait", "rollback:g2:2", "onephase:g3:2",
                    "recover")
    assert xa.wait_line("PREPARED g1") == "PREPARED g1 0"   # XAResource.XA_OK
    xa.wait_line("AWAITING g1")
    assert stored_bodies(broker) == NOTHING_STORED, "prepared, not committed: not visible"
    xa.proceed()
    assert xa.finish() == 0, xa.describe()
    assert events(xa, "COMMITTED", "ROLLEDBACK", "RECOVER-DONE") == [
        "COMMITTED g1", "ROLLEDBACK g2", "COMMITTED g3", "RECOVER-DONE 0"], xa.describe()
    sent = sent_lines(xa)
    committed = [s for s in sent if not s.body.startswith("g2-")]
    wait_stored(broker, committed)
    with PyConsumer(zk_connect, "py-xa") as c:
        c.wait_count(len(committed))
        assert_consumed(c, committed)


def test_xa_prepared_branch_survives_broker_kill(zk_connect, broker, java) -> None:
    first = java.run("JavaXA", TOPIC, UQ, "prepare:k1:3", "prepare:k2:2")
    assert events(first, "PREPARED") == ["PREPARED k1 0", "PREPARED k2 0"], first.describe()
    assert stored_bodies(broker) == NOTHING_STORED

    broker.kill()      # SIGKILL: the prepared branches must come back from its disk
    broker.restart()
    second = java.run("JavaXA", TOPIC, UQ, "recover", "commit-xid:k1", "rollback-xid:k2",
                      "recover")
    recovered = [line.split(" ", 1)[1] for line in events(second, "RECOVERED")]
    assert sorted(recovered) == sorted([_xid_key("k1"), _xid_key("k2")]), second.describe()
    assert events(second, "COMMITTED", "ROLLEDBACK", "RECOVER-DONE") == [
        "RECOVER-DONE 2", "COMMITTED k1", "ROLLEDBACK k2", "RECOVER-DONE 0"]

    k1 = [s for s in sent_lines(first) if s.body.startswith("k1-")]
    wait_stored(broker, k1)
    with PyConsumer(zk_connect, "py-xa-kill") as c:
        c.wait_count(len(k1))
        assert_consumed(c, k1)


# -- the wire lines, against a scripted stand-in for Java's broker ---------------------------

def _normalized(lines: list[str]) -> list[str]:
    """Command lines with what varies from run to run replaced: the session ids (in order
    of appearance ``<sid1>``, ``<sid2>``...), the opaque, a put's partition and checksum."""
    sids: dict[str, str] = {}
    out = []
    for line in lines:
        parts = line.split(" ")
        assert re.fullmatch(r"-?\d+", parts[-1]), line
        parts[-1] = "<opaque>"
        if parts[0] == "transaction":
            assert re.fullmatch(r"\S+-\d+-\d+", parts[2]), line  # <ip>-<ms>-<n>
            sids.setdefault(parts[2], f"<sid{len(sids) + 1}>")
        elif parts[0] == "put":
            assert parts[2] in ("0", "1") and parts[5].isdigit(), line
            parts[2], parts[5] = "<p>", "<crc>"
        text = " ".join(parts)
        for sid, name in sids.items():
            text = text.replace(sid, name)
        out.append(text)
    return out


def test_java_transaction_wire_lines(zk_connect, java_client, java) -> None:
    """The commands the Java client sends for local and XA transactions, exactly.

    Our broker's ``transaction`` command has to accept these: the stand-in answers them
    as Java's broker does (java_stub_broker.py), and the Java client is satisfied."""
    with StubBroker(zk_connect, {TOPIC: PARTS}) as stub:
        tx = java.run("JavaTxProducer", TOPIC, "tx", "timeout=7", "commit:2", "rollback:1")
        xa = java.run("JavaXA", TOPIC, UQ, "commit:g1:1", "onephase:g2:1", "prepare:g3:1",
                      "recover")
        xa2 = java.run("JavaXA", TOPIC, UQ, "commit-recovered")
        lines = [line for line in stub.commands() if not line.startswith("version ")]
    assert events(tx, "COMMITTED", "ROLLEDBACK") == ["COMMITTED 0", "ROLLEDBACK 1"]
    assert [s.offset for s in sent_lines(tx)] == [-1, -1, -1]  # as Java's broker answers
    assert events(xa, "PREPARED", "RECOVERED") == [
        "PREPARED g1 0", "PREPARED g3 0", f"RECOVERED {_xid_key('g3')}"]
    assert events(xa2, "COMMITTED") == [f"COMMITTED {_xid_key('g3')}"]

    g1, g2, g3 = (_xid_key(g) for g in ("g1", "g2", "g3"))
    assert _normalized(lines) == [
        # local transactions: the key is TX:<sessionId>:<n>; BEGIN carries the timeout
        # (only when > 0) and no unique qualifier; BEGIN goes just before the first put
        "transaction TX:<sid1>:1 <sid1> BEGIN 7 <opaque>",
        "put t <p> 6 0 <crc> TX:<sid1>:1 <opaque>",
        "put t <p> 6 0 <crc> TX:<sid1>:1 <opaque>",
        "transaction TX:<sid1>:1 <sid1> COMMIT_ONE_PHASE <opaque>",
        "transaction TX:<sid1>:2 <sid1> BEGIN 7 <opaque>",
        "put t <p> 6 0 <crc> TX:<sid1>:2 <opaque>",
        "transaction TX:<sid1>:2 <sid1> ROLLBACK <opaque>",
        # XA: the key is XID:<formatId>:<hex gtrid>:<hex bqual>:<uniqueQualifier>, every
        # command carries the unique qualifier; END expects no answer (Java's broker sends
        # none); PREPARE's answer body is the vote (0 = XA_OK)
        f"transaction {g1} <sid2> BEGIN {UQ} <opaque>",
        f"put t <p> 4 0 <crc> {g1} <opaque>",
        f"transaction {g1} <sid2> END {UQ} <opaque>",
        f"transaction {g1} <sid2> PREPARE {UQ} <opaque>",
        f"transaction {g1} <sid2> COMMIT_TWO_PHASE {UQ} <opaque>",
        f"transaction {g2} <sid2> BEGIN {UQ} <opaque>",
        f"put t <p> 4 0 <crc> {g2} <opaque>",
        f"transaction {g2} <sid2> END {UQ} <opaque>",
        f"transaction {g2} <sid2> COMMIT_ONE_PHASE {UQ} <opaque>",
        f"transaction {g3} <sid2> BEGIN {UQ} <opaque>",
        f"put t <p> 4 0 <crc> {g3} <opaque>",
        f"transaction {g3} <sid2> END {UQ} <opaque>",
        f"transaction {g3} <sid2> PREPARE {UQ} <opaque>",
        # RECOVER has the key "null"; its answer is the prepared keys joined by \r\n
        f"transaction null <sid2> RECOVER {UQ} <opaque>",
        # a new JVM (new session id) finishing the branch it recovered
        f"transaction null <sid3> RECOVER {UQ} <opaque>",
        f"transaction {g3} <sid3> COMMIT_TWO_PHASE {UQ} <opaque>",
    ], "\n".join(lines)


# -- a mixed group: a Java member killed with SIGKILL, a new one joining -------------------

MIXED_GROUP = "mixed"
MIXED_TOPIC = "mixed"
MIXED_PARTS = 8
MIXED_RATE = 200.0     # messages a second, round robin over the partitions
#: kills and joins: 4 (each order of ids twice) in the README's run, to keep it within its
#: 15 minutes; 8 with METAQ_SOAK
MIXED_ROUNDS = 8 if os.environ.get("METAQ_SOAK", "") not in ("", "0") else 4
MIXED_SESSION = 4      # seconds: both members' ZooKeeper session timeout
FLOWING = 15.0         # a new Java member delivers from each of its partitions within this


class RateProducer:
    """Sends ``m-<i>`` to :data:`MIXED_TOPIC` at :data:`MIXED_RATE` on a thread until
    stopped; ``sent`` holds every acknowledged body."""

    def __init__(self, zk_connect: str) -> None:
        self.sent: list[str] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._producer = Producer(zk_connect)
        self._thread = threading.Thread(target=self._run, daemon=True, name="rate-producer")
        self._thread.start()

    def _run(self) -> None:
        start = time.monotonic()
        i = 0
        try:
            while not self._stop.wait(max(0.0, start + i / MIXED_RATE - time.monotonic())):
                self._producer.send(MIXED_TOPIC, f"m-{i}".encode())
                self.sent.append(f"m-{i}")
                i += 1
        except BaseException as e:  # noqa: BLE001 - reported by stop()
            self.error = e

    def count(self) -> int:
        return len(self.sent)

    def stop(self) -> list[str]:
        """Stop sending (again: no-op); what was sent."""
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join(10)
            self._producer.close()
        assert self.error is None, f"the producer failed: {self.error!r}"
        return list(self.sent)


def _body_index(body: str) -> int:
    return int(body.rsplit("-", 1)[1])


def test_python_transaction_against_a_java_broker_is_step_by_step(zk_connect) -> None:
    """Our producer's local transaction against a broker without ``+txpipe`` (Java's,
    here its stand-in) sends exactly Java's lines, BEGIN and COMMIT without the
    pipelined commit's ``puts=<n>`` (which Java's broker would read as a unique
    qualifier)."""
    with StubBroker(zk_connect, {TOPIC: PARTS}) as stub, Producer(zk_connect) as p:
        with p.transaction() as tx:
            tx.send(TOPIC, b"one", partition="0-0")
            tx.send(TOPIC, b"two", partition="0-0")
        lines = [line for line in stub.commands() if not line.startswith("version ")]
    assert [re.sub(r"TX:\S+:1 \S+", "TX:<sid>:1 <sid>", re.sub(r" -?\d+$", " <opaque>", line))
            for line in lines if not line.startswith("put ")] == [
        "transaction TX:<sid>:1 <sid> BEGIN <opaque>",
        "transaction TX:<sid>:1 <sid> COMMIT_ONE_PHASE <opaque>"]
    assert [line.split(" ")[0] for line in lines] == ["transaction", "put", "put",
                                                      "transaction"]


def test_new_java_member_after_kill9_always_receives(zk_connect, zk_client, brokers, java,
                                                       tmp_path) -> None:
    """Issue 25's mixed group: one Java member, one Python member (``metaq consume`` in a
    subprocess), a producer at 200 msg/s.  Each round the Java member is killed with
    SIGKILL; once its session has expired and the Python member holds every partition, a
    new Java member joins.  It must claim its half and deliver from each of its partitions
    messages sent after it joined, within :data:`FLOWING` seconds, in every round; at the
    end every message sent was delivered by some member (duplicates are allowed: a killed
    member's uncommitted progress is delivered again)."""
    broker = brokers(0, {MIXED_TOPIC: MIXED_PARTS})
    layout = Layout("/meta")
    py_id, half = f"{MIXED_GROUP}_py", MIXED_PARTS // 2

    def owners() -> dict[str, str]:
        return group_owners(zk_client, MIXED_GROUP, MIXED_TOPIC, layout)

    def members() -> list[str]:
        path = layout.consumer_ids(MIXED_GROUP)
        return zk_client.get_children(path) if zk_client.exists(path) else []

    def diagnosis(member: JavaProc | None) -> str:
        offsets_dir = layout.offsets_dir(MIXED_GROUP, MIXED_TOPIC)
        offsets = {p: zk_client.get(f"{offsets_dir}/{p}")[0].decode()
                   for p in sorted(zk_client.get_children(offsets_dir))}
        conn = broker.connection()
        try:
            ends = conn.stats("offsets")
        finally:
            conn.close()
        return (f"\nmembers {members()}\nowners {owners()}\noffsets {offsets}\n"
                f"broker {ends}\n{member.describe() if member else ''}\n"
                f"--- broker log:\n{broker.log_tail(30)}")

    def java_member(n: int) -> tuple[JavaProc, str]:
        # ids sorting before and after the Python member's in turn: the new member's half
        # is the first four partitions one round, the last four the next
        cid = f"{'0' if n % 2 == 0 else 'z'}java{n}"
        return java.start("JavaMember", MIXED_GROUP, MIXED_TOPIC, cid,
                          str(MIXED_SESSION * 1000)), f"{MIXED_GROUP}_{cid}"

    def got(member: JavaProc) -> list[tuple[str, str]]:
        return [(line.split(" ")[1], line.split(" ", 3)[3]) for line in events(member, "GOT")]

    def flowing(member: JavaProc, mine: list[str], since: int) -> bool:
        """``member`` delivered, from each partition in ``mine``, a message sent after
        the ``since``-th (so after it joined)."""
        fresh = {p for p, body in got(member) if _body_index(body) >= since}
        return set(mine) <= fresh

    def check(predicate: Callable[[], object], timeout: float, what: str,
              member: JavaProc | None) -> object:
        try:
            return wait_until(predicate, timeout, 0.05, what=what)
        except AssertionError as e:
            raise AssertionError(f"{e}{diagnosis(member)}") from None

    producer = RateProducer(zk_connect)
    py = JavaProc([sys.executable, "-m", "metaq", "consume", "--zk", zk_connect,
                   "--group", MIXED_GROUP, "--topic", MIXED_TOPIC, "--print",
                   "--consumer-id", "py", "--session-timeout", str(MIXED_SESSION),
                   "--commit-period", "0.5"], "python-member", tmp_path)
    java_members: list[JavaProc] = []

    def join(n: int) -> tuple[JavaProc, str, list[str], int]:
        """Round ``n``'s new Java member: it claims its half, starting from offsets that are
        message boundaries within the log (an offset inside a message or past the end
        makes the Java client wait for good without a word), then delivers from each of
        its partitions messages sent after it started.  Also returns its partitions and
        how many messages had been sent when its claims were seen."""
        since = producer.count()
        member, member_id = java_member(n)
        java_members.append(member)
        mine = check(lambda: len(c := sorted(p for p, o in owners().items()
                                             if o == member_id)) == half and c,
                     30.0, f"round {n}: {member_id} to claim {half} partitions", member)
        claimed = producer.count()
        assert_boundaries(mine, member)
        check(lambda: flowing(member, mine, since), FLOWING,
              f"round {n}: {member_id} to deliver from {mine}", member)
        return member, member_id, mine, claimed

    def assert_boundaries(partitions: list[str], member: JavaProc) -> None:
        offsets_dir = layout.offsets_dir(MIXED_GROUP, MIXED_TOPIC)
        conn = broker.connection()
        try:
            for p in partitions:
                try:
                    stored = decode_offset(zk_client.get(f"{offsets_dir}/{p}")[0]).offset
                except NoNodeError:
                    continue  # never committed: Metaq starts at 0
                index = int(p.split("-")[1])
                valid = conn.offset(MIXED_TOPIC, MIXED_GROUP, index, stored)
                assert valid == stored, (
                    f"{p}: committed offset {stored} is not a message boundary in the log "
                    f"(the broker's nearest is {valid}){diagnosis(member)}")
        finally:
            conn.close()

    def python_took(partitions: list[str], since: int) -> list[str]:
        """What the Python member delivered from ``partitions`` of the messages sent
        after the ``since``-th."""
        return [line for line in py.output() if line.count(" ") >= 3
                and line.split(" ")[0] in partitions
                and _body_index(line.split(" ", 3)[3]) >= since]

    def kill(n: int, member: JavaProc, member_id: str) -> None:
        member.kill()  # SIGKILL: its nodes stay until its session expires
        everything = {f"0-{i}": py_id for i in range(MIXED_PARTS)}
        check(lambda: member_id not in members() and owners() == everything,
              MIXED_SESSION + 20.0, f"round {n}: {member_id}'s session to expire and the "
              "Python member to take every partition over", None)

    try:
        member, member_id, mine, claimed = join(0)
        for n in range(1, MIXED_ROUNDS + 1):
            # the Python member let go of the Java member's partitions for good
            assert not python_took(mine, claimed), (
                f"round {n}: the Python member delivered from {member_id}'s {mine}: "
                f"{python_took(mine, claimed)[:5]}{diagnosis(member)}")
            kill(n, member, member_id)
            member, member_id, mine, claimed = join(n)
        sent = producer.stop()

        def delivered() -> set[str]:
            bodies = {body for m in java_members for _, body in got(m)}
            bodies.update(line.split(" ", 3)[3] for line in py.output()
                          if line.count(" ") >= 3)
            return bodies
        check(lambda: set(sent) <= delivered(), 30.0,
              "every message sent to be delivered by some member", member)
        member.proceed()  # a clean shutdown: commits, releases its partitions, unregisters
        assert member.finish() == 0, member.describe()
        conn = broker.connection()
        try:
            stats = conn.stats()
        finally:
            conn.close()
        assert "STAT bad_requests 0\r\n" in stats, stats   # every Java request understood
    finally:
        producer.stop()
        if py.proc.poll() is None:
            py.proc.send_signal(signal.SIGTERM)
            try:
                py.finish(15.0)
            except AssertionError:
                pass
        py.kill()
