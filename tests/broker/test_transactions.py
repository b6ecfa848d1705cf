"""Metaq's transactions (issue 17) against real brokers: in-process for the protocol,
subprocesses killed with SIGKILL for crash recovery, the Python API on top."""

from __future__ import annotations

import logging
import socket
import threading

import pytest
from helpers.brokers import BrokerFactory
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metaq import MessageConsumer, Producer, TransactionError, XAError, Xid
from metaq.broker import Broker, BrokerConfig
from metaq.net import BrokerConnection
from metaq.protocol import (
    ReplyParser,
    checksum,
    encode_put,
    iter_messages,
    local_key,
    parse_put_result,
    xa_key,
)
from metaq.testing import free_port, wait_until

pytestmark = pytest.mark.broker

TOPIC = "tx"


class Raw:
    """A raw protocol client (one connection)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.parser = ReplyParser()
        self.pending: list = []
        self.opaque = 100

    def ask(self, line: bytes, n: int = 1) -> list:
        self.sock.sendall(line)
        while len(self.pending) < n:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("closed")
            self.pending += self.parser.feed(data)
        out, self.pending = self.pending[:n], self.pending[n:]
        return out

    def tx(self, key: str, type: str, *extra: str) -> object:
        self.opaque += 1
        line = " ".join(["transaction", key, "s1", type, *extra, str(self.opaque)])
        return self.ask(line.encode() + b"\r\n")[0]

    def put(self, key: str | None, body: bytes, partition: int = 0) -> object:
        self.opaque += 1
        return self.ask(encode_put(TOPIC, partition, body, 0, checksum(body), self.opaque,
                                   tx_key=key))[0]

    def close(self) -> None:
        self.sock.close()


def bodies(port: int, partition: int = 0) -> list[bytes]:
    with BrokerConnection("127.0.0.1", port) as c:
        out, pos = [], 0
        while True:
            try:
                data = bytes(c.get(TOPIC, "g", partition, pos, 1 << 20))
            except Exception:  # noqa: BLE001 - 404: the end
                return out
            msgs = list(iter_messages(data))
            if not msgs:
                return out
            out += [bytes(m.payload) for m in msgs]
            pos += sum(20 + len(m.payload) for m in msgs)


@pytest.fixture
def broker(broker_factory):
    return broker_factory({TOPIC: 2})


def test_commit_makes_the_messages_visible_together_and_in_order(broker):
    c = Raw(broker.port)
    key = local_key("s1", 1)
    assert c.tx(key, "BEGIN").code == 200
    ids = []
    for i in range(5):
        r = c.put(key, b"m%d" % i, partition=i % 2)
        assert r.code == 200
        msg_id, part, offset = parse_put_result(r.body)
        assert (part, offset) == (i % 2, -1)  # Java's answer: placed at the commit
        ids.append(msg_id)
        assert bodies(broker.port, 0) == [] and bodies(broker.port, 1) == []
    assert c.put(None, b"plain").code == 200  # a plain put is visible at once
    assert bodies(broker.port, 0) == [b"plain"]
    assert c.tx(key, "COMMIT_ONE_PHASE").code == 200
    assert bodies(broker.port, 0) == [b"plain", b"m0", b"m2", b"m4"]
    assert bodies(broker.port, 1) == [b"m1", b"m3"]
    assert ids == sorted(ids)
    assert c.tx(key, "COMMIT_ONE_PHASE").code == 500  # finished: gone


def test_rollback_and_timeout_never_appear(broker):
    c = Raw(broker.port)
    a, b = local_key("s1", 1), local_key("s1", 2)
    c.tx(a, "BEGIN")
    c.tx(b, "BEGIN", "1")  # a timeout of 1 s
    c.put(a, b"rolled back")
    c.put(b, b"timed out")
    assert c.tx(a, "ROLLBACK").code == 200
    wait_until(lambda: "STAT tx_timed_out 1" in broker.stats(), 10, what="the timeout")
    r = c.tx(b, "COMMIT_ONE_PHASE")
    assert r.code == 500 and b"has not been started" in r.body
    assert bodies(broker.port, 0) == []


def test_a_local_transaction_belongs_to_its_connection(broker):
    a, b = Raw(broker.port), Raw(broker.port)
    key = local_key("s1", 7)
    a.tx(key, "BEGIN")
    a.put(key, b"x")
    r = b.tx(key, "COMMIT_ONE_PHASE")
    assert r.code == 500 and b"Local transaction" in r.body
    a.close()  # its open transaction is rolled back
    wait_until(lambda: "STAT tx_rolled_back 1" in broker.stats(), 10, what="the rollback")
    assert bodies(broker.port, 0) == []


def test_xa_states_and_answers(broker):
    c = Raw(broker.port)
    x = xa_key(1, b"g1", b"b1", "uq")
    r = c.tx(x, "COMMIT_TWO_PHASE", "uq")
    assert r.code == 500 and r.body.startswith(b"XAException:code=-4,")
    assert c.tx(x, "BEGIN", "uq").code == 200
    assert c.tx(x, "PREPARE", "uq").body == b"3"  # nothing put: read-only, finished
    c.tx(x, "BEGIN", "uq")
    c.put(x, b"xa")
    r = c.tx(x, "COMMIT_TWO_PHASE", "uq")
    assert r.code == 500 and r.body.startswith(b"XAException:code=-6,")  # not prepared
    assert c.tx(x, "PREPARE", "uq").body == b"0"
    assert c.put(x, b"late").code == 500  # prepared: no more puts
    assert c.tx("null", "RECOVER", "uq").body == x.encode()
    assert c.tx("null", "RECOVER", "other").body == b""
    assert bodies(broker.port, 0) == []
    other = Raw(broker.port)  # any connection may finish a branch
    assert other.tx(x, "COMMIT_TWO_PHASE", "uq").code == 200
    assert bodies(broker.port, 0) == [b"xa"]
    assert c.tx("null", "RECOVER", "uq").body == b""
    r = c.tx(local_key("s1", 1), "PREPARE")
    assert r.code == 500
    # END is not answered: the next answer is the version's
    (v,) = c.ask(b"transaction " + x.encode() + b" s1 END uq 999\r\nversion 1000\r\n")
    assert v.opaque == 1000


def test_a_consumer_sees_nothing_of_an_open_transaction(tmp_path, zk_connect):
    cfg = BrokerConfig(broker_id=0, data_dir=tmp_path, port=free_port(), topics={TOPIC: 1},
                       zk_connect=zk_connect)
    got: list[bytes] = []
    lock = threading.Lock()

    def listener(m) -> None:  # noqa: ANN001
        with lock:
            got.append(bytes(m.body))

    with Broker(cfg), Producer(zk_connect) as p:
        c = MessageConsumer("g-tx", zk_connect, commit_period=0.2)
        c.subscribe(TOPIC, listener)
        with c:
            c.start()
            tx = p.transaction()
            for i in range(3):
                tx.send(TOPIC, b"t%d" % i)
            p.send(TOPIC, b"marker")
            wait_until(lambda: b"marker" in got, 30, what="the plain message")
            assert got == [b"marker"]  # nothing of the open transaction
            tx.commit()
            wait_until(lambda: len(got) == 4, 30, what="the committed messages")
            assert got == [b"marker", b"t0", b"t1", b"t2"]


def test_many_concurrent_transactions_on_one_partition(broker):
    n_conn, n_tx, n_msg = 4, 10, 5
    errors: list = []

    def worker(w: int) -> None:
        try:
            c = Raw(broker.port)
            for t in range(n_tx):
                key = local_key(f"w{w}", t)
                c.tx(key, "BEGIN")
                for m in range(n_msg):
                    assert c.put(key, b"%d-%d-%d" % (w, t, m)).code == 200
                assert c.tx(key, "ROLLBACK" if t % 3 == 2 else "COMMIT_ONE_PHASE").code == 200
            c.close()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(n_conn)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    got = bodies(broker.port, 0)
    want_tx = {(w, t) for w in range(n_conn) for t in range(n_tx) if t % 3 != 2}
    seen = [tuple(map(int, b.split(b"-"))) for b in got]
    assert {(w, t) for w, t, _m in seen} == want_tx and len(seen) == len(want_tx) * n_msg
    # each transaction's messages are contiguous and in order
    for i in range(0, len(seen), n_msg):
        run = seen[i:i + n_msg]
        assert [m for _w, _t, m in run] == list(range(n_msg))
        assert len({(w, t) for w, t, _m in run}) == 1


def test_prepared_branch_survives_kill_9_and_commits_after(zk_connect, brokers, tmp_path):
    b = brokers(0, {TOPIC: 1})
    c = Raw(b.port)
    x = xa_key(7, b"global", b"branch", "node1")
    loc = local_key("s1", 1)
    c.tx(x, "BEGIN", "node1")
    c.put(x, b"prepared-1")
    c.put(x, b"prepared-2")
    assert c.tx(x, "PREPARE", "node1").body == b"0"
    c.tx(loc, "BEGIN")
    c.put(loc, b"in-flight local")  # never committed: rolled back by the crash
    y = xa_key(7, b"global", b"other", "node1")
    c.tx(y, "BEGIN", "node1")
    c.put(y, b"in-flight xa")  # not prepared: rolled back too
    b.kill()
    b.restart()
    c = Raw(b.port)
    assert c.tx("null", "RECOVER", "node1").body == x.encode()
    assert bodies(b.port, 0) == []
    assert c.tx(x, "COMMIT_TWO_PHASE", "node1").code == 200
    assert bodies(b.port, 0) == [b"prepared-1", b"prepared-2"]
    b.kill()
    b.restart()  # committed: not listed again, not appended twice
    c = Raw(b.port)
    assert c.tx("null", "RECOVER").body == b""
    assert bodies(b.port, 0) == [b"prepared-1", b"prepared-2"]


def test_a_commit_cut_short_by_a_crash_is_finished_once(tmp_path):
    """The journal's commit record is there but the appends are not (a crash between):
    recovery appends them, once."""
    from metaq.broker._txjournal import TxJournal
    from metaq.protocol import encode_message

    cfg = BrokerConfig(broker_id=0, data_dir=tmp_path, port=free_port(), topics={TOPIC: 1})
    with Broker(cfg) as b:
        Raw(b.port).put(None, b"before")
    j = TxJournal(tmp_path / "transactions")
    msgs = [encode_message(1000 + i, 0, b"c%d" % i) for i in range(3)]
    for m in msgs:
        j.put("TX:s:1", TOPIC, 0, m)
    start = 20 + len(b"before")
    j.commit("TX:s:1", [(TOPIC, 0, start, sum(map(len, msgs)))])
    j.close()
    for _ in range(2):
        with Broker(cfg) as b:
            assert bodies(b.port, 0) == [b"before", b"c0", b"c1", b"c2"]


def test_group_commit_answers_after_the_journal_is_synced(tmp_path):
    cfg = BrokerConfig(broker_id=0, data_dir=tmp_path, port=free_port(), topics={TOPIC: 1},
                       unflush_threshold=0)
    with Broker(cfg) as b:
        c = Raw(b.port)
        key = local_key("s1", 1)
        c.tx(key, "BEGIN")
        assert c.put(key, b"durable").code == 200
        assert c.tx(key, "COMMIT_ONE_PHASE").code == 200
        assert bodies(b.port, 0) == [b"durable"]
    journal = tmp_path / "transactions" / "journal"
    assert journal.exists()


tx_lines = st.one_of(
    st.builds(lambda k, s, t, x, o: b" ".join([b"transaction", k, s, t, *x, o]) + b"\r\n",
              st.sampled_from([b"TX:a:1", b"XID:1:ab:cd:q", b"null", b"TX:", b"XID:1:z:1:q",
                               b"TX:a:99999999999999999999", b"\xff", b""]),
              st.sampled_from([b"s", b"", b"a b"]),
              st.sampled_from([b"BEGIN", b"PREPARE", b"COMMIT_ONE_PHASE", b"COMMIT_TWO_PHASE",
                               b"ROLLBACK", b"RECOVER", b"FORGET", b"END", b"NOPE", b"begin"]),
              st.lists(st.sampled_from([b"5", b"q", b"-1", b"", b"99999999999"]), max_size=3),
              st.sampled_from([b"1", b"x", b"-5", b""])),
    st.builds(lambda k, body, n: b"put tx 0 %d 0 %d %b 9\r\n" % (n, checksum(body), k) + body,
              st.sampled_from([b"TX:a:1", b"XID:1:ab:cd:q", b"TX:zz:2", b"bogus", b"null"]),
              st.binary(max_size=30), st.integers(0, 40)),
    st.binary(max_size=60),
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(tx_lines, max_size=12))
def test_fuzzed_transaction_and_put_lines_never_crash_the_broker(fuzz_broker, lines):
    s = socket.create_connection(("127.0.0.1", fuzz_broker.port), timeout=10)
    try:
        s.sendall(b"".join(lines))
    except OSError:
        pass
    s.close()
    with BrokerConnection("127.0.0.1", fuzz_broker.port) as c:  # still serving
        assert c.version().startswith("1.4.6")
    assert not fuzz_broker.internal_errors, fuzz_broker.internal_errors


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


@pytest.fixture(scope="module")
def fuzz_broker(tmp_path_factory):
    handler = _Errors()
    logger = logging.getLogger("metaq.broker")
    logger.addHandler(handler)
    try:  # module scope: the factory itself, not the (per-test) broker_factory fixture
        with BrokerFactory(tmp_path_factory.mktemp("fuzz")) as make:
            b = make({TOPIC: 1})
            b.internal_errors = handler.records  # an internal error closes a connection
            yield b
    finally:
        logger.removeHandler(handler)


# -- the Python API --------------------------------------------------------------------------

def test_producer_local_transaction(zk_connect, tmp_path):
    cfg = BrokerConfig(broker_id=0, data_dir=tmp_path, port=free_port(), topics={TOPIC: 2},
                       zk_connect=zk_connect)
    with Broker(cfg) as b, Producer(zk_connect) as p:
        with p.transaction() as tx:
            for i in range(6):
                tx.send(TOPIC, b"ok-%d" % i)
        assert sorted(bodies(b.port, 0) + bodies(b.port, 1)) == [b"ok-%d" % i for i in range(6)]
        with pytest.raises(RuntimeError), p.transaction() as tx:
            tx.send(TOPIC, b"never")
            raise RuntimeError("the block failed")
        tx2 = p.transaction()
        tx2.send(TOPIC, b"dropped")
        tx2.rollback()
        assert b"never" not in bodies(b.port, 0) + bodies(b.port, 1)
        assert b"dropped" not in bodies(b.port, 0) + bodies(b.port, 1)
        with pytest.raises(TransactionError, match="is rolled back"):
            tx2.send(TOPIC, b"after")
        tx3 = p.transaction()
        tx3.send(TOPIC, b"x" * 10, partition="0-1")
        results = tx3.commit()
        assert [(r.partition, r.offset) for r in results] == [("0-1", -1)]


def test_producer_xa_resource(zk_connect, tmp_path):
    cfg = BrokerConfig(broker_id=0, data_dir=tmp_path, port=free_port(), topics={TOPIC: 1},
                       zk_connect=zk_connect)
    xid = Xid(1, b"gtrid-1", b"bq-1")
    with Broker(cfg) as b, Producer(zk_connect) as p:
        with p.xa_resource("app1", topic=TOPIC) as xa:
            xa.start(xid)
            xa.send(TOPIC, b"two-phase")
            xa.end(xid)
            assert xa.prepare(xid) == 0
            assert xa.recover() == [xid]
            assert bodies(b.port, 0) == []
            xa.commit(xid)
            assert bodies(b.port, 0) == [b"two-phase"]
            with pytest.raises(XAError) as e:
                xa.commit(xid)
            assert e.value.code == -4
            xa.start(xid)
            xa.send(TOPIC, b"rolled")
            xa.end(xid)
            xa.prepare(xid)
            xa.rollback(xid)
            assert xa.recover() == []
        assert bodies(b.port, 0) == [b"two-phase"]


def test_a_producer_transaction_stays_on_its_first_broker(zk_connect, tmp_path):
    """Puts the partitioner sends to another broker go to this transaction's broker's
    partitions (round-robin); a named partition elsewhere, or a topic with none here, is
    refused with what is wrong."""
    def config(i: int) -> BrokerConfig:
        return BrokerConfig(broker_id=i, data_dir=tmp_path / str(i), port=free_port(),
                            topics={TOPIC: 2, f"only{i}": 1}, zk_connect=zk_connect)

    with Broker(config(0)) as b0, Broker(config(1)) as b1, Producer(zk_connect) as p:
        tx = p.transaction()
        for i in range(12):
            tx.send(TOPIC, b"m-%d" % i)
        results = tx.commit()
        brokers = {r.broker_id for r in results}
        assert len(results) == 12 and len(brokers) == 1, results
        mine = brokers.pop()
        assert {r.partition for r in results} == {f"{mine}-0", f"{mine}-1"}
        port = (b0, b1)[mine].port
        assert sorted(bodies(port, 0) + bodies(port, 1)) == sorted(b"m-%d" % i
                                                                  for i in range(12))
        tx2 = p.transaction()
        tx2.send(TOPIC, b"first", partition=f"{mine}-0")
        with pytest.raises(TransactionError, match=f"is on broker {1 - mine}"):
            tx2.send(TOPIC, b"elsewhere", partition=f"{1 - mine}-0")
        with pytest.raises(TransactionError, match=f"has no partition on broker {mine}"):
            tx2.send(f"only{1 - mine}", b"nowhere")
        tx2.rollback()
