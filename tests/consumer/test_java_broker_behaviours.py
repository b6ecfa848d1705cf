"""Issue 19: what a real Java Metaq 1.4 broker does that ours does not, reproduced with our
broker's ``java_*`` options (a real broker over TCP, registered in a real ZooKeeper):

1. ``offset`` of a partition never written answers 404 "... is not exists": such a
   partition is empty for every tool and for Spark planning;
2. a get past the fsynced end answers 301 with an earlier offset: the consumer re-reads
   and delivers nothing twice, and still delivers everything when the log really changed;
   at a committed offset without msgId (nothing to check a re-read against) it asks again
   with Metaq's backoff, and resets (reported) only when the 301 outlasts the longest
   backoff (issue 25; the real Java broker's race is tests/interop/test_java_broker_301.py);
3. a message bigger than the broker's transfer cap can never be read: reported once,
   backed off, read as soon as the cap is raised;
4. ``offset`` of a position inside the log answers the start of its segment, not of a
   message, and a get past the flushed end answers 404 (``updateConsumerOffsets=false``):
   a position check walks from the segment start to the message holding the position,
   and a position above the (lagging) end is asked about again before offset_reset.
"""

from __future__ import annotations

import itertools
import os
import socketserver
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from metaq import MessageConsumer, MessageError, OffsetOutOfRangeError, Producer
from metaq._admin import UNWRITTEN_NOTE, describe_group, log_ends, reset_offsets
from metaq.broker import Broker, BrokerConfig
from metaq.broker._registry import BrokerRegistry
from metaq.protocol import encode_message, encode_result, encode_value_header
from metaq.testing import free_port, wait_until
from zk_layout import Layout

pytestmark = [pytest.mark.broker, pytest.mark.zk]

TOPIC = "jv"
LAYOUT = Layout()


def broker_config(zk_connect: str, data_dir: Path, port: int | None = None, **kw) -> BrokerConfig:
    return BrokerConfig(broker_id=0, data_dir=data_dir, port=port or free_port(),
                        topics={TOPIC: 2}, zk_connect=zk_connect, zk_session_timeout=6.0, **kw)


class Got:
    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.lock = threading.Lock()

    def __call__(self, m) -> None:  # noqa: ANN001
        with self.lock:
            self.bodies.append(bytes(m.body))

    def snapshot(self) -> list[bytes]:
        with self.lock:
            return list(self.bodies)


def send(zk_connect: str, bodies: list[bytes], partition: str = "0-0") -> None:
    with Producer(zk_connect, partitioner=lambda topic, parts, body, key: partition) as p:
        for b in bodies:
            p.send(TOPIC, b)


def cli(zk_connect: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "metaq", *args, "--zk", zk_connect],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})


# -- 1. unwritten partitions ---------------------------------------------------------------

def test_an_unwritten_partition_is_empty_for_the_tools(zk_connect, zk_client, tmp_path):
    with Broker(broker_config(zk_connect, tmp_path, java_unwritten_404=True)):
        send(zk_connect, [b"a", b"b", b"c"], "0-0")  # 0-1 is never written
        unwritten: set[str] = set()
        ends = log_ends(zk_client, LAYOUT, TOPIC, unwritten=unwritten)
        assert ends["0-1"] == (0, 0) and unwritten == {"0-1"}
        assert ends["0-0"][1] > 0

        r = cli(zk_connect, "topic", "describe", TOPIC)
        assert r.returncode == 0, r.stderr
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("0-1")]
        assert len(lines) == 1, r.stdout
        line = lines[0]
        assert UNWRITTEN_NOTE in line and line.split()[2:4] == ["0", "0"]

        zk_client.ensure_path(LAYOUT.consumer_ids("g-un"))
        zk_client.ensure_path(LAYOUT.offsets_dir("g-un", TOPIC))
        report = describe_group(zk_client, LAYOUT, "g-un")
        (p1,) = [p for p in report.partitions if p.partition == "0-1"]
        assert (p1.log_end, p1.lag, p1.note) == (0, 0, UNWRITTEN_NOTE)

        out = reset_offsets(zk_client, LAYOUT, "g-un", TOPIC, to="latest")
        assert out["0-1"] == (None, 0) and out["0-0"][1] == ends["0-0"][1]

        # a consumer of the group reads the written partition and waits on the other
        got = Got()
        c = MessageConsumer("g-new", zk_connect, commit_period=0.2)
        c.subscribe(TOPIC, got)
        with c:
            c.start()
            wait_until(lambda: len(got.snapshot()) == 3, 30, what="the three messages")
            send(zk_connect, [b"late"], "0-1")  # the first put creates it
            wait_until(lambda: b"late" in got.snapshot(), 30, what="the first message of 0-1")


