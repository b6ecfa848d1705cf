"""Idle connections are closed; ones that talk (Metaq's version heartbeat) stay."""

from __future__ import annotations

import socket
import time

import pytest

from metaq import ConfigError
from metaq.broker import Broker, BrokerConfig
from metaq.testing import wait_until

pytestmark = pytest.mark.broker


def test_idle_connection_closed_talking_one_kept(tmp_path):
    cfg = BrokerConfig(broker_id=0, data_dir=tmp_path, port=0, topics={"t": 1},
                       idle_timeout=0.5)
    with Broker(cfg) as broker:
        silent = socket.create_connection(("127.0.0.1", broker.port), timeout=10)
        talker = socket.create_connection(("127.0.0.1", broker.port), timeout=10)
        start = time.monotonic()
        opaque = 0

        def silent_closed() -> bool:
            nonlocal opaque
            opaque += 1
            talker.sendall(b"version %d\r\n" % opaque)  # the heartbeat keeps it alive
            assert talker.recv(4096).startswith(b"result 200")
            silent.settimeout(0.05)
            try:
                return silent.recv(1) == b""
            except TimeoutError:
                return False

        wait_until(silent_closed, timeout=10, interval=0.1, what="the silent one closed")
        assert time.monotonic() - start >= 0.5
        talker.sendall(b"version 999\r\n")
        assert talker.recv(4096).startswith(b"result 200")
        silent.close()
        talker.close()


def test_bad_idle_timeout_named(tmp_path):
    with pytest.raises(ConfigError, match="idle_timeout"):
        BrokerConfig(broker_id=0, data_dir=tmp_path, idle_timeout=-1)


def test_unused_connection_closed_and_counted_in_metrics(tmp_path):
    """``first_request_timeout``: a connection that never sends a request is closed, one
    that did stays; both show in ``stats`` and the Prometheus metrics."""
    pytest.importorskip("prometheus_client")
    import urllib.request

    from metaq.prometheus import serve_metrics

    cfg = BrokerConfig(broker_id=0, data_dir=tmp_path, port=0, topics={"t": 1},
                       first_request_timeout=0.3)
    with Broker(cfg) as broker:
        unused = socket.create_connection(("127.0.0.1", broker.port), timeout=10)
        worker = socket.create_connection(("127.0.0.1", broker.port), timeout=10)
        worker.sendall(b"version 1\r\n")
        assert worker.recv(4096).startswith(b"result 200")
        assert unused.recv(1) == b""  # closed by the broker (the timeout is 10 s)
        assert broker.connection_stats()["unused_closed"] == 1
        worker.sendall(b"version 2\r\n")
        assert worker.recv(4096).startswith(b"result 200")
        with serve_metrics(brokers=[broker]) as server:
            text = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics",
                                          timeout=10).read().decode()
        assert 'metaq_broker_connections_unused_closed_total{broker_id="0"} 1.0' in text
        assert 'metaq_broker_connections{broker_id="0"} 1.0' in text
        assert "STAT unused_closed 1" in broker.stats()
        unused.close()
        worker.close()


def test_bad_first_request_timeout_named(tmp_path):
    with pytest.raises(ConfigError, match="first_request_timeout"):
        BrokerConfig(broker_id=0, data_dir=tmp_path, first_request_timeout=-1)
    with pytest.raises(ConfigError, match="evict_unused_connections"):
        BrokerConfig(broker_id=0, data_dir=tmp_path, evict_unused_connections=1)


def test_a_client_whose_reads_end_mid_request_is_not_slow(tmp_path):
    """``request_timeout`` is the deadline of one request: a pipelining client whose every
    write completes a request and begins the next is never "slow", however long it goes."""
    from helpers.raw_client import RawClient

    from metaq.protocol import checksum, encode_put

    cfg = BrokerConfig(broker_id=0, data_dir=tmp_path, port=0, topics={"t": 1},
                       request_timeout=0.3)
    with Broker(cfg) as broker, RawClient(broker.port) as c:
        put = encode_put("t", 0, b"x" * 10, 0, checksum(b"x" * 10), 1)
        half = len(put) // 2
        c.send(put[:half])
        until = time.monotonic() + 1.2  # four deadlines
        n = 0
        while time.monotonic() < until:  # round trips, each leaving a request half sent
            c.send(put[half:] + put[:half])
            assert c.replies(1)[0].code == 200
            n += 1
        c.send(put[half:])
        assert c.replies(1)[0].code == 200
        assert n > 10 and "STAT slow_closed 0" in broker.stats()
