"""The commit of a prepared XA branch is durable before its messages reach a log (issue
26): the journal's decision (``D``) is fsynced before the first byte of them is written
to a segment, and a ``D`` without its ``C`` (a crash between) is finished at recovery,
once, wherever the messages got to.

How the order is seen: nothing short of cutting the power (a device-mapper log of the
writes, which needs root and a block device) shows what reached the disk first, so the
tests wrap ``os.write``/``os.pwrite``/``os.fsync`` with recorders that call the real
calls (the files are real, nothing is faked) and check the order of the calls: the
journal's write of the decision, its fsync, then the segment's write.  Without the fix
the segment was written right after the journal's write, before its fsync."""

from __future__ import annotations

import os
import socket
import threading

import pytest
from helpers.brokers import BrokerFactory

from metaq.broker import BrokerConfig, Storage
from metaq.protocol import (
    ReplyParser,
    checksum,
    encode_get,
    encode_message,
    encode_put,
    iter_messages,
    xa_key,
)

pytestmark = pytest.mark.broker

TOPIC = "tx"


class Raw:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.parser = ReplyParser()
        self.pending: list = []
        self.opaque = 100

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def replies(self, n: int = 1) -> list:
        while len(self.pending) < n:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("closed")
            self.pending += self.parser.feed(data)
        out, self.pending = self.pending[:n], self.pending[n:]
        return out

    def tx_line(self, key: str, type: str) -> bytes:
        self.opaque += 1
        return f"transaction {key} s1 {type} uq {self.opaque}\r\n".encode()

    def tx(self, key: str, type: str):
        self.send(self.tx_line(key, type))
        return self.replies()[0]

    def put(self, key: str | None, body: bytes):
        self.opaque += 1
        self.send(encode_put(TOPIC, 0, body, 0, checksum(body), self.opaque, tx_key=key))
        return self.replies()[0]

    def bodies(self) -> list[bytes]:
        out, pos = [], 0
        while True:
            self.send(encode_get(TOPIC, "g", 0, pos, 1 << 20, 1))
            r = self.replies()[0]
            if getattr(r, "code", 200) != 200 or not r.body:
                return out
            msgs = list(iter_messages(r.body, pos))
            out += [bytes(m.payload) for m in msgs]
            pos = msgs[-1].next_offset

    def close(self) -> None:
        self.sock.close()


class Recorder:
    """``os.write``, ``os.pwrite`` and ``os.fsync`` recorded (path, call), then done;
    ``hold`` makes the next fsync of the journal wait until released."""

    def __init__(self, monkeypatch) -> None:
        self.events: list[tuple[str, str, int]] = []
        self.lock = threading.Lock()
        self.hold = False
        self.held = threading.Event()
        self.release = threading.Event()
        real_write, real_pwrite, real_fsync = os.write, os.pwrite, os.fsync

        def path(fd: int) -> str:
            try:
                return os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                return "?"

        def write(fd, data):
            n = real_write(fd, data)
            with self.lock:
                self.events.append(("write", path(fd), n))
            return n

        def pwrite(fd, data, offset):
            n = real_pwrite(fd, data, offset)
            with self.lock:
                self.events.append(("pwrite", path(fd), n))
            return n

        def fsync(fd):
            p = path(fd)
            if self.hold and p.endswith("/journal"):
                self.hold = False
                self.held.set()
                assert self.release.wait(30)
            real_fsync(fd)
            with self.lock:
                self.events.append(("fsync", p, 0))

        monkeypatch.setattr(os, "write", write)
        monkeypatch.setattr(os, "pwrite", pwrite)
        monkeypatch.setattr(os, "fsync", fsync)


def _journal_records(path) -> list[tuple[bytes, int]]:
    """``(kind, end offset)`` of every record of the journal file."""
    data = path.read_bytes()
    out, pos = [], 0
    while pos < len(data):
        length = int.from_bytes(data[pos:pos + 4], "big")
        out.append((data[pos + 8:pos + 9], pos + 8 + length))
        pos += 8 + length
    return out


