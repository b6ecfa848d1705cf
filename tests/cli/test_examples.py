"""Every non-Spark example in examples/ runs against a real cluster (Spark ones: tests/spark)."""

from __future__ import annotations

import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.procs import read_partition

pytestmark = pytest.mark.broker

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TOPIC = "orders"


def run(name: str, *args: str) -> str:
    out = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.fixture
def cluster(zk_connect, broker_factory):
    return broker_factory({TOPIC: 3}, zk_connect=zk_connect, process=True)


def test_producer_then_consumers_then_inspection(zk_connect, cluster):
    out = run("producer.py", "--zk", zk_connect, "--topic", TOPIC, "--count", "300")
    assert "acknowledged 300 messages" in out
    assert re.search(r"first message: msgId=\d+ partition=0-\d offset=\d+", out)

    out = run("consumer_service.py", "--zk", zk_connect, "--topic", TOPIC, "--group",
              "billing", "--count", "300")
    assert "handled 300 messages" in out
    assert "'orders': ['0-0', '0-1', '0-2']" in out

    out = run("batch_consumer.py", "--zk", zk_connect, "--topic", TOPIC, "--group",
              "reports", "--count", "300")
    assert re.search(r"^300 messages, \d+ bytes$", out, re.M)

    out = run("inspect_zk.py", "--zk", zk_connect)
    assert re.search(r"^broker 0: meta://127\.0\.0\.1:\d+$", out, re.M)
    assert "topic orders: 3 partitions" in out
    assert "group billing: 0 members" in out and "group reports: 0 members" in out
    assert re.search(r"orders 0-0: owner=None committed=\d+", out)


def test_broadcast_and_manual_ack_examples(zk_connect, cluster, tmp_path):
    run("producer.py", "--zk", zk_connect, "--topic", TOPIC, "--count", "60")
    for member in ("n1", "n2"):
        out = run("broadcast_consumer.py", "--zk", zk_connect, "--topic", TOPIC, "--group",
                  "caches", "--id", member, "--state-dir", str(tmp_path), "--count", "60")
        assert re.search(rf"member {member} of caches-\S+ got 60 messages", out), out
        assert (tmp_path / f"{member}.offsets").exists()
    out = run("manual_ack_consumer.py", "--zk", zk_connect, "--topic", TOPIC, "--group",
              "ledger", "--count", "60", "--fail-first-write")
    assert "wrote 60 messages with 1 rollback(s)" in out


def test_transactional_producer_example(zk_connect, cluster):
    out = run("transactional_producer.py", "--zk", zk_connect, "--topic", TOPIC)
    assert "local transaction committed: 3 messages" in out
    assert "local transaction rolled back: the order was cancelled" in out
    assert "XA branch prepared (vote 0) and committed" in out
    assert "recovered a prepared branch and rolled it back" in out
    with cluster.connection() as conn:  # exactly what was committed is in the logs
        bodies = sorted(bytes(m.payload) for p in range(3)
                        for m in read_partition(conn, TOPIC, p))
    assert bodies == sorted([b"order 0 created", b"order 1 created", b"order 2 created",
                             b"paid"])


def test_asyncio_service_example(zk_connect, broker_factory, tmp_path):
    broker = broker_factory({TOPIC: 3, "receipts": 1}, zk_connect=zk_connect, process=True)
    run("producer.py", "--zk", zk_connect, "--topic", TOPIC, "--count", "200")
    db = tmp_path / "orders.db"
    out = run("aio_service.py", "--zk", zk_connect, "--topic", TOPIC, "--group", "aio-billing",
              "--reply-topic", "receipts", "--db", str(db), "--count", "200")
    assert "stored 200 orders, sent 200 replies" in out
    assert "'orders': ['0-0', '0-1', '0-2']" in out
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT COUNT(DISTINCT body) FROM orders").fetchone()[0] == 200
    with broker.connection() as conn:
        replies = [bytes(m.payload) for m in read_partition(conn, "receipts", 0)]
    assert len(replies) == 200 and all(r.startswith(b"stored ") for r in replies)
