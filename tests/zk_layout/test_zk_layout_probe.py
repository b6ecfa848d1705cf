"""``python -m zk_layout group NAME --brokers``: the inspector asks the brokers (only
then) for each partition's log end, and shows lag in bytes and seconds, against a
real broker registered in a real ZooKeeper."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kazoo.client import KazooClient

from metaq.broker import Broker, BrokerConfig
from metaq.protocol import ReplyParser, checksum, encode_put, msg_id_parts, parse_put_result
from metaq.testing import free_port
from zk_layout import Layout, Partition, StoredOffset, _probe, encode_offset

pytestmark = pytest.mark.broker

GROUP = "lagging"


def put(port: int, topic: str, partition: int, n: int) -> list[tuple[int, int]]:
    """``n`` puts; ``(msgId, offset)`` of each."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        payload = b"x" * 80
        s.sendall(b"".join(encode_put(topic, partition, payload, 0, checksum(payload), i)
                           for i in range(n)))
        parser, got = ReplyParser(), []
        while len(got) < n:
            got += parser.feed(s.recv(65536))
    return [(msg_id, offset) for msg_id, _p, offset in (parse_put_result(r.body) for r in got)]


def run(zk_connect: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zk_layout", "--zk", zk_connect, *args],
                          capture_output=True, text=True, timeout=60)


def rows(text: str) -> dict[str, list[str]]:
    return {ln.split()[1]: ln.split() for ln in text.splitlines() if ln.startswith("lagt ")}


def test_group_brokers_shows_log_end_and_lag(tmp_path, zk_connect, zk_client: KazooClient):
    cfg = BrokerConfig(broker_id=7, data_dir=tmp_path, port=free_port(), topics={"lagt": 3},
                       zk_connect=zk_connect, zk_session_timeout=6.0)
    layout = Layout()
    with Broker(cfg) as b:
        sent = put(b.port, "lagt", 0, 10)  # partition 0: 10 messages, 4 consumed
        put(b.port, "lagt", 1, 5)          # partition 1: 5 messages, all consumed
        end0, end1 = 10 * 100, 5 * 100
        (msg4, off4) = sent[4]
        zk_client.create(layout.offset(GROUP, "lagt", Partition(7, 0)),
                         encode_offset(StoredOffset(offset=off4, msg_id=sent[3][0])),
                         makepath=True)
        zk_client.create(layout.offset(GROUP, "lagt", Partition(7, 1)),
                         encode_offset(StoredOffset(offset=end1, msg_id=1)), makepath=True)
        zk_client.ensure_path(layout.consumer_ids(GROUP))
        before = time.time()
        r = run(zk_connect, "group", GROUP, "--brokers")
        after = time.time()
        assert r.returncode == 0, r.stderr
        assert "LOG END" in r.stdout and "LAG S" in r.stdout
        got = rows(r.stdout)
        # TOPIC PARTITION OWNER OFFSET MSGID CONSUMED-UP-TO LOG-END LAG LAG-S NOTE
        p0 = got["7-0"]
        assert p0[6:8] == [str(end0), str(end0 - off4)]
        age = float(p0[8])
        sent_s = msg_id_parts(msg4)[0] / 1000
        assert before - sent_s - 0.1 <= age <= after - sent_s + 0.1
        assert got["7-1"][6:] == [str(end1), "0", "0.0", "-"]
        assert got["7-2"][3:] == ["-", "-", "-", "0", "-", "-", "-"]  # no offset: no lag

        doc = json.loads(run(zk_connect, "group", GROUP, "--brokers", "--json").stdout)
        lag = {x["partition"]: x for x in doc["lag"]}
        assert lag["7-0"]["log_end"] == end0 and lag["7-0"]["lag_bytes"] == end0 - off4
        assert lag["7-1"]["lag_seconds"] == 0.0 and lag["7-2"]["lag_bytes"] is None

        # without --brokers, nothing is asked of the broker
        gets = int(next(ln.split()[2] for ln in b.stats().splitlines()
                        if ln.startswith("STAT cmd_offset ")))
        plain = run(zk_connect, "group", GROUP)
        assert plain.returncode == 0 and "LOG END" not in plain.stdout
        assert int(next(ln.split()[2] for ln in b.stats().splitlines()
                        if ln.startswith("STAT cmd_offset "))) == gets


def test_an_unreachable_broker_is_a_note_not_a_failure(zk_connect, zk_client: KazooClient):
    layout = Layout()
    dead = free_port()
    zk_client.create(layout.broker_master(9), f"meta://127.0.0.1:{dead}".encode(),
                     makepath=True)
    zk_client.create(layout.offset(GROUP, "gone", Partition(9, 0)),
                     encode_offset(StoredOffset(offset=0, msg_id=1)), makepath=True)
    zk_client.ensure_path(layout.consumer_ids(GROUP))
    r = run(zk_connect, "group", GROUP, "--brokers")
    assert r.returncode == 0, r.stderr
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("gone ")]
    assert f"BROKER: cannot connect to 127.0.0.1:{dead}" in line


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.binary(max_size=200),
                 st.builds(lambda n, body: b"value %d 1\r\n" % n + body,
                           st.integers(-5, 1 << 40), st.binary(max_size=50)),
                 st.builds(lambda c, body: b"result %d %d 1\r\n" % (c, len(body)) + body,
                           st.integers(-1, 999), st.binary(max_size=50))))
def test_garbage_replies_become_errors_never_exceptions(reply):
    """Whatever a "broker" answers, the probe reports an error or a number: the
    reply parser of ``_probe`` raises only OSError, which becomes the partition's
    error."""
    a, b = socket.socketpair()
    try:
        b.sendall(reply)
        b.shutdown(socket.SHUT_WR)
        conn = object.__new__(_probe._Conn)
        conn.where, conn.sock, conn.buf, conn.opaque = "test", a, b"", 0
        try:
            lag = _probe._one(conn, "t", "g", 0, 0, 0)
        except OSError as e:
            assert str(e).startswith("test")
        else:
            assert lag.error or lag.log_end is not None
    finally:
        a.close()
        b.close()