@pytest.mark.parametrize("unflush_threshold", [1000, 1, 0], ids=["default", "every", "group"])
def test_the_commit_decision_is_fsynced_before_the_messages_are_written(
        tmp_path, monkeypatch, unflush_threshold):
    factory = BrokerFactory(tmp_path)
    with factory:
        b = factory({TOPIC: 1}, unflush_threshold=unflush_threshold)
        journal = b.config.data_dir / "transactions" / "journal"
        c = Raw(b.port)
        x = xa_key(1, b"g", b"b", "uq")
        assert c.tx(x, "BEGIN").code == 200
        for i in range(3):
            assert c.put(x, b"m%d" % i).code == 200
        assert c.tx(x, "PREPARE").body == b"0"
        base = journal.stat().st_size
        rec = Recorder(monkeypatch)
        assert c.tx(x, "COMMIT_TWO_PHASE").code == 200
        assert c.bodies() == [b"m0", b"m1", b"m2"]
        monkeypatch.undo()
        c.close()
        events = list(rec.events)
    decision = next(end for kind, end in _journal_records(journal) if end > base
                    and kind in (b"D", b"C"))
    size, i_write = base, None
    for i, (call, path, n) in enumerate(events):
        if call == "write" and path == str(journal):
            size += n
            if size >= decision:
                i_write = i
                break
    assert i_write is not None, events
    i_fsync = next(i for i, (call, path, _n) in enumerate(events)
                   if i > i_write and call == "fsync" and path == str(journal))
    i_segment = next(i for i, (call, path, _n) in enumerate(events)
                     if call == "pwrite" and path.endswith(".meta"))
    assert i_write < i_fsync < i_segment, events
    kinds = [kind for kind, end in _journal_records(journal) if end > base]
    assert kinds == [b"D", b"C"]


def test_a_committing_branch_refuses_rollback_and_shows_nothing_until_decided(
        tmp_path, monkeypatch):
    factory = BrokerFactory(tmp_path)
    with factory:
        b = factory({TOPIC: 1})
        a, other = Raw(b.port), Raw(b.port)
        x = xa_key(2, b"g", b"b", "uq")
        a.tx(x, "BEGIN")
        assert a.put(x, b"one").code == 200
        assert a.tx(x, "PREPARE").body == b"0"
        rec = Recorder(monkeypatch)
        rec.hold = True
        a.send(a.tx_line(x, "COMMIT_TWO_PHASE") + a.tx_line("null", "RECOVER"))
        assert rec.held.wait(10)  # the decision is being fsynced
        r = other.tx(x, "ROLLBACK")
        assert r.code == 500 and r.body.startswith(b"XAException:code=-6,")
        assert b"committing" in r.body
        r = other.tx(x, "COMMIT_TWO_PHASE")
        assert r.code == 500 and r.body.startswith(b"XAException:code=-6,")
        assert other.bodies() == []  # not appended before the decision is on disk
        rec.release.set()
        commit, recover = a.replies(2)  # in request order
        assert commit.code == 200 and (recover.code, recover.body) == (200, b"")
        assert other.bodies() == [b"one"]
        monkeypatch.undo()
        a.close()
        other.close()


def _decided_but_not_committed(tmp_path, landed: list[bytes], appended: int) -> tuple:
    """A data dir as a crash leaves it between the decision and the commit record: the
    journal has P, R, D (lower bound: the end then); ``landed`` messages were appended by
    others after it, then ``appended`` of the branch's 3 messages reached the log."""
    from metaq.broker._txjournal import TxJournal

    cfg = BrokerConfig(broker_id=0, data_dir=tmp_path, port=0, topics={TOPIC: 1})
    factory = BrokerFactory(tmp_path)
    with factory:
        b = factory(config=cfg)
        Raw(b.port).put(None, b"before")
    x = xa_key(3, b"g", b"b", "uq")
    msgs = [encode_message(5000 + i, 0, b"c%d" % i) for i in range(3)]
    with Storage(tmp_path) as s:
        plog = s.open_topic(TOPIC, 1)[0]
        lower = plog.end
        for i, body in enumerate(landed):
            plog.append(encode_message(9000 + i, 0, body), 1)
        if appended:
            plog.append(b"".join(msgs[:appended]), appended)
    j = TxJournal(tmp_path / "transactions")
    for m in msgs:
        j.put(x, TOPIC, 0, m)
    j.prepare(x)
    j.decide(x, [(TOPIC, 0, lower, sum(map(len, msgs)))])
    j.close()
    return cfg, x


@pytest.mark.parametrize("landed,appended", [
    ([], 0), ([], 3), ([], 1), ([b"o1", b"o2"], 0), ([b"o1", b"o2"], 2), ([b"o1"], 3)])