# -- 2. rewinds ------------------------------------------------------------------------------

def test_a_rewind_to_the_fsynced_end_delivers_nothing_twice(zk_connect, tmp_path):
    # nothing is fsynced for a long time: every get at the end is sent back to offset 0..
    cfg = broker_config(zk_connect, tmp_path, java_tell_max_offset=True,
                        unflush_threshold=1_000_000, unflush_interval=3600.0)
    errors: list = []
    with Broker(cfg):
        got = Got()
        c = MessageConsumer("g-rw", zk_connect, commit_period=0.2, max_fetch_delay=0.2,
                            on_error=errors.append)
        c.subscribe(TOPIC, got)
        with c:
            c.start()
            for k in range(5):  # rounds: each ends with the consumer sent back
                send(zk_connect, [b"m%d-%d" % (k, i) for i in range(7)])
                want = [b"m%d-%d" % (j, i) for j in range(k + 1) for i in range(7)]
                wait_until(lambda w=want: got.snapshot() == w, 30,
                           what=f"round {k}'s messages, once each")
                wait_until(lambda k=k: c.metrics()["broker_rewinds"] > k, 30,
                           what="the broker sending it back")
            m = c.metrics()
            assert m["redelivered_skipped"] >= 5 * 7
            assert got.snapshot() == want  # nothing delivered twice, in order
    assert not [e for e in errors if isinstance(e, OffsetOutOfRangeError)]


