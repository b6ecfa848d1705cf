"""Held gets (metaq-py's long polling) against real broker processes: the broker's side
of the wire extension, the fetcher's parking and its cancellation, and the fallback to
Metaq's backoff against a broker that does not hold."""

from __future__ import annotations

import socket
import threading
import time
import zlib
from collections import defaultdict

import pytest

from metaq import MessageConsumer, Producer
from metaq.broker import Broker, BrokerConfig
from metaq.consumer._fetcher import FetchManager
from metaq.consumer._subscription import PartitionState
from metaq.protocol import (
    BOUNDARY_CAPABILITY,
    HOLD_CAPABILITY,
    ReplyParser,
    Result,
    Value,
    build_payload,
    encode_get,
    encode_put,
    encode_stats,
    encode_version,
    get_codec,
)
from metaq.testing import wait_until

pytestmark = pytest.mark.broker

TOPIC = "t"


class Client:
    """A raw protocol client over a real socket; replies kept by opaque."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.parser = ReplyParser()
        self.got: list = []

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def next(self):  # noqa: ANN201 - the next reply, in the order the broker sent them
        while not self.got:
            data = self.sock.recv(1 << 20)
            if not data:
                raise ConnectionError("broker closed the connection")
            self.got += self.parser.feed(data)
        return self.got.pop(0)

    def put(self, partition: int, body: bytes, opaque: int = 9) -> Result:
        payload, flag = build_payload(body, None)
        self.send(encode_put(TOPIC, partition, payload, flag,
                             zlib.crc32(payload) & 0x7FFFFFFF, opaque))
        r = self.next()
        assert isinstance(r, Result) and r.code == 200, r
        return r

    def stats(self) -> dict[str, str]:
        self.send(encode_stats(None, 77))
        r = self.next()
        assert r.opaque == 77
        out = {}
        for line in bytes(r.body).decode().splitlines():
            _stat, key, value = line.split(" ", 2)
            out[key] = value
        return out

    def close(self) -> None:
        self.sock.close()


def _stat(port: int, key: str) -> int:
    c = Client(port)
    try:
        return int(c.stats()[key])
    finally:
        c.close()


@pytest.fixture
def broker(brokers):
    return brokers(0, {TOPIC: 4})


# --------------------------------------------------------------------------- the broker

def test_version_lists_the_hold_capability(broker):
    c = Client(broker.port)
    c.send(encode_version(1))
    caps = bytes(c.next().body).decode().split()
    assert HOLD_CAPABILITY in caps and BOUNDARY_CAPABILITY in caps


def test_held_get_is_answered_by_a_put_to_its_partition_and_only_that(broker):
    waiter, writer = Client(broker.port), Client(broker.port)
    waiter.send(encode_get(TOPIC, "g", 0, 0, 1 << 20, 1, hold_ms=60_000))
    # a later request on the same connection is answered while the get is held
    waiter.send(encode_version(2))
    assert waiter.next().opaque == 2
    wait_until(lambda: _stat(broker.port, "held_gets") == 1, 10, what="the get to be held")
    writer.put(1, b"to another partition")
    waiter.send(encode_version(3))
    assert waiter.next().opaque == 3  # not woken: the version reply comes first
    writer.put(0, b"hello")
    reply = waiter.next()
    assert isinstance(reply, Value) and reply.opaque == 1
    assert bytes(reply.body).endswith(b"hello")
    stats = writer.stats()
    assert stats["held_gets"] == "0" and stats["get_held_woken"] == "1"


def test_a_held_get_is_answered_before_the_put_that_woke_it(broker):
    """Consumers first (as Redis answers blocked readers before the XADD), in the same
    read as the put rather than a turn of the broker's loop later."""
    c = Client(broker.port)
    c.send(encode_get(TOPIC, "g", 3, 0, 1 << 20, 1, hold_ms=60_000))
    wait_until(lambda: _stat(broker.port, "held_gets") == 1, 10, what="the get to be held")
    payload, flag = build_payload(b"wake", None)
    c.send(encode_put(TOPIC, 3, payload, flag, zlib.crc32(payload) & 0x7FFFFFFF, 9))
    first, second = c.next(), c.next()
    assert isinstance(first, Value) and first.opaque == 1
    assert bytes(first.body).endswith(b"wake")
    assert isinstance(second, Result) and second.code == 200 and second.opaque == 9
    c.close()


