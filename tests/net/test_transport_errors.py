"""metaq.net is the transport error boundary: every way a broker connection can fail
reaches callers as BrokerUnavailableError (with the address and the OSError as cause),
and MultiplexedConnection matches out-of-order replies to the requests that asked."""

from __future__ import annotations

import selectors
import time

import pytest
from helpers.fake_broker import CLOSE, FakeBroker, fake_brokers
from helpers.inproc import inproc_broker
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metaq import (
    BrokerUnavailableError,
    ConnectionClosedError,
    MalformedReplyError,
    ProtocolError,
)
from metaq._types import BrokerAddress
from metaq.net import BrokerConnection, MultiplexedConnection
from metaq.protocol import Result, Value
from metaq.testing import free_port, wait_until

TOPIC = "transport"


@pytest.fixture
def scripted():
    """A fake broker answering every request with ``reply(requests)`` (None: silent;
    CLOSE: close at once)."""
    with fake_brokers() as make:
        yield make


def _refused_address() -> BrokerAddress:
    return BrokerAddress("127.0.0.1", free_port())


# --------------------------------------------------------------------------- blocking


def test_a_refused_connection_is_broker_unavailable_with_its_address_and_cause():
    address = _refused_address()
    with pytest.raises(BrokerUnavailableError) as info:
        BrokerConnection(*address, timeout=2)
    assert info.value.address == address and isinstance(info.value.__cause__, OSError)
    assert str(address.port) in str(info.value)


def test_a_peer_that_closes_is_connection_closed_a_kind_of_unavailable(scripted):
    server = scripted(lambda reqs: CLOSE)
    conn = BrokerConnection(*server.address, timeout=5)
    with pytest.raises(ConnectionClosedError) as info:
        conn.version()
    assert isinstance(info.value, BrokerUnavailableError)
    assert info.value.address == server.address
    with pytest.raises(ConnectionClosedError):  # closed: no silent reuse
        conn.version()


def test_a_broker_that_never_answers_times_out_as_unavailable(scripted):
    server = scripted(lambda reqs: None)
    conn = BrokerConnection(*server.address, timeout=0.3)
    with pytest.raises(BrokerUnavailableError, match="timed out") as info:
        conn.offset(TOPIC, "g", 0, 0)
    assert isinstance(info.value.__cause__, TimeoutError)
    assert not isinstance(info.value, ProtocolError)


@pytest.mark.parametrize("garbage", [
    b"hello there\r\n",                      # not a reply line
    b"result 200 abc 1\r\n",                 # a length that is no number
    b"value 3 999\r\nabc",                   # an opaque nobody asked for
    b"x" * 2000,                             # a line that never ends
])
def test_a_malformed_reply_is_both_a_protocol_error_and_unavailable(scripted, garbage):
    server = scripted(lambda reqs: garbage)
    conn = BrokerConnection(*server.address, timeout=5)
    with pytest.raises(MalformedReplyError) as info:
        conn.version()
    assert isinstance(info.value, ProtocolError)
    assert isinstance(info.value, BrokerUnavailableError)
    assert info.value.address == server.address
    with pytest.raises(ConnectionClosedError):  # the stream is not trusted again
        conn.version()


def test_an_offset_reply_that_is_no_number_is_malformed(scripted):
    server = scripted(lambda reqs: b"result 200 5 1\r\nnope!")
    conn = BrokerConnection(*server.address, timeout=5)
    with pytest.raises(MalformedReplyError, match="not a number"):
        conn.offset(TOPIC, "g", 0, 0)


# --------------------------------------------------------------------------- multiplexed


def _held(broker) -> int:  # noqa: ANN001
    for line in broker.stats().splitlines():
        parts = line.split()
        if parts[:2] == ["STAT", "held_gets"]:
            return int(parts[2])
    return 0


def _put(port: int, partition: int, body: bytes) -> None:
    import zlib

    with BrokerConnection("127.0.0.1", port, timeout=5) as conn:
        conn.read_result(conn.send_put(TOPIC, partition, body, 0,
                                       zlib.crc32(body) & 0x7FFFFFFF))


def _drive(conn: MultiplexedConnection, want: int, timeout: float = 10.0) -> list:
    """Run a selector loop over ``conn`` until ``want`` replies came back."""
    got: list = []
    with selectors.DefaultSelector() as sel:
        sel.register(conn, selectors.EVENT_READ | selectors.EVENT_WRITE)
        deadline = time.monotonic() + timeout
        while len(got) < want:
            assert time.monotonic() < deadline, f"only {len(got)} of {want} replies"
            for _key, events in sel.select(0.2):
                if events & selectors.EVENT_WRITE:
                    conn.flush()
                if events & selectors.EVENT_READ:
                    got.extend(conn.read())
            sel.modify(conn, selectors.EVENT_READ |
                       (selectors.EVENT_WRITE if conn.wants_write else 0))
    return got