def test_a_decided_commit_cut_short_is_finished_once_at_recovery(tmp_path, landed, appended):
    cfg, x = _decided_but_not_committed(tmp_path, landed, appended)
    want = [b"before", *landed, b"c0", b"c1", b"c2"]
    for _ in range(2):  # and a second restart changes nothing
        factory = BrokerFactory(tmp_path)
        with factory:
            b = factory(config=cfg)
            c = Raw(b.port)
            assert c.bodies() == want
            assert c.tx("null", "RECOVER").body == b""  # committed: not prepared again
            c.close()


def _prepared_with_messages_in_log(tmp_path, landed: list[bytes], appended: list[int]
                                   ) -> tuple:
    """A promoted slave's data dir when its master's ``D`` had not reached it but the
    commit's messages had (they travel apart, ``_txfeed``): the journal has P and R
    (with the partitions' ends at the prepare as lower bounds), no D; after ``landed``
    messages of others, ``appended[p]`` of the branch's 2 messages in partition ``p``
    reached the log."""
    from metaq.broker._txjournal import TxJournal

    cfg = BrokerConfig(broker_id=0, data_dir=tmp_path, port=0, topics={TOPIC: 2})
    with BrokerFactory(tmp_path) as factory:
        b = factory(config=cfg)
        Raw(b.port).put(None, b"before")
    x = xa_key(4, b"g", b"b", "uq")
    msgs = {p: [encode_message(6000 + 10 * p + i, 0, b"p%d-%d" % (p, i)) for i in range(2)]
            for p in (0, 1)}
    j = TxJournal(tmp_path / "transactions")
    bounds = []
    with Storage(tmp_path) as s:
        logs = s.open_topic(TOPIC, 2)
        for p in (0, 1):
            bounds.append((TOPIC, p, logs[p].end, sum(map(len, msgs[p]))))
        for i, body in enumerate(landed):
            logs[0].append(encode_message(9000 + i, 0, body), 1)
        for p in (0, 1):
            if appended[p]:
                logs[p].append(b"".join(msgs[p][:appended[p]]), appended[p])
    for p in (0, 1):
        for m in msgs[p]:
            j.put(x, TOPIC, p, m)
    j.prepare(x, bounds)
    j.close()
    return cfg, x


def _bodies(port: int, partition: int) -> list[bytes]:
    c = Raw(port)
    try:
        out, off = [], 0
        while True:
            c.send(encode_get(TOPIC, "g", partition, off, 1 << 20, 1))
            r = c.replies()[0]
            if getattr(r, "code", 200) != 200 or not r.body:
                return out
            out += [bytes(m.payload) for m in iter_messages(r.body)]
            off += len(r.body)
    finally:
        c.close()


@pytest.mark.parametrize("landed,appended", [
    ([], [2, 2]), ([b"o1"], [2, 2]), ([b"o1", b"o2"], [1, 0]), ([], [0, 2]), ([], [2, 1])])
def test_a_prepared_branch_whose_messages_a_log_holds_is_finished_not_prepared_again(
        tmp_path, landed, appended):
    """Found committed: what is missing is appended once, and RECOVER does not list it
    (a transaction manager's COMMIT of it again would store it twice)."""
    cfg, _x = _prepared_with_messages_in_log(tmp_path, landed, appended)
    want = {0: [b"before", *landed, b"p0-0", b"p0-1"], 1: [b"p1-0", b"p1-1"]}
    for _ in range(2):  # and a second restart changes nothing
        with BrokerFactory(tmp_path) as factory:
            b = factory(config=cfg)
            assert {p: _bodies(b.port, p) for p in (0, 1)} == want
            c = Raw(b.port)
            assert c.tx("null", "RECOVER").body == b""
            c.close()


def test_a_prepared_branch_whose_messages_no_log_holds_stays_prepared(tmp_path):
    cfg, x = _prepared_with_messages_in_log(tmp_path, [b"o1"], [0, 0])
    with BrokerFactory(tmp_path) as factory:
        b = factory(config=cfg)
        c = Raw(b.port)
        assert c.tx("null", "RECOVER").body == x.encode()
        assert c.tx(x, "COMMIT_TWO_PHASE").code == 200
        c.close()
        assert _bodies(b.port, 0) == [b"before", b"o1", b"p0-0", b"p0-1"]
        assert _bodies(b.port, 1) == [b"p1-0", b"p1-1"]