def test_hold_expires_with_the_normal_answer(broker):
    c = Client(broker.port)
    c.send(encode_get(TOPIC, "g", 2, 0, 1024, 5))
    plain = c.next()
    start = time.monotonic()
    c.send(encode_get(TOPIC, "g", 2, 0, 1024, 6, hold_ms=400))
    held = c.next()
    waited = time.monotonic() - start
    assert isinstance(held, Result) and held.code == 404 and held.opaque == 6
    assert (held.code, bytes(held.body)) == (plain.code, bytes(plain.body))
    assert waited >= 0.35  # it was held (and answered, not dropped)
    assert int(c.stats()["get_held_expired"]) == 1


def test_a_plain_get_is_never_held(broker):
    c = Client(broker.port)
    c.send(encode_get(TOPIC, "g", 0, 0, 1024, 1) + encode_version(2))
    first = c.next()
    assert isinstance(first, Result) and first.code == 404 and first.opaque == 1
    assert c.next().opaque == 2
    stats = c.stats()
    assert stats["get_held"] == "0" and stats["get_hold_asked"] == "0"


def test_a_get_with_data_or_past_the_end_is_answered_at_once(broker):
    c = Client(broker.port)
    c.put(3, b"x")
    c.send(encode_get(TOPIC, "g", 3, 0, 1024, 1, hold_ms=60_000))
    assert isinstance(c.next(), Value)
    c.send(encode_get(TOPIC, "g", 3, 10_000, 1024, 2, hold_ms=60_000))
    r = c.next()
    assert r.code == 404 and r.opaque == 2  # a wrong offset is not waited on
    assert c.stats()["get_held"] == "0"


def test_group_commit_answers_a_held_get_once_the_put_is_durable(brokers):
    b = brokers(0, {TOPIC: 1}, group_commit=True)
    waiter, writer = Client(b.port), Client(b.port)
    waiter.send(encode_get(TOPIC, "g", 0, 0, 1 << 20, 1, hold_ms=60_000))
    wait_until(lambda: _stat(b.port, "held_gets") == 1, 10, what="the get to be held")
    writer.put(0, b"durable")  # acknowledged after its fsync
    reply = waiter.next()
    assert isinstance(reply, Value) and bytes(reply.body).endswith(b"durable")


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_ten_thousand_held_gets_cost_bounded_memory(broker):
    """10,000 held gets over 10 connections, three times over: held, then answered by
    puts or dropped with their connections; the broker's memory does not keep growing."""
    writer = Client(broker.port)
    rss = []
    for round_ in range(3):
        clients = [Client(broker.port) for _ in range(10)]
        ends = [_end(writer, p) for p in range(4)]
        for k, c in enumerate(clients):
            c.send(b"".join(encode_get(TOPIC, "g", i % 4, ends[i % 4], 1024, k * 1000 + i,
                                       hold_ms=120_000) for i in range(1000)))
        wait_until(lambda: _stat(broker.port, "held_gets") == 10_000, 30,
                   what="10,000 held gets")
        rss.append(_rss_kib(broker.pid))
        if round_ == 1:
            for p in range(4):
                writer.put(p, b"wake")  # answers all of them
            for c in clients:
                for _ in range(1000):
                    assert isinstance(c.next(), Value)
        for c in clients:
            c.close()
        wait_until(lambda: _stat(broker.port, "held_gets") == 0, 30,
                   what="held gets dropped with their connections")
    assert rss[2] - rss[0] < 16 * 1024, f"broker RSS grew {rss} KiB over the rounds"


def _end(client: Client, partition: int) -> int:
    client.send(b"stats offsets 78\r\n")
    r = client.next()
    for line in bytes(r.body).decode().splitlines():
        parts = line.split()
        if parts[1] == TOPIC and parts[3] == str(partition):
            return int(parts[7])
    raise AssertionError(f"no offsets line for {TOPIC}-{partition}")


def test_max_held_gets_answers_the_rest_at_once(tmp_path):
    cfg = BrokerConfig(broker_id=0, data_dir=tmp_path / "d", port=0, topics={TOPIC: 1},
                       max_held_gets=3)
    with Broker(cfg) as b:
        c = Client(b.port)
        c.send(b"".join(encode_get(TOPIC, "g", 0, 0, 1024, i, hold_ms=60_000)
                        for i in range(5)))
        first = [c.next(), c.next()]  # the two over the limit, at once
        assert sorted(r.opaque for r in first) == [3, 4] and {r.code for r in first} == {404}
        stats = c.stats()
        assert stats["held_gets"] == "3" and stats["get_hold_refused"] == "2"
        c.close()
        wait_until(lambda: len(b._server.held) == 0, 10, what="held gets dropped")


# --------------------------------------------------------------------------- the fetcher

def _put(port: int, partition: int, body: bytes) -> None:
    c = Client(port)
    try:
        c.put(partition, body)
    finally:
        c.close()