@pytest.fixture
def broker(zk_connect, tmp_path):
    with inproc_broker(zk_connect, tmp_path / "b0", {TOPIC: 3}) as b:
        yield b


@pytest.mark.zk
def test_held_gets_answered_out_of_order_reach_their_own_tokens(broker, zk_connect):
    conn = MultiplexedConnection(BrokerAddress("127.0.0.1", broker.port), timeout=5)
    try:
        for p in range(3):  # all three partitions are empty: each get is held
            conn.send_get(f"held-{p}", TOPIC, "g", p, 0, 4096, hold_ms=30_000)
        conn.flush()
        wait_until(lambda: _held(broker) == 3, 10, what="three gets held by the broker")
        # messages to partition 2, then 0: their held gets are answered in that order
        _put(broker.port, 2, b"to-2")
        first = _drive(conn, 1)
        _put(broker.port, 0, b"to-0")
        second = _drive(conn, 1)
        (t1, r1), (t2, r2) = first[0], second[0]
        assert (t1, t2) == ("held-2", "held-0")
        assert isinstance(r1, Value) and b"to-2" in bytes(r1.body)
        assert isinstance(r2, Value) and b"to-0" in bytes(r2.body)
        assert conn.pending == ["held-1"]
    finally:
        conn.close()


@pytest.mark.zk
def test_a_get_for_a_missing_topic_comes_back_as_a_result_with_its_token(broker, zk_connect):
    _put(broker.port, 0, b"x")
    conn = MultiplexedConnection(BrokerAddress("127.0.0.1", broker.port), timeout=5)
    try:
        conn.send_get("missing", "no-such-topic", "g", 0, 0, 1024)
        conn.send_get("there", TOPIC, "g", 0, 0, 1024)
        got = dict(_drive(conn, 2))
        assert isinstance(got["missing"], Result) and got["missing"].code != 200
        assert isinstance(got["there"], Value)
    finally:
        conn.close()


def test_multiplexed_failures_are_converted_and_pending_tokens_handed_back(scripted):
    with pytest.raises(BrokerUnavailableError) as info:
        MultiplexedConnection(_refused_address(), timeout=2)
    assert isinstance(info.value.__cause__, OSError)

    server = scripted(lambda reqs: CLOSE)  # reads the request, then closes
    conn = MultiplexedConnection(server.address, timeout=5)
    conn.send_get("a", TOPIC, "g", 0, 0, 1024, hold_ms=1000)
    with pytest.raises(ConnectionClosedError):
        _drive(conn, 1)
    assert conn.closed and conn.take_pending() == ["a"] and conn.pending == []


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(min_size=1, max_size=300))
def test_multiplexed_read_of_any_bytes_is_replies_or_malformed_never_a_crash(data):
    server = FakeBroker(lambda reqs: data, close_after=True)
    try:
        conn = MultiplexedConnection(server.address, timeout=5)
        conn.send_get(1, TOPIC, "g", 0, 0, 1024)
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(conn, selectors.EVENT_READ)
                conn.flush()
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    if sel.select(0.2):
                        for token, reply in conn.read():
                            assert token == 1 and reply.opaque == 1
                        if not conn.pending:
                            break
        except (MalformedReplyError, ConnectionClosedError):
            assert conn.closed
        conn.close()
    finally:
        server.close()


def test_an_idle_connection_knows_when_its_broker_closed_it(brokers):
    """What a pool asks before reusing a connection (transactions, the dashboard, the
    Spark driver): open and quiet while the broker runs; not once the broker's process
    died (a restart), and then closed, never used again."""
    b = brokers(0, {TOPIC: 1})
    conn = BrokerConnection("127.0.0.1", b.port, timeout=5)
    conn.version()
    assert conn.idle_and_open() and conn.idle_and_open()  # (it reads nothing)
    conn.version()  # still usable after the look
    b.kill()  # SIGKILL: the kernel closes the broker's end
    wait_until(lambda: not conn.idle_and_open(), 10, what="the dead broker's close seen")
    with pytest.raises(ConnectionClosedError):
        conn.version()
    assert not conn.idle_and_open()
