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