class Recorder:
    def __init__(self) -> None:
        self.got: dict[str, list[bytes]] = defaultdict(list)
        self.lock = threading.Lock()

    def __call__(self, m) -> None:  # noqa: ANN001
        with self.lock:
            self.got[m.partition].append(m.raw_body)

    def bodies(self, partition: str) -> list[bytes]:
        with self.lock:
            return list(self.got[partition])


def _fetch(port: int, p: int, listener) -> PartitionState:  # noqa: ANN001
    return PartitionState(topic=TOPIC, partition=f"0-{p}", broker_id=0, index=p,
                          broker_address=("127.0.0.1", port), offset=0, msg_id=-1,
                          max_size=1 << 16, listener=listener, batch_listener=None,
                          codec=get_codec("bytes"), verify=True, max_retries=5)


@pytest.fixture
def manager():
    errors: list = []
    made: list[FetchManager] = []

    def make(hold: float = 60.0, max_delay: float = 0.2, runners: int = 2) -> FetchManager:
        m = FetchManager(group="g", runner_count=runners, fetch_timeout=5.0,
                         max_delay=max_delay,
                         max_fetch_size=1 << 20, on_error=lambda e, pf: errors.append(e),
                         hold=hold)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()
    assert not errors, errors


def _parked(port: int, n: int) -> None:
    wait_until(lambda: _stat(port, "held_gets") >= n, 15, what=f"{n} held gets")


def test_parked_partition_gets_the_next_message_from_its_held_get(broker, manager):
    rec = Recorder()
    m = manager()
    pfs = [_fetch(broker.port, p, rec) for p in range(4)]
    for pf in pfs:
        m.add(pf)
    _parked(broker.port, 4)
    gets = _stat(broker.port, "cmd_get")
    for i in range(3):
        _parked(broker.port, 4)  # (its held get is out again: the listener ran before)
        _put(broker.port, 1, b"m%d" % i)
        wait_until(lambda i=i: len(rec.bodies("0-1")) == i + 1, 10, what=f"message {i}")
    assert rec.bodies("0-1") == [b"m0", b"m1", b"m2"]
    assert not rec.bodies("0-0") and not rec.bodies("0-2")
    # each message: its held get's answer, the get sent ahead, a new held get
    assert _stat(broker.port, "cmd_get") - gets <= 3 * 4 + 1
    assert _stat(broker.port, "get_held_woken") >= 3


class Threads(Recorder):
    """Records each message's delivering thread and how many listeners ran at once."""

    def __init__(self, pause: float = 0.0) -> None:
        super().__init__()
        self.pause = pause
        self.names: list[str] = []
        self.running = 0
        self.most = 0

    def __call__(self, m) -> None:  # noqa: ANN001
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
            self.names.append(threading.current_thread().name)
        time.sleep(self.pause)
        with self.lock:
            self.running -= 1
        super().__call__(m)


def test_an_idle_consumer_delivers_a_held_gets_bytes_from_the_long_poll_thread(
        broker, manager):
    """No runner holds a partition: the long-poll thread delivers what its held get
    brought itself (no hand-over to a runner on the way to the listener)."""
    rec = Threads()
    m = manager(runners=1)
    pf = _fetch(broker.port, 1, rec)
    m.add(pf)
    for i in range(3):
        _parked(broker.port, 1)  # (waiting in its held get, the long-poll thread idles)
        _put(broker.port, 1, b"m%d" % i)
        wait_until(lambda i=i: len(rec.bodies("0-1")) == i + 1, 10, what=f"message {i}")
    assert rec.bodies("0-1") == [b"m0", b"m1", b"m2"]
    assert rec.names == [m._poller.thread.name] * 3  # noqa: SLF001


def test_the_long_poll_thread_delivering_counts_as_one_of_the_runners(broker, manager):
    """With one runner, never two listeners at once (the runner waits while the
    long-poll thread delivers), and each partition's messages in order."""
    rec = Threads(pause=0.001)
    m = manager(runners=1)
    for p in range(4):
        m.add(_fetch(broker.port, p, rec))
    _parked(broker.port, 4)

    def produce(p: int) -> None:
        c = Client(broker.port)
        for i in range(50):
            c.put(p, b"%d" % i)
            time.sleep(0.002 * (p % 2))
        c.close()

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wait_until(lambda: all(len(rec.bodies(f"0-{p}")) == 50 for p in range(4)), 30,
               what="every message")
    assert rec.most == 1
    for p in range(4):
        assert rec.bodies(f"0-{p}") == [b"%d" % i for i in range(50)]
    assert m._poller.thread.name in rec.names  # noqa: SLF001