def test_a_real_rewind_still_delivers_everything(zk_connect, tmp_path):
    """The log really lost its last messages (cut while the broker was down): the
    consumer, sent back, finds the message it delivered last gone and follows
    offset_reset (earliest: everything again, never a gap)."""
    cfg = broker_config(zk_connect, tmp_path, java_tell_max_offset=True,
                        unflush_threshold=1)
    errors: list = []
    got = Got()
    with Broker(cfg):
        send(zk_connect, [b"old-%d" % i for i in range(6)])
        c = MessageConsumer("g-real", zk_connect, commit_period=0.2, max_fetch_delay=0.2,
                            on_error=errors.append)
        c.subscribe(TOPIC, got)
        c.start()
        wait_until(lambda: len(got.snapshot()) == 6, 30, what="the six messages")
    seg = sorted((tmp_path / f"{TOPIC}-0").glob("*.meta"))[-1]
    size = seg.stat().st_size
    os.truncate(seg, size - 2 * (size // 6))  # the last two messages are gone
    cfg = broker_config(zk_connect, tmp_path, port=cfg.port, java_tell_max_offset=True,
                        unflush_threshold=1)
    with Broker(cfg):
        send(zk_connect, [b"new-0"])
        wait_until(lambda: b"new-0" in got.snapshot(), 30, what="the message written after")
        c.close()
    seen = got.snapshot()
    assert seen[:6] == [b"old-%d" % i for i in range(6)]
    assert [e for e in errors if isinstance(e, OffsetOutOfRangeError)]
    assert set(seen) >= {b"old-0", b"old-1", b"old-2", b"old-3", b"new-0"}


class FlushLagBroker:
    """A stand-in for a Java broker's partition ``jv/0-0`` whose max offset is what it
    flushed (``highWaterMark``) while a get below it is served up to what it wrote, as in
    ``MessageStore``/``FileMessageSet``: a get at the max offset answers 404, past it 301
    with the max offset (``updateConsumerOffsets=true``).  Our broker's ``java_tell_max_
    offset`` serves whatever is written at any offset, so it never answers that 404."""

    def __init__(self, zk_connect: str, *, update_offsets: bool = True) -> None:
        self.update_offsets = update_offsets  # False: past the end is 404, as at it
        self.data = bytearray()
        self.flushed = 0
        self.answers: list[tuple[int, int]] = []  # (offset, code) of every get
        self.lock = threading.Lock()
        self._ids = itertools.count(1 << 40)
        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="flush-lag-broker")
        self._registry = BrokerRegistry(zk_connect=zk_connect, zk_root="/meta", broker_id=0,
                                        host="127.0.0.1", port=self._server.server_address[1],
                                        topics=lambda: {TOPIC: 1})

    def __enter__(self) -> FlushLagBroker:
        self._thread.start()
        self._registry.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._registry.stop()
        self._server.shutdown()
        self._server.server_close()

    def write(self, bodies: list[bytes], flush: bool) -> None:
        with self.lock:
            for body in bodies:
                self.data += encode_message(next(self._ids), 0, body)
            if flush:
                self.flushed = len(self.data)

    def count(self, offset: int, code: int) -> int:
        with self.lock:
            return self.answers.count((offset, code))

    def answer(self, line: bytes) -> bytes:
        verb, *args = line.decode().split()
        opaque = int(args[-1])
        with self.lock:
            if verb == "get":  # get topic group partition offset maxSize opaque
                offset, size = int(args[3]), int(args[4])
                code = 200 if offset < self.flushed else 404 if (
                    offset == self.flushed or not self.update_offsets) else 301
                self.answers.append((offset, code))
                if code == 200:
                    chunk = bytes(self.data[offset:offset + size])
                    return encode_value_header(len(chunk), opaque) + chunk
                body = b"Could not find message" if code == 404 else b"%d" % self.flushed
                return encode_result(code, body, opaque)
            if verb == "offset":  # Java: the max offset for any offset at or past it
                offset = int(args[3])
                return encode_result(200, b"%d" % (0 if offset < self.flushed
                                                   else self.flushed), opaque)
        if verb == "version":
            return encode_result(200, b"1.4.6.3-SNAPSHOT", opaque)
        return encode_result(500, b"unknown command", opaque)

    def _handler(self) -> type[socketserver.StreamRequestHandler]:
        stub = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                for line in self.rfile:
                    if line.startswith(b"quit"):
                        return
                    self.wfile.write(stub.answer(line))
                    self.wfile.flush()
        return Handler


def test_a_404_at_the_max_offset_a_301_named_is_waited_out(zk_connect):
    """Issue 25 (the real Java broker's race): the consumer read bytes written but not
    flushed, asks after them, is sent back to the flushed end, and its re-read there gets
    404 until the broker flushes.  That 404 is a lag, not a shorter log: it waits, then
    the re-read passes over what was delivered; nothing goes to offset_reset."""
    errors: list = []
    got = Got()
    with FlushLagBroker(zk_connect) as b:
        b.write([b"a-0", b"a-1", b"a-2"], flush=True)
        max_offset = b.flushed
        b.write([b"b-0", b"b-1"], flush=False)  # served below the max offset, not flushed
        first = [b"a-0", b"a-1", b"a-2", b"b-0", b"b-1"]
        c = MessageConsumer("g-lag", zk_connect, commit_period=0.2, max_fetch_delay=2.0,
                            on_error=errors.append)
        c.subscribe(TOPIC, got)
        with c:
            c.start()
            wait_until(lambda: b.count(max_offset, 404) >= 2, 30,
                       what="the re-read at the broker's max offset answered 404 twice")
            assert got.snapshot() == first and errors == []
            b.write([], flush=True)  # the broker flushes: its max offset catches up
            b.write([b"c-0"], flush=True)
            wait_until(lambda: len(got.snapshot()) > 5, 30, what="the message after")
            assert got.snapshot() == [*first, b"c-0"]
            m = c.metrics()
            assert (m["broker_rewinds"], m["redelivered_skipped"], m["offset_resets"]) == (1, 2, 0)
    assert errors == []


def test_a_committed_offset_past_a_lagging_end_waits_without_301(zk_connect, zk_client):
    """Issue 25, the same race without ``updateConsumerOffsets``: a member took over at an
    offset its predecessor committed after reading unflushed bytes; the broker answers
    404 there and says its log ends before it.  That is a lag: the member asks again with
    Metaq's backoff and delivers what comes next once, instead of offset_reset=earliest
    delivering every old message again."""
    errors: list = []
    got = Got()
    with FlushLagBroker(zk_connect, update_offsets=False) as b:
        b.write([b"old-%d" % i for i in range(4)], flush=True)
        b.write([b"unflushed"], flush=False)
        ahead = len(b.data)  # where the predecessor stopped and committed
        zk_client.ensure_path(LAYOUT.consumer_ids("g-lag404"))
        reset_offsets(zk_client, LAYOUT, "g-lag404", TOPIC, to=ahead)
        c = MessageConsumer("g-lag404", zk_connect, commit_period=0.2, max_fetch_delay=2.0,
                            on_error=errors.append)
        c.subscribe(TOPIC, got)
        with c:
            c.start()
            wait_until(lambda: b.count(ahead, 404) >= 3, 30,
                       what="three gets at the committed offset answered 404")
            assert got.snapshot() == [] and errors == []
            b.write([b"new-0"], flush=True)  # the broker flushes, then more comes
            wait_until(lambda: got.snapshot(), 30, what="the message after the position")
            assert got.snapshot() == [b"new-0"]
            assert c.metrics()["offset_resets"] == 0
    assert errors == []


def test_a_position_inside_a_message_goes_back_to_that_message_not_the_segment(zk_connect,
                                                                           zk_client):
    """A Java broker answers ``offset`` inside the log with its segment's start (it lists
    no ``+boundary``): a committed position inside a message is walked to from there, and
    only that message is read again (reported as a boundary reset), not the segment."""
    errors: list = []
    got = Got()
    with FlushLagBroker(zk_connect) as b:
        bodies = [b"m-%d" % i for i in range(10)]
        b.write(bodies[:5], flush=True)
        fifth = len(b.data)  # where m-5 starts
        b.write(bodies[5:], flush=True)
        zk_client.ensure_path(LAYOUT.consumer_ids("g-inside"))
        reset_offsets(zk_client, LAYOUT, "g-inside", TOPIC, to=fifth + 7)  # inside m-5
        c = MessageConsumer("g-inside", zk_connect, commit_period=0.2, max_fetch_delay=0.5,
                            on_error=errors.append)
        c.subscribe(TOPIC, got)
        with c:
            c.start()
            wait_until(lambda: len(got.snapshot()) >= 5, 30, what="m-5 to m-9")
            assert got.snapshot() == bodies[5:]
    (err,) = [e for e in errors if isinstance(e, OffsetOutOfRangeError)]
    assert err.action == "boundary" and err.offset == fifth + 7 and str(fifth) in str(err)


def broker_gets(b: Broker) -> int:
    return int(next(ln.split()[2] for ln in b.stats().splitlines()
                    if ln.startswith("STAT cmd_get ")))


def test_a_301_at_a_committed_offset_without_msgid_waits_for_the_broker(zk_connect,
                                                                       zk_client, tmp_path):
    """Issue 25: a committed offset without a msgId (written by a tool or another client)
    at the log end, above what the broker calls its max offset (nothing fsynced): there
    is no msgId to check a re-read against, so the consumer asks again from there with
    Metaq's backoff instead of going to offset_reset (earliest: every message written
    before the group's position, again); what comes there next is delivered, once."""
    cfg = BrokerConfig(broker_id=0, data_dir=tmp_path, port=free_port(), topics={TOPIC: 1},
                       zk_connect=zk_connect, zk_session_timeout=6.0,
                       java_tell_max_offset=True, unflush_threshold=1_000_000,
                       unflush_interval=3600.0)
    errors: list = []
    got = Got()
    with Broker(cfg) as b:
        send(zk_connect, [b"old-%d" % i for i in range(5)])
        zk_client.ensure_path(LAYOUT.consumer_ids("g-noid"))
        out = reset_offsets(zk_client, LAYOUT, "g-noid", TOPIC, to="latest")
        end = out["0-0"][1]
        assert end > 0
        before = broker_gets(b)
        c = MessageConsumer("g-noid", zk_connect, commit_period=0.2, max_fetch_delay=2.0,
                            on_error=errors.append)
        c.subscribe(TOPIC, got)
        with c:
            c.start()
            # four gets at the committed offset, each answered 301 "0" (the fsynced end)
            wait_until(lambda: broker_gets(b) >= before + 4, 30,
                       what="the consumer asking four times")
            assert got.snapshot() == [] and not errors
            assert c.metrics()["partitions"][f"{TOPIC}/0-0"]["position"] == end
            send(zk_connect, [b"new-%d" % i for i in range(3)])
            wait_until(lambda: len(got.snapshot()) >= 3, 30, what="the new messages")
            assert got.snapshot() == [b"new-0", b"new-1", b"new-2"]
            assert c.metrics()["offset_resets"] == 0
    assert errors == []


def test_a_301_that_persists_past_the_longest_backoff_is_reported(zk_connect, zk_client,
                                                                  tmp_path):
    """... but an offset the broker keeps calling above its end for longer than the
    longest backoff is not a lag: offset_reset, reported as before."""
    cfg = broker_config(zk_connect, tmp_path, java_tell_max_offset=True)
    errors: list = []
    got = Got()
    with Broker(cfg):
        send(zk_connect, [b"old-%d" % i for i in range(5)])
        zk_client.ensure_path(LAYOUT.consumer_ids("g-far"))
        reset_offsets(zk_client, LAYOUT, "g-far", TOPIC, to=100_000)
        c = MessageConsumer("g-far", zk_connect, commit_period=0.2, max_fetch_delay=0.2,
                            on_error=errors.append)
        c.subscribe(TOPIC, got)
        with c:
            c.start()
            wait_until(lambda: len(got.snapshot()) >= 5, 30,
                       what="offset_reset=earliest delivering from the log start")
    (err,) = [e for e in errors if isinstance(e, OffsetOutOfRangeError) and e.partition == "0-0"]
    assert err.action == "earliest" and err.offset == 100_000
    assert "above the log end" in str(err)
    assert got.snapshot()[:5] == [b"old-%d" % i for i in range(5)]


# -- 3. over the transfer cap ----------------------------------------------------------------

def test_a_message_over_the_transfer_cap_is_reported_then_read_when_raised(zk_connect,
                                                                           zk_client, tmp_path):
    cap = 64 * 1024
    cfg = broker_config(zk_connect, tmp_path, java_transfer_cap=True, max_transfer_size=cap)
    errors: list = []
    got = Got()
    big = os.urandom(100_000)
    with Broker(cfg) as b:
        send(zk_connect, [b"before", big, b"after"])
        c = MessageConsumer("g-cap", zk_connect, commit_period=0.2, max_fetch_delay=0.5,
                            on_error=errors.append)
        c.subscribe(TOPIC, got)
        c.start()
        wait_until(lambda: any(isinstance(e, MessageError) for e in errors), 30,
                   what="the over-cap message reported")
        (err,) = [e for e in errors if isinstance(e, MessageError)]
        assert "100020 bytes" in str(err) and f"at most {cap} bytes" in str(err)
        assert "maxTransferSize" in str(err)
        part = c.metrics()["partitions"][f"{TOPIC}/0-0"]
        assert part["over_transfer_cap"] == {"message_size": 100_020, "broker_sends": cap}
        assert got.snapshot() == [b"before"]  # in order: nothing after it either
        wait_until(lambda: c.metrics()["partitions"][f"{TOPIC}/0-0"]["committed"] > 0, 30,
                   what="the first message committed")
        report = describe_group(zk_client, LAYOUT, "g-cap")
        (p0,) = [p for p in report.partitions if p.partition == "0-0"]
        assert p0.state == "over transfer cap" and report.status == "error"
        assert "100020 bytes" in p0.note and f"at most {cap}" in p0.note
        gets = int(next(ln.split()[2] for ln in b.stats().splitlines()
                        if ln.startswith("STAT cmd_get ")))
    assert gets < 50  # backed off, not the thousands of a silent loop
    # the operator raises the cap (here: the broker without Java's cap) and restarts it
    cfg = broker_config(zk_connect, tmp_path, port=cfg.port)
    with Broker(cfg):
        wait_until(lambda: len(got.snapshot()) == 3, 30, what="the big message, then after")
        assert got.snapshot() == [b"before", big, b"after"]
        assert c.metrics()["partitions"][f"{TOPIC}/0-0"]["over_transfer_cap"] is None
        c.close()
    assert len([e for e in errors if isinstance(e, MessageError)]) == 1  # reported once

