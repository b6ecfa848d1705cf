"""Nothing stalls a group, nothing is lost silently: garbage in offset nodes, committed
offsets above the log end or inside a message, and a coordinator that fails (issue 13).
Real ZooKeeper, real broker processes."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
from helpers.faults import fail_next_rebalance
from kazoo.exceptions import NoNodeError

from metaq import (
    DamagedMessageError,
    MemberFailedError,
    MessageConsumer,
    OffsetOutOfRangeError,
    Producer,
)
from metaq._admin import describe_group, log_damage
from metaq.testing import wait_until
from zk_layout import Layout, decode_offset

TOPIC = "t"
LAYOUT = Layout()


class Got:
    def __init__(self) -> None:
        self.bodies: dict[str, list[bytes]] = {}
        self.lock = threading.Lock()

    def __call__(self, m) -> None:  # noqa: ANN001
        with self.lock:
            self.bodies.setdefault(m.partition, []).append(m.raw_body)

    def of(self, partition: str) -> list[bytes]:
        with self.lock:
            return list(self.bodies.get(partition, []))

    def total(self) -> int:
        with self.lock:
            return sum(map(len, self.bodies.values()))


@pytest.fixture
def loaded(zk_connect, brokers):
    """A broker with 2 partitions of 10 messages each; returns {partition: bodies}."""
    brokers(0, {TOPIC: 2})
    sent: dict[str, list[bytes]] = {}
    with Producer(zk_connect) as p:
        for i in range(20):
            r = p.send(TOPIC, b"m%02d" % i)
            sent.setdefault(r.partition, []).append(b"m%02d" % i)
    return sent


def _set_offset(zk_client, group: str, partition: str, data: bytes) -> str:
    path = LAYOUT.offset(group, TOPIC, partition)
    zk_client.ensure_path(path)
    zk_client.set(path, data)
    return path


def _consumer(zk_connect, group: str, got, errors: list, topic: str = TOPIC,
              **kw) -> MessageConsumer:
    c = MessageConsumer(group, zk_connect, commit_period=0.2, on_error=errors.append, **kw)
    c.subscribe(topic, got)
    return c


@pytest.mark.parametrize("garbage", [b"garbage", b"", b"\xff\xfe\x00", b"1--5"])
def test_garbage_offset_node_is_reported_and_the_group_goes_on(zk_connect, zk_client, loaded,
                                                                garbage):
    path = _set_offset(zk_client, "g", "0-0", garbage)
    got, errors = Got(), []
    with _consumer(zk_connect, "g", got, errors) as c:
        c.start()
        wait_until(lambda: got.total() == 20, 30, what="every message, both partitions")
        assert got.of("0-0") == loaded["0-0"]  # from the log start (offset_reset=earliest)
        bad = [e for e in errors if isinstance(e, OffsetOutOfRangeError)]
        assert len(bad) == 1 and path in str(bad[0]) and bad[0].action == "earliest"
        assert c.metrics()["damaged_offsets"] == 1
        # the next commit writes a good value over the garbage
        wait_until(lambda: _decodes(zk_client, path), 10, what="a good offset committed")


def _decodes(zk_client, path: str) -> bool:
    try:
        return decode_offset(zk_client.get(path)[0], path).offset > 0
    except (ValueError, NoNodeError):
        return False


def test_damaged_offset_with_fail_policy_stalls_only_that_partition(zk_connect, zk_client,
                                                                     loaded):
    _set_offset(zk_client, "g", "0-0", b"garbage")
    report = describe_group(zk_client, LAYOUT, "g")
    assert {p.partition: p.state for p in report.partitions}["0-0"] == "damaged"
    got, errors = Got(), []
    with _consumer(zk_connect, "g", got, errors, offset_reset="fail") as c:
        c.start()
        wait_until(lambda: got.of("0-1") == loaded["0-1"], 30, what="the other partition")
        assert got.of("0-0") == []
        stalled = c.metrics()["partitions"][f"{TOPIC}/0-0"]["stalled"]
        assert stalled and "offset_reset=fail" in stalled
        assert any(isinstance(e, OffsetOutOfRangeError) and e.action == "fail"
                   for e in errors)
        c.seek_to_earliest(TOPIC, "0-0")  # an operator's decision un-stalls it
        wait_until(lambda: got.of("0-0") == loaded["0-0"], 30, what="delivery after a seek")


@pytest.mark.parametrize("policy", ["earliest", "latest", "fail"])
def test_committed_offset_beyond_the_log_end(zk_connect, zk_client, loaded, policy):
    _set_offset(zk_client, "g", "0-0", b"1-99999999999")
    report = describe_group(zk_client, LAYOUT, "g")
    row = {p.partition: p for p in report.partitions}["0-0"]
    assert row.state == "out of range" and row.lag is None  # never "lag 0, ok"
    got, errors = Got(), []
    with _consumer(zk_connect, "g", got, errors, offset_reset=policy) as c:
        c.start()
        wait_until(lambda: any(isinstance(e, OffsetOutOfRangeError) for e in errors), 30,
                   what="the out-of-range offset reported")
        err = next(e for e in errors if isinstance(e, OffsetOutOfRangeError))
        assert err.offset == 99999999999 and err.action == policy
        assert err.log_end is not None or policy == "earliest"
        wait_until(lambda: got.of("0-1") == loaded["0-1"], 30, what="the other partition")
        if policy == "earliest":
            wait_until(lambda: got.of("0-0") == loaded["0-0"], 30, what="from the start")
        elif policy == "latest":
            _send_to(zk_connect, "0-0", b"new")
            wait_until(lambda: got.of("0-0") == [b"new"], 30, what="only what came after")
        else:
            assert got.of("0-0") == []


def _send_to(zk_connect: str, partition: str, body: bytes) -> None:
    with Producer(zk_connect, partitioner=lambda topic, parts, body, key: partition) as p:
        assert p.send(TOPIC, body).partition == partition


def test_committed_offset_inside_a_message_rereads_that_message(zk_connect, zk_client, loaded):
    _set_offset(zk_client, "g", "0-1", b"5")  # legacy bare offset, 5 bytes into message 0
    got, errors = Got(), []
    with _consumer(zk_connect, "g", got, errors) as c:
        c.start()
        wait_until(lambda: got.total() == 20, 30, what="every message")
        assert got.of("0-1") == loaded["0-1"]
        err = next(e for e in errors if isinstance(e, OffsetOutOfRangeError))
        assert err.action == "boundary" and err.offset == 5


# --------------------------------------------------------------------------- coordinator

def test_a_failing_coordinator_leaves_the_group_and_rejoins(zk_connect, loaded, monkeypatch):
    got_a, got_b, errors = Got(), Got(), []
    a = _consumer(zk_connect, "g2", got_a, errors, consumer_id="a")
    b = _consumer(zk_connect, "g2", got_b, [], consumer_id="b")
    with a, b:
        a.start()
        assert a.wait_settled(30) and len(a.assignment()[TOPIC]) == 2
        calls = fail_next_rebalance(a, monkeypatch)
        b.start()  # a's watch fires; its rebalance fails
        wait_until(lambda: any(isinstance(e, MemberFailedError) for e in errors), 30,
                   what="a's failure reported")
        # a left cleanly: b can own everything at once, nobody waits for a release
        wait_until(lambda: len(b.assignment().get(TOPIC, [])) == 2 or calls["n"] > 1, 30,
                   what="b to take a's partitions")
        # a rejoins after its backoff, and the group splits again
        wait_until(lambda: len(a.assignment().get(TOPIC, [])) == 1
                   and len(b.assignment().get(TOPIC, [])) == 1, 60, what="a rejoined")
        wait_until(lambda: got_a.total() + got_b.total() >= 20, 30, what="every message")
        assert a.failed is None


def test_repeated_coordinator_failures_close_the_member(zk_connect, loaded, monkeypatch):
    from metaq.consumer import _coordinator

    def broken(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("always broken")

    broken.uses_previous = False
    errors: list = []
    c = _consumer(zk_connect, "g3", Got(), errors)
    monkeypatch.setattr(c._coordinator, "_strategy", broken)
    with c:
        c.start()
        wait_until(lambda: c.failed is not None, 60, what="the member to give up")
        assert isinstance(c.failed, MemberFailedError)
        assert f"closed after {_coordinator.MAX_FAILURES}" in str(c.failed)
        assert c.state.value == "closed"
        # nothing left in ZooKeeper that others would wait for
        assert c.assignment() == {}


def test_metaq_consume_exits_nonzero_with_one_line_when_the_member_gives_up(zk_connect,
                                                                           loaded):
    """``metaq consume`` as a user runs it, with a coordinator that always fails."""
    script = (
        "import sys\n"
        "import metaq.consumer._coordinator as c\n"
        "def broken(*a, **k):\n"
        "    raise RuntimeError('always broken')\n"
        "broken.uses_previous = False\n"
        "c.get_strategy = lambda name: broken\n"
        "from metaq._cli import main\n"
        f"sys.exit(main(['consume', '--zk', {zk_connect!r}, '--group', 'g4', "
        f"'--topic', {TOPIC!r}]))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("metaq consume: error:")]
    assert len(lines) == 1 and "always broken" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


# --------------------------------------------------------------------------- damaged logs

def _flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset:offset + 4] = bytes(b ^ 0xA5 for b in data[offset:offset + 4])
    path.write_bytes(bytes(data))


def _load(zk_connect: str, n: int) -> list:
    with Producer(zk_connect) as p:
        return [p.send("d", b"d%03d" % i) for i in range(n)]


@pytest.mark.parametrize("sealed, victim", [(False, 30), (True, 30), (True, 0)])
def test_a_damaged_message_costs_only_itself_and_is_reported(zk_connect, zk_client, brokers,
                                                             sealed, victim):
    """Findings 2 and 3: bytes flipped in a message of the writable (or a sealed) segment
    of a killed broker (in a sealed one, the log's first message too).  Recovery keeps
    every intact message at its offset, offsets are never reused, a group past the
    damage goes on, a new group gets everything else and one DamagedMessageError naming
    the offset."""
    extra = ["--max-segment-size", "4096"] if sealed else []
    b = brokers(0, {"d": 1}, extra_args=extra)
    sent = _load(zk_connect, 300)
    damaged = sent[victim]
    # a group that already consumed past the damage
    zk_client.ensure_path(LAYOUT.offset("late", "d", "0-0"))
    zk_client.set(LAYOUT.offset("late", "d", "0-0"), b"%d-%d" % (sent[199].msg_id,
                                                                  sent[200].offset))
    b.kill()
    seg_dir = b.data_dir / "d-0"
    segs = sorted(seg_dir.glob("*.meta"))
    seg = max((s for s in segs if int(s.name[:20]) <= damaged.offset), key=lambda s: s.name)
    assert (seg == segs[-1]) is not sealed
    _flip(seg, damaged.offset - int(seg.name[:20]) + 20)  # the victim's 4-byte payload
    b.restart()
    more = _load(zk_connect, 10)
    assert more[0].offset == sent[-1].offset + (sent[1].offset - sent[0].offset)
    offsets = {r.offset for r in sent} | {r.offset for r in more}
    assert len(offsets) == 310  # no offset handed out twice

    got, errors = Got(), []
    with _consumer(zk_connect, "late", got, errors, topic="d") as c:
        c.start()
        wait_until(lambda: got.total() == 110, 30, what="the late group's messages")
        assert got.of("0-0") == [b"d%03d" % i for i in range(200, 300)] + \
            [b"d%03d" % i for i in range(10)]
        assert not errors

    got, errors = Got(), []
    with _consumer(zk_connect, "fresh", got, errors, topic="d") as c:
        c.start()
        wait_until(lambda: got.total() == 309, 30, what="every intact message")
        want = [b"d%03d" % i for i in range(300) if i != victim] + \
            [b"d%03d" % i for i in range(10)]
        assert got.of("0-0") == want
        bad = [e for e in errors if isinstance(e, DamagedMessageError)]
        assert len(bad) == 1 and bad[0].offset == damaged.offset
        assert bad[0].next_offset == sent[victim + 1].offset
        assert c.metrics()["damaged_messages"] == 1
    assert log_damage(zk_client, LAYOUT, "d") == \
        {"0-0": (1, sent[victim + 1].offset - damaged.offset)}


def test_garbage_written_under_an_idle_owner_is_repaired(zk_connect, zk_client, loaded):
    """The owner rewrites every offset it holds every REWRITE_EVERY commit periods, so a
    node damaged while its partition sits idle does not stay damaged (found by chaos)."""
    got, errors = Got(), []
    with _consumer(zk_connect, "g5", got, errors) as c:
        c.start()
        wait_until(lambda: got.total() == 20, 30, what="every message")
        path = LAYOUT.offset("g5", TOPIC, "0-0")
        wait_until(lambda: _decodes(zk_client, path), 10, what="the first commit")
        zk_client.set(path, b"garbage")
        wait_until(lambda: _decodes(zk_client, path), 30, what="the node repaired")
        assert got.total() == 20 and not errors