def test_a_runner_waits_while_the_long_poll_thread_delivers(broker, manager):
    """One runner: a partition due while the long-poll thread's delivery is in its
    listener is not taken by the runner until that delivery ends."""
    release = threading.Event()
    rec = Recorder()

    blocker: list[str] = []

    def listener(m) -> None:  # noqa: ANN001
        rec(m)
        if m.raw_body == b"block":
            blocker.append(threading.current_thread().name)
            release.wait(30)

    m = manager(runners=1)
    blocked, other = _fetch(broker.port, 0, listener), _fetch(broker.port, 1, listener)
    m.add(blocked)
    m.add(other)
    _parked(broker.port, 2)
    _put(broker.port, 1, b"x")
    wait_until(lambda: rec.bodies("0-1") == [b"x"], 10, what="the other partition's message")
    _parked(broker.port, 2)
    _put(broker.port, 0, b"block")
    wait_until(lambda: rec.bodies("0-0") == [b"block"], 10, what="the blocking message")
    assert blocker == [m._poller.thread.name]  # noqa: SLF001
    m.seek(other, 0)  # due now, with a message to deliver again
    time.sleep(0.5)  # (a bounded look at something that must not happen)
    assert rec.bodies("0-1") == [b"x"]
    release.set()
    wait_until(lambda: rec.bodies("0-1") == [b"x", b"x"], 10, what="the other partition")


def test_after_a_slow_listener_the_runners_deliver_again(broker, manager, monkeypatch):
    """Deliveries by the long-poll thread that took long, _INLINE_SLOW_RUN in a row (a
    slow listener would keep other partitions' held gets waiting), hand the next
    ones to the runners."""
    from metaq.consumer import _fetcher
    monkeypatch.setattr(_fetcher, "_INLINE_PAUSE", 60.0)
    rec = Threads(pause=0.02)
    m = manager(runners=1)
    m.add(_fetch(broker.port, 2, rec))
    n = _fetcher._INLINE_SLOW_RUN + 1  # noqa: SLF001
    for i in range(n):
        _parked(broker.port, 1)
        _put(broker.port, 2, b"%d" % i)
        wait_until(lambda i=i: len(rec.bodies("0-2")) == i + 1, 10, what=f"message {i}")
    hold = m._poller.thread.name  # noqa: SLF001
    assert rec.names[:-1] == [hold] * (n - 1) and rec.names[-1] != hold


def test_seek_during_a_hold_delivers_from_the_new_position_at_once(broker, manager):
    rec = Recorder()
    m = manager()
    pf = _fetch(broker.port, 0, rec)
    _put(broker.port, 0, b"a")
    _put(broker.port, 0, b"b")
    m.add(pf)
    wait_until(lambda: rec.bodies("0-0") == [b"a", b"b"], 10, what="first delivery")
    _parked(broker.port, 1)
    m.seek(pf, 0)  # no new message: the seek alone must get it going
    wait_until(lambda: rec.bodies("0-0") == [b"a", b"b", b"a", b"b"], 10,
               what="redelivery after the seek")
    _put(broker.port, 0, b"c")
    wait_until(lambda: rec.bodies("0-0")[-1:] == [b"c"], 10, what="the next message")
    assert rec.bodies("0-0") == [b"a", b"b", b"a", b"b", b"c"]


def _answered_not_delivered(port: int, rec: Recorder, index: int, other: int) -> None:
    """Put to partition ``index`` (parked, then paused or removed): its held get is
    answered by the broker; a marker put to ``other`` shows the runners went on."""
    woken = _stat(port, "get_held_woken")
    _put(port, index, b"while away")
    wait_until(lambda: _stat(port, "get_held_woken") > woken, 10,
               what="the held get to be answered")
    _put(port, other, b"marker")
    wait_until(lambda: rec.bodies(f"0-{other}") == [b"marker"], 10, what="the marker")
    assert rec.bodies(f"0-{index}") == []  # answered, never delivered


def _two_parked(port: int, m: FetchManager, rec: Recorder, a: int, b: int):  # noqa: ANN202
    first, second = _fetch(port, a, rec), _fetch(port, b, rec)
    m.add(first)
    m.add(second)
    _parked(port, 2)
    return first, second


def test_pause_during_a_hold_delivers_nothing_until_resumed(broker, manager):
    rec, m = Recorder(), manager()
    paused, _other = _two_parked(broker.port, m, rec, 0, 1)
    m.pause(paused)
    _answered_not_delivered(broker.port, rec, 0, 1)
    m.unpause(paused)
    wait_until(lambda: rec.bodies("0-0") == [b"while away"], 10, what="delivery on resume")


