"""BrokerConnection.read_get_into: replies received straight into the caller's buffer."""

from __future__ import annotations

import pytest
from helpers.inproc import produce

from metaq import BrokerError
from metaq.net import BrokerConnection
from metaq.protocol import iter_messages

pytestmark = pytest.mark.broker

TOPIC = "conn"


@pytest.fixture
def broker(zk_connect, broker_factory):
    b = broker_factory({TOPIC: 1}, zk_connect=zk_connect)
    produce(zk_connect, TOPIC, [bytes([i]) * (50 + i) for i in range(200)])
    return b


def test_read_get_into_gives_the_bytes_read_get_gives(broker):
    with BrokerConnection("127.0.0.1", broker.port) as conn:
        want = conn.read_get(conn.send_get(TOPIC, "g", 0, 0, 4096))
        buf, n = conn.read_get_into(conn.send_get(TOPIC, "g", 0, 0, 4096), b"", None)
        assert bytes(buf[:n]) == want and len(want) > 1000
        # a prefix (the unconsumed tail of the last reply) comes first, then the body
        later = conn.read_get(conn.send_get(TOPIC, "g", 0, 100, 4096))
        again, m = conn.read_get_into(conn.send_get(TOPIC, "g", 0, 100, 4096), b"tail", buf)
        assert again is buf and bytes(buf[:m]) == b"tail" + later


def test_a_small_buffer_is_replaced_not_resized_and_old_views_stay_valid(broker):
    with BrokerConnection("127.0.0.1", broker.port) as conn:
        small = bytearray(16)
        view = memoryview(small)[:8]  # a view held elsewhere (a resize would fail)
        buf, n = conn.read_get_into(conn.send_get(TOPIC, "g", 0, 0, 8192), b"", small)
        assert buf is not small and len(small) == 16 and view.nbytes == 8
        assert sum(1 for _ in iter_messages(buf[:n])) > 10


def test_pipelined_gets_and_an_error_reply_keep_the_connection_usable(broker):
    with BrokerConnection("127.0.0.1", broker.port) as conn:
        a = conn.send_get(TOPIC, "g", 0, 0, 2000)
        b = conn.send_get(TOPIC, "g", 0, 2000, 2000)
        missing = conn.send_get("no-such-topic", "g", 0, 0, 2000)
        buf, n1 = conn.read_get_into(a, b"", None)
        first = bytes(buf[:n1])
        buf, n2 = conn.read_get_into(b, b"", buf)
        with pytest.raises(BrokerError):
            conn.read_get_into(missing, b"", buf)
        whole = conn.read_get(conn.send_get(TOPIC, "g", 0, 0, 4000))
        assert first + bytes(buf[:n2]) == whole


def test_read_results_gives_what_read_result_gives_one_by_one(broker):
    """A run of answers read together: bodies in order, a BrokerError in place of each
    refused put, and answers that arrive over several reads (5,000 of them)."""
    from metaq.protocol import checksum

    def puts(conn: BrokerConnection) -> list[int]:
        out = []
        for i in range(5000):
            body = b"p%d" % i
            topic = "no-such-topic" if i % 997 == 3 else TOPIC
            out.append(conn.send_put(topic, 0, body, 0, checksum(body), hold=True))
        return out

    with BrokerConnection("127.0.0.1", broker.port) as conn:
        together = conn.read_results(puts(conn))
        one_by_one = []
        for opaque in puts(conn):
            try:
                one_by_one.append(conn.read_result(opaque))
            except BrokerError as e:
                one_by_one.append(e)
        assert conn.version()  # the connection is still in step
    refused = [i for i, r in enumerate(together) if isinstance(r, BrokerError)]
    assert refused == [i for i in range(5000) if i % 997 == 3]
    assert [type(r) for r in together] == [type(r) for r in one_by_one]
    assert [str(r) for r in together if isinstance(r, BrokerError)] == \
        [str(r) for r in one_by_one if isinstance(r, BrokerError)]
    ok = [r for r in together if type(r) is bytes]
    assert len(ok) == 5000 - len(refused)
    assert all(len(r.split()) == 3 for r in ok)
