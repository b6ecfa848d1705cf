"""Pipelined local transactions (``+txpipe``, issue 29): BEGIN, the puts and COMMIT
written together, the COMMIT carrying how many puts were sent; the broker commits
only a transaction that holds every one of them.  Against real brokers: in-process
for the protocol and the producer, a subprocess killed with SIGKILL mid-pipeline."""

from __future__ import annotations

import socket
import time

import pytest

from metaq import Producer, TransactionError
from metaq._errors import ProtocolError
from metaq.net import BrokerConnection
from metaq.protocol import (
    TXPIPE_CAPABILITY,
    ReplyParser,
    checksum,
    encode_put,
    encode_transaction,
    iter_messages,
    local_key,
    xa_key,
)
from metaq.protocol._transaction import transaction_request
from metaq.testing import wait_until

pytestmark = pytest.mark.broker

TOPIC = "txp"


class Raw:
    """One connection writing many requests at once and reading their answers."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=20)
        self.parser = ReplyParser()
        self.opaque = 100

    def next(self) -> int:
        self.opaque += 1
        return self.opaque

    def tx(self, key: str, type: str, **kw: object) -> bytes:
        return encode_transaction(key, "s1", type, self.next(), **kw)

    def put(self, key: str | None, body: bytes, partition: int = 0, check: int | None = None
            ) -> bytes:
        return encode_put(TOPIC, partition, body, 0,
                          checksum(body) if check is None else check, self.next(), tx_key=key)

    def ask(self, requests: list[bytes]) -> list:
        self.sock.sendall(b"".join(requests))
        out: list = []
        while len(out) < len(requests):
            data = self.sock.recv(1 << 20)
            if not data:
                raise ConnectionError("closed")
            out += self.parser.feed(data)
        return out


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


def test_the_commit_count_on_the_wire():
    key = local_key("s1", 1)
    line = encode_transaction(key, "s1", "COMMIT_ONE_PHASE", 9, puts=100)
    assert line == f"transaction {key} s1 COMMIT_ONE_PHASE puts=100 9\r\n".encode()
    r = transaction_request(line.rstrip(b"\r\n").split(b" "))
    assert (r.puts, r.unique_qualifier, r.timeout, r.opaque) == (100, None, 0, 9)
    plain = transaction_request(encode_transaction(key, "s1", "COMMIT_ONE_PHASE", 9)
                                .rstrip(b"\r\n").split(b" "))
    assert plain.puts is None  # Java's commit
    # an XA branch's unique qualifier is never read as a count
    x = xa_key(1, b"g", b"b", "puts=3")
    r = transaction_request(encode_transaction(x, "s1", "COMMIT_ONE_PHASE", 9,
                                               unique_qualifier="puts=3")
                            .rstrip(b"\r\n").split(b" "))
    assert (r.puts, r.unique_qualifier) == (None, "puts=3")
    for kw in ({"type": "BEGIN"}, {"key": x}):
        args = {"key": key, "type": "COMMIT_ONE_PHASE", **kw}
        with pytest.raises(ProtocolError, match="puts="):
            encode_transaction(args["key"], "s1", args["type"], 9, puts=1)
    with pytest.raises(ProtocolError, match="puts="):
        encode_transaction(key, "s1", "COMMIT_ONE_PHASE", 9, puts=-1)


@pytest.mark.parametrize("flush", ["default", "group commit"])
def test_a_pipelined_transaction_is_one_write(broker_factory, flush):
    """Answered in order (with group commit the puts' and the commit's answers wait for
    fsyncs, BEGIN's does not; the broker writes a read's answers together)."""
    b = broker_factory({TOPIC: 2}, **({"unflush_threshold": 0} if flush != "default" else {}))
    with BrokerConnection("127.0.0.1", b.port) as c:
        assert TXPIPE_CAPABILITY in c.version().split()
    c = Raw(b.port)
    key = local_key("s1", 1)
    first = c.opaque + 1
    reqs = [c.tx(key, "BEGIN")] + [c.put(key, b"m%d" % i, i % 2) for i in range(5)]
    answers = c.ask(reqs + [c.tx(key, "COMMIT_ONE_PHASE", puts=5)])
    assert [a.code for a in answers] == [200] * 7
    assert [a.opaque for a in answers] == list(range(first, first + 7))
    assert bodies(b.port, 0) == [b"m0", b"m2", b"m4"]
    assert bodies(b.port, 1) == [b"m1", b"m3"]


@pytest.mark.parametrize("bad", ["unknown partition", "oversized", "checksum", "no begin"])
def test_a_refused_put_fails_the_pipelined_commit(broker_factory, bad):
    b = broker_factory({TOPIC: 1}, max_message_size=64)
    c = Raw(b.port)
    key = local_key("s1", 1)
    refused = {"unknown partition": c.put(key, b"to nowhere", partition=7),
               "oversized": c.put(key, b"x" * 100),
               "checksum": c.put(key, b"bad sum", check=12345),
               "no begin": c.put(local_key("s1", 2), b"other key")}[bad]
    answers = c.ask([c.tx(key, "BEGIN"), c.put(key, b"a"), refused, c.put(key, b"c"),
                     c.tx(key, "COMMIT_ONE_PHASE", puts=3)])
    codes = [a.code for a in answers]
    assert codes[:2] == [200, 200] and codes[2] != 200 and codes[3] == 200
    assert codes[4] == 500 and b"COMMIT FAILED" in answers[4].body
    assert b"rolled back" in answers[4].body
    assert bodies(b.port, 0) == []
    assert "STAT tx_rolled_back 1" in b.stats()
    # finished: the key can begin again, and Java's commit (no count) keeps Java's rule
    answers = c.ask([c.tx(key, "BEGIN"), c.put(key, b"a"), refused, c.put(key, b"c"),
                     c.tx(key, "COMMIT_ONE_PHASE")])
    assert [a.code for a in answers][4] == 200
    assert bodies(b.port, 0) == [b"a", b"c"]


def test_a_commit_counting_more_puts_than_arrived_is_refused(broker_factory):
    b = broker_factory({TOPIC: 1})
    c = Raw(b.port)
    key = local_key("s1", 1)
    answers = c.ask([c.tx(key, "BEGIN"), c.put(key, b"a"), c.put(key, b"b"),
                     c.tx(key, "COMMIT_ONE_PHASE", puts=3)])
    assert [a.code for a in answers] == [200, 200, 200, 500]
    assert b"holds 2 of the 3 messages" in answers[3].body
    assert bodies(b.port, 0) == []
    answers = c.ask([c.tx(key, "BEGIN"), c.tx(key, "COMMIT_ONE_PHASE", puts=0)])
    assert [a.code for a in answers] == [200, 200]  # an empty one commits


def _blocking_transaction_calls(monkeypatch) -> list[str]:
    """The types of the transaction requests the producer waited for one by one."""
    calls: list[str] = []
    real = BrokerConnection.transaction

    def spy(self, key, session_id, type, **kw):  # noqa: ANN001, ANN202
        calls.append(type)
        return real(self, key, session_id, type, **kw)

    monkeypatch.setattr(BrokerConnection, "transaction", spy)
    return calls


@pytest.mark.parametrize("pipelined", [True, False])
def test_the_producer_pipelined_and_step_by_step_give_the_same_results(
        zk_connect, broker_factory, monkeypatch, pipelined):
    b = broker_factory({TOPIC: 2}, zk_connect=zk_connect, max_message_size=256)
    if not pipelined:
        from metaq.producer._transaction import TxSender

        monkeypatch.setattr(TxSender, "pipelined", lambda self, conn: False)
    calls = _blocking_transaction_calls(monkeypatch)
    with Producer(zk_connect) as p:
        tx = p.transaction()
        for i in range(20):
            tx.send(TOPIC, b"ok-%d" % i, partition=f"0-{i % 2}")
        results = tx.commit()
        assert [(r.partition, r.offset) for r in results] == \
            [(f"0-{i % 2}", -1) for i in range(20)]
        assert len({r.msg_id for r in results}) == 20
        assert bodies(b.port, 0) == [b"ok-%d" % i for i in range(0, 20, 2)]
        assert bodies(b.port, 1) == [b"ok-%d" % i for i in range(1, 20, 2)]
        # a put the broker refuses mid-transaction (over its max_message_size, not the
        # producer's): nothing of the transaction is visible, and the commit raises
        tx = p.transaction()
        tx.send(TOPIC, b"first", partition="0-0")
        tx.send(TOPIC, b"x" * 1000, partition="0-0")
        tx.send(TOPIC, b"last", partition="0-1")
        with pytest.raises(TransactionError, match="rolled back"):
            tx.commit()
        with pytest.raises(TransactionError):
            tx.commit()
        assert b"first" not in bodies(b.port, 0) and b"last" not in bodies(b.port, 1)
        # the producer goes on: the next transaction commits
        with p.transaction() as tx:
            tx.send(TOPIC, b"after", partition="0-1")
        assert bodies(b.port, 1)[-1] == b"after"
    if pipelined:
        assert calls == []  # nothing waited for alone: BEGIN and COMMIT went with the puts
    else:
        assert calls == ["BEGIN", "COMMIT_ONE_PHASE", "BEGIN", "ROLLBACK", "BEGIN",
                         "COMMIT_ONE_PHASE"]


def test_sigkill_mid_pipeline_leaves_all_or_nothing(zk_connect, brokers):
    """The broker killed at different moments while a pipelined transaction of 3,000
    messages arrives: after recovery the partition holds all of it or none, never a
    part."""
    b = brokers(0, {TOPIC: 1}, zk_session_timeout=2.0)  # (each restart waits for it)
    n = 3000
    seen = []
    for round_, delay in enumerate([0.0, 0.003, 0.01, 0.03, 0.1]):
        c = Raw(b.port)
        key = local_key("s1", round_ + 1)
        tag = b"r%d-" % round_
        reqs = [c.tx(key, "BEGIN")] + [c.put(key, tag + b"%05d" % i + b"." * 90)
                                       for i in range(n)]
        reqs.append(c.tx(key, "COMMIT_ONE_PHASE", puts=n))
        try:
            c.sock.sendall(b"".join(reqs))
        except OSError:
            pass
        time.sleep(delay)
        b.kill()
        c.sock.close()
        b.restart()
        mine = [m for m in bodies(b.port) if m.startswith(tag)]
        assert len(mine) in (0, n), f"round {round_}: {len(mine)} of {n} messages visible"
        if mine:
            assert mine == [tag + b"%05d" % i + b"." * 90 for i in range(n)]
        seen.append(len(mine))
    print("messages visible per round:", seen)


def test_a_local_commit_journals_runs_of_messages_that_recovery_redoes_once(
        tmp_path, monkeypatch):
    """A local transaction's messages reach the journal only at its commit, as ``P``
    records of runs of whole messages (here at most 300 bytes of them): replayed, they
    join to exactly what the commit appended; and a ``C`` whose appends a crash cut
    off is finished from such runs, once."""
    from metaq.broker import Broker, BrokerConfig, _transactions
    from metaq.broker._txjournal import TxJournal
    from metaq.protocol import encode_message
    from metaq.testing import free_port

    monkeypatch.setattr(_transactions, "_P_RUN", 300)
    cfg = BrokerConfig(broker_id=0, data_dir=tmp_path, port=free_port(), topics={TOPIC: 2})
    key = local_key("s1", 1)
    with Broker(cfg) as b:
        c = Raw(b.port)
        rolled = local_key("s1", 2)
        answers = c.ask([c.tx(rolled, "BEGIN"), c.put(rolled, b"never"),
                         c.tx(rolled, "ROLLBACK")])
        assert [a.code for a in answers] == [200] * 3
        reqs = [c.tx(key, "BEGIN")] + [c.put(key, b"m%02d" % i + b"." * 60, i % 2)
                                       for i in range(20)]
        answers = c.ask(reqs + [c.tx(key, "COMMIT_ONE_PHASE", puts=20)])
        assert [a.code for a in answers] == [200] * 22
        logs = {p: bodies(b.port, p) for p in (0, 1)}
    assert logs[0] == [b"m%02d" % i + b"." * 60 for i in range(0, 20, 2)]
    replayed = TxJournal(tmp_path / "transactions").replay()
    assert not [t for t in replayed if t.key == rolled and t.puts]  # never journaled
    (tx,) = [t for t in replayed if t.key == key]
    runs = {p: [m for t, q, m in tx.puts if q == p] for p in (0, 1)}
    assert all(len(runs[p]) > 1 for p in (0, 1))  # several runs, none over 300 bytes
    assert all(len(r) <= 300 for p in (0, 1) for r in runs[p])
    assert max(len(list(iter_messages(r))) for p in (0, 1) for r in runs[p]) == 3
    for p in (0, 1):
        joined = b"".join(runs[p])
        assert [bytes(m.payload) for m in iter_messages(joined)] == logs[p]
    # a commit cut short: its runs and C in the journal, nothing appended
    tmp2 = tmp_path / "cut"
    cfg2 = BrokerConfig(broker_id=0, data_dir=tmp2, port=free_port(), topics={TOPIC: 1})
    with Broker(cfg2):
        pass
    j = TxJournal(tmp2 / "transactions")
    msgs = [encode_message(5000 + i, 0, b"r%d" % i) for i in range(5)]
    j.put(key, TOPIC, 0, b"".join(msgs[:3]))
    j.put(key, TOPIC, 0, b"".join(msgs[3:]))
    j.commit(key, [(TOPIC, 0, 0, sum(map(len, msgs)))])
    j.close()
    for _ in range(2):
        with Broker(cfg2) as b:
            assert bodies(b.port, 0) == [b"r%d" % i for i in range(5)]


def test_group_commit_syncs_the_journal_for_xa_puts_not_for_local_ones(
        tmp_path, monkeypatch):
    """With group commit, an answer waits for the journal's fsync when there is
    something of it in the journal: an XA branch's puts are; a local transaction's are
    not (they reach it with its commit, whose answer waits for the fsync)."""
    from metaq.broker import Broker, BrokerConfig
    from metaq.broker._txjournal import TxJournal
    from metaq.testing import free_port

    syncs: list[int] = []
    real = TxJournal.sync
    monkeypatch.setattr(TxJournal, "sync", lambda self: (syncs.append(1), real(self))[1])
    cfg = BrokerConfig(broker_id=0, data_dir=tmp_path, port=free_port(), topics={TOPIC: 1},
                       unflush_threshold=0)
    with Broker(cfg) as b:
        c = Raw(b.port)
        key = local_key("s1", 1)
        answers = c.ask([c.tx(key, "BEGIN")] + [c.put(key, b"l%d" % i) for i in range(10)])
        assert [a.code for a in answers] == [200] * 11 and syncs == []
        assert c.ask([c.tx(key, "COMMIT_ONE_PHASE", puts=10)])[0].code == 200
        assert len(syncs) >= 1
        before = len(syncs)
        x = xa_key(1, b"g", b"b", "q")
        answers = c.ask([encode_transaction(x, "s1", "BEGIN", c.next(), unique_qualifier="q")]
                        + [c.put(x, b"x%d" % i) for i in range(10)])
        assert [a.code for a in answers] == [200] * 11 and len(syncs) > before
        assert bodies(b.port, 0) == [b"l%d" % i for i in range(10)]


def test_the_producer_s_transaction_with_its_broker_killed_before_the_commit(
        zk_connect, brokers):
    """The broker killed (SIGKILL) while a producer's pipelined transaction is being
    made: its commit raises TransactionError, and after the restart nothing of it is
    visible; the producer's next transaction commits."""
    b = brokers(0, {TOPIC: 1})
    with Producer(zk_connect, send_timeout=10.0) as p:
        with p.transaction() as tx:
            tx.send(TOPIC, b"before", partition="0-0")
        tx = p.transaction()
        for i in range(50):
            tx.send(TOPIC, b"lost-%d" % i, partition="0-0")
        b.kill()
        with pytest.raises(TransactionError):
            tx.commit()
        b.restart()
        assert bodies(b.port, 0) == [b"before"]

        def after() -> bool:  # once the producer sees the broker registered again
            try:
                with p.transaction() as tx:
                    tx.send(TOPIC, b"after", partition="0-0")
            except TransactionError as e:
                if "no writable partition" in str(e):
                    return False
                raise
            return True

        wait_until(after, 30, what="a transaction committed after the restart")
        assert bodies(b.port, 0) == [b"before", b"after"]