def test_a_partition_removed_during_its_hold_delivers_nothing(broker, manager):
    """Revoke (rebalance) and session loss both end in ``remove``."""
    rec, m = Recorder(), manager()
    gone, _kept = _two_parked(broker.port, m, rec, 2, 3)
    assert m.remove(gone, timeout=1.0)  # parked: not busy, so at once
    _answered_not_delivered(broker.port, rec, 2, 3)
    assert gone.offset == 0 and m.readahead(gone) is None  # its bytes went with it


def test_close_during_holds_is_prompt_and_drops_them(broker, manager):
    m = manager(hold=120.0)
    for p in range(4):
        m.add(_fetch(broker.port, p, Recorder()))
    _parked(broker.port, 4)
    start = time.monotonic()
    m.close(timeout=30)
    assert time.monotonic() - start < 10  # not the 120 s hold
    assert not any(t.is_alive() for t in m.threads)
    wait_until(lambda: _stat(broker.port, "held_gets") == 0, 15,
               what="the broker to drop the closed client's held gets")


def test_fetcher_falls_back_to_backoff_against_a_broker_without_holding(brokers, manager):
    b = brokers(0, {TOPIC: 2}, extra_args=["--max-hold", "0"])
    c = Client(b.port)
    c.send(encode_version(1))
    assert HOLD_CAPABILITY not in bytes(c.next().body).decode().split()
    rec = Recorder()
    m = manager(max_delay=0.1)
    for p in range(2):
        m.add(_fetch(b.port, p, rec))
    wait_until(lambda: _stat(b.port, "cmd_get") >= 6, 10, what="idle fetches backing off")
    _put(b.port, 1, b"found by polling")
    wait_until(lambda: rec.bodies("0-1") == [b"found by polling"], 10, what="delivery")
    stats = c.stats()
    assert stats["get_hold_asked"] == "0"  # never sent hold= to it


# --------------------------------------------------------------------------- the consumer

class _Batch:
    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    def on_messages(self, batch) -> None:  # noqa: ANN001
        for m in batch:
            self.rec(m)


@pytest.mark.parametrize("mode", ["orderly", "batch", "concurrent", "manual", "broadcast"])
def test_every_mode_waits_in_held_gets_and_delivers_each_message_once(zk_connect, brokers,
                                                                      mode):
    b = brokers(0, {TOPIC: 4})
    rec = Recorder()
    options = {"fetch_runner_count": 1, "consume_mode": "concurrent" if mode == "concurrent"
               else "orderly", "broadcast": mode == "broadcast"}
    with Producer(zk_connect) as producer, \
            MessageConsumer(f"lp-{mode}", zk_connect, **options) as consumer:
        listener = rec
        if mode == "batch":
            listener = _Batch(rec)
        elif mode == "manual":
            def listener(m):  # noqa: ANN001, ANN202
                rec(m)
                consumer.ack(m)
        consumer.subscribe(TOPIC, listener, auto_ack=mode != "manual")
        consumer.start()
        assert consumer.wait_settled(30)
        _parked(b.port, 4)
        sent = []
        for i in range(12):
            r = producer.send(TOPIC, b"n%d" % i)
            sent.append((r.partition, b"n%d" % i))
            wait_until(lambda n=i + 1: sum(len(v) for v in rec.got.values()) == n, 10,
                       what=f"message {i}")
        want = defaultdict(list)
        for part, body in sent:
            want[part].append(body)
        assert {k: rec.bodies(k) for k in want} == dict(want)
        assert _stat(b.port, "get_held_woken") >= 12

def test_a_failing_long_poller_is_reported_and_partitions_fall_back(broker, monkeypatch):
    from metaq.consumer import _longpoll

    def broken(self, parked):  # noqa: ANN001, ANN202
        raise RuntimeError("long poller broke")

    monkeypatch.setattr(_longpoll.LongPoller, "_send", broken)
    errors: list = []
    rec = Recorder()
    m = FetchManager(group="g", runner_count=1, fetch_timeout=5.0, max_delay=0.1,
                     max_fetch_size=1 << 20, on_error=lambda e, pf: errors.append(e), hold=60)
    try:
        m.add(_fetch(broker.port, 0, rec))
        wait_until(lambda: errors, 10, what="the poller's failure to be reported")
        assert "long poller broke" in str(errors[0])
        _put(broker.port, 0, b"still delivered")
        wait_until(lambda: rec.bodies("0-0") == [b"still delivered"], 10, what="delivery")
    finally:
        m.close()
    assert not any(t.is_alive() for t in m.threads)
