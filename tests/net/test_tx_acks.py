"""BrokerConnection.read_tx_acks (a transaction's put answers to one partition read in
bulk) against read_results (one by one): the same answers, or None with nothing read;
the replies arrive cut anywhere, over several reads."""

from __future__ import annotations

import socket
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metaq.net import BrokerConnection


@pytest.fixture(scope="module")
def listener():
    s = socket.create_server(("127.0.0.1", 0))
    yield s
    s.close()


def _conn_fed(listener: socket.socket, chunks: list[bytes]) -> tuple[BrokerConnection,
                                                                      threading.Thread]:
    """A connection whose peer writes ``chunks`` (from a thread: one at a time, so that
    the reader may see a reply cut anywhere) and then keeps the socket open."""
    conn = BrokerConnection(*listener.getsockname(), timeout=10)
    peer, _ = listener.accept()

    def feed() -> None:
        for c in chunks:
            peer.sendall(c)
        done.wait(10)
        peer.close()

    done = threading.Event()
    t = threading.Thread(target=feed, name="test-feed", daemon=True)
    t.done = done  # type: ignore[attr-defined]
    t.start()
    return conn, t


def _finish(conn: BrokerConnection, t: threading.Thread) -> None:
    t.done.set()  # type: ignore[attr-defined]
    conn.close()
    t.join(10)


_field = st.one_of(st.integers(0, 10**18).map(b"%d".__mod__),
                   st.sampled_from([b"-1", b"01", b"-7", b"0", b"007", b"-", b""]))
_ack = st.tuples(st.just("ack"), _field, st.sampled_from([b"3", b"3", b"3", b"03", b"4"]),
                 st.sampled_from([b"-1"] * 6 + [b"01", b"0", b"5", b"-2", b"1-"]))
_err = st.tuples(st.just("err"), st.sampled_from([400, 500]),
                 st.sampled_from([b"checksum mismatch", b"result 200 1 2\r\n", b"x -1"]))


def _replies(items: list, first: int) -> bytes:
    out = []
    for i, it in enumerate(items):
        if it[0] == "ack":
            body = b"%b %b %b" % it[1:]
            out.append(b"result 200 %d %d\r\n%b" % (len(body), first + i, body))
        else:
            out.append(b"result %d %d %d\r\n%b" % (it[1], len(it[2]), first + i, it[2]))
    return b"".join(out)


def _decimal(b: bytes) -> bool:
    return b.isdigit() and b"%d" % int(b) == b


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(items=st.lists(st.one_of(_ack, _ack, _ack, _err), min_size=1, max_size=30),
       first=st.integers(1, 10**6), cuts=st.lists(st.integers(0, 2000), max_size=4))
def test_read_tx_acks_reads_what_read_results_reads(listener, items, first, cuts):
    opaques = list(range(first, first + len(items)))
    data = _replies(items, first) + b"result 200 0 %d\r\n" % (first + len(items))  # COMMIT's
    points = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    chunks = [data[a:b] for a, b in zip(points, points[1:], strict=False) if b > a]
    conn, t = _conn_fed(listener, chunks)
    ref, rt = _conn_fed(listener, [data])
    try:
        want = [r if type(r) is bytes else str(r) for r in ref.read_results(opaques)]
        got = conn.read_tx_acks(opaques, tuple, 0, 3, "0-3")
        if got is None:  # nothing read: one by one gives the same answers
            conn_results = [r if type(r) is bytes else str(r)
                            for r in conn.read_results(opaques)]
            assert conn_results == want
            # never for the usual answers: every put accepted, decimal msgIds, partition 3
            assert not all(it[0] == "ack" and it[3] == b"-1" and _decimal(it[1])
                           and len(it[1]) <= 18 and it[2] == b"3" for it in items)
        else:
            assert got == [(int(r.split()[0]), "0-3", -1, 0, 3) for r in want]
            assert all(r.endswith(b" 3 -1") for r in want)
        # the connection is in step: the next answer is the COMMIT's on both
        assert conn.read_result(first + len(items)) == ref.read_result(first + len(items)) \
            == b""
    finally:
        _finish(conn, t)
        _finish(ref, rt)
