"""The producer against real ZooKeeper and real broker processes (``metaq broker start``).

Every message sent is read back with ``get`` and compared byte for byte
(body, attribute, msgId, partition, offset).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.procs import BrokerProc, read_partition

from metaq import (
    MessageError,
    MessageTooLargeError,
    NoBrokerAvailableError,
    Producer,
    ProducerError,
    ProtocolError,
    SendResult,
    SendTimeoutError,
    ZkSecurity,
)
from metaq.protocol import build_payload, get_codec, scan_messages
from metaq.testing import expire_session, free_port, wait_until

pytestmark = pytest.mark.broker

StartBroker = Callable[..., BrokerProc]


def _expected(body: object, attribute: str | None) -> tuple[bytes, int]:
    return build_payload(get_codec("auto").encode(body), attribute)


def _stored(procs: list[BrokerProc], topic: str) -> dict[str, list]:
    """partition name -> every message stored there, read with ``get``."""
    out: dict[str, list] = {}
    for b in procs:
        with b.connection() as conn:
            for index in range(b.topics[topic]):
                out[f"{b.broker_id}-{index}"] = read_partition(conn, topic, index)
    return out


def _check_all_stored(procs: list[BrokerProc], topic: str,
                      sent: list[tuple[SendResult, bytes, int]]) -> None:
    """Every sent message is where its SendResult says, with the exact bytes,
    and nothing else is stored."""
    stored = _stored(procs, topic)
    at = {(name, m.offset): m for name, msgs in stored.items() for m in msgs}
    assert sum(len(v) for v in stored.values()) == len(sent)
    for result, payload, flag in sent:
        m = at.get((result.partition, result.offset))
        assert m is not None, f"nothing stored at {result}"
        assert (m.msg_id, m.payload, m.flag) == (result.msg_id, payload, flag), result


def test_every_message_sent_is_stored_exactly_and_survives_a_restart(brokers: StartBroker,
                                                                     zk_connect: str) -> None:
    b0 = brokers(0, {"orders": 3})
    b1 = brokers(1, {"orders": 2})
    bodies: list[tuple[object, str | None]] = [
        (b"plain bytes", None), ("unicode text \u00e9\u4e2d", None), ({"id": 7, "tags": [1]}, None),
        (b"", None), (b"with attribute", "attr-1"), (b"", "only an attribute"),
        ("text", "\u00e9t\u00e9"), (bytes(range(256)) * 400, "big"),
    ]
    sent: list[tuple[SendResult, bytes, int]] = []
    with Producer(zk_connect) as producer:
        assert producer.partitions("orders") == ["0-0", "0-1", "0-2", "1-0", "1-1"]
        for body, attr in bodies:  # blocking sends
            r = producer.send("orders", body, attribute=attr)
            assert isinstance(r, SendResult) and r.partition == f"{r.broker_id}-{r.index}"
            sent.append((r, *_expected(body, attr)))
        futures = []
        for i in range(3000 - len(bodies)):  # pipelined sends
            body = b"async-%d-" % i + b"z" * (i % 300)
            attr = None if i % 3 else f"a{i}"
            futures.append((producer.send_async("orders", body, attr), body, attr))
        for fut, body, attr in futures:
            sent.append((fut.result(10), *_expected(body, attr)))
    per_partition: dict[str, int] = {}
    for r, _, _ in sent:
        per_partition[r.partition] = per_partition.get(r.partition, 0) + 1
    assert per_partition == {p: 600 for p in ["0-0", "0-1", "0-2", "1-0", "1-1"]}  # round-robin
    assert len({r.msg_id for r, _, _ in sent}) == 3000
    _check_all_stored([b0, b1], "orders", sent)

    b0.stop()
    b0.start()
    _check_all_stored([b0, b1], "orders", sent)  # the same after a restart
    with Producer(zk_connect) as producer:  # and writing goes on
        more = [(producer.send_async("orders", b"after %d" % i), b"after %d" % i)
                for i in range(100)]
        sent += [(f.result(10), body, 0) for f, body in more]
    _check_all_stored([b0, b1], "orders", sent)


def test_follows_brokers_appearing_moving_and_disappearing(brokers: StartBroker,
                                                           zk_connect: str,
                                                           zk_server: object) -> None:
    brokers(0, {"t": 2})
    with Producer(zk_connect) as producer:
        assert producer.partitions("t") == ["0-0", "0-1"]
        b1 = brokers(1, {"t": 3})
        wait_until(lambda: len(producer.partitions("t")) == 5, 10,
                   what="the producer to see broker 1's partitions")
        results = [producer.send("t", b"m%d" % i) for i in range(20)]
        assert {r.broker_id for r in results} == {0, 1}

        b1.stop()  # SIGTERM: unregisters
        wait_until(lambda: producer.partitions("t") == ["0-0", "0-1"], 10,
                   what="broker 1's partitions to go")
        results = [producer.send("t", b"n%d" % i) for i in range(20)]
        assert {r.broker_id for r in results} == {0}

        # A new ZooKeeper session must re-arm the watches.
        expire_session(producer._client, zk_server.hosts)  # type: ignore[attr-defined]
        port = free_port()
        while port == b1.port:
            port = free_port()
        moved = BrokerProc(zk_connect, 1, b1.data_dir, {"t": 3}, port=port)  # another port
        with moved:
            moved.start()
            wait_until(lambda: len(producer.partitions("t")) == 5, 15,
                       what="the producer to see broker 1 again after its session expired")
            results = [producer.send("t", b"o%d" % i) for i in range(20)]
            assert {r.broker_id for r in results} == {0, 1}
            with moved.connection() as conn:
                stored = {m.payload for i in range(3) for m in read_partition(conn, "t", i)}
            assert {b"o%d" % i for i in range(20) if results[i].broker_id == 1} <= stored


def test_retries_on_another_partition_when_a_broker_dies(brokers: StartBroker,
                                                         zk_connect: str) -> None:
    b0 = brokers(0, {"t": 2})
    b1 = brokers(1, {"t": 2})
    with Producer(zk_connect, send_timeout=5.0) as producer:
        warm = [producer.send("t", b"warm%d" % i) for i in range(8)]
        assert {r.broker_id for r in warm} == {0, 1}  # connected to both
        futures = []
        stop = threading.Event()
        until = [2000]  # raised at the kill: some messages always go out after it

        def writer() -> None:
            i = 0
            while not stop.is_set() or i < until[0]:
                futures.append((producer.send_async("t", b"w%d" % i), b"w%d" % i))
                i += 1

        t = threading.Thread(target=writer, name="test-writer")
        t.start()
        wait_until(lambda: len(futures) > 500, 10, what="messages in flight")
        b1.kill()  # SIGKILL while messages are in flight to it
        until[0] = max(2000, len(futures) + 500)  # the writer cannot be done already
        stop.set()
        t.join(30)
        results = [(f.result(10), body) for f, body in futures]
        retried = [f for f, _ in futures if f.attempts > 1]
        assert retried, "no message was retried although broker 1 died"
        after = [producer.send("t", b"after%d" % i) for i in range(20)]
        assert {r.broker_id for r in after} == {0}  # broker 1 is avoided
        assert all(r.broker_id == 0 for f, _ in futures if f.attempts > 1
                   for r in [f.result()])
    b1.start()
    stored = _stored([b0, b1], "t")
    at = {(name, m.offset): m.payload for name, msgs in stored.items() for m in msgs}
    for r, body in results:
        assert at[(r.partition, r.offset)] == body


def test_a_silent_broker_times_out_and_its_messages_go_elsewhere(brokers: StartBroker,
                                                                 zk_connect: str) -> None:
    brokers(0, {"t": 1})
    b1 = brokers(1, {"t": 1})
    with Producer(zk_connect, send_timeout=4.0, request_timeout=0.5) as producer:
        assert {producer.send("t", b"x%d" % i).broker_id for i in range(4)} == {0, 1}
        b1.pause()  # SIGSTOP: the connection stays up, nothing is answered
        try:
            futures = [producer.send_async("t", b"p%d" % i) for i in range(10)]
            results = [f.result(10) for f in futures]
            assert {r.broker_id for r in results} == {0}
            assert any(f.attempts == 2 for f in futures)
        finally:
            b1.resume()


def test_bad_messages_are_refused_before_anything_is_sent(brokers: StartBroker,
                                                          zk_connect: str) -> None:
    b0 = brokers(0, {"t": 1}, extra_args=["--max-transfer-size", "8M"])
    with Producer(zk_connect) as producer:
        limit = 4 * 1024 * 1024
        with pytest.raises(MessageTooLargeError, match=f"{limit + 1} bytes is over the limit "
                                                       f"of {limit}"):
            producer.send("t", b"x" * (limit + 1))
        with pytest.raises(MessageTooLargeError):
            producer.send_async("t", "é" * (limit // 2 + 1))  # 2 bytes each in UTF-8
        with pytest.raises(MessageTooLargeError, match="attribute"):
            producer.send("t", b"x", attribute="a" * 40_000)
        with pytest.raises(MessageError, match="attribute must be a str"):
            producer.send("t", b"x", attribute=b"bytes")  # type: ignore[arg-type]
        with pytest.raises(ProtocolError, match="bad topic .*must be a str"):
            producer.send(["t"], b"x")  # type: ignore[arg-type]
        with pytest.raises(ProtocolError, match="bad topic .*must be a str"):
            producer.send(None, b"x")  # type: ignore[arg-type]
        with pytest.raises(MessageError, match="msgpack"):
            producer.send("t", object())
        with pytest.raises(ProtocolError, match="bad topic"):
            producer.send("bad topic", b"x")
        with pytest.raises(NoBrokerAvailableError, match="no broker publishes topic 'nope'"):
            producer.send("nope", b"x")
        with Producer(zk_connect, partitioner="hash") as hashed, \
                pytest.raises(MessageError, match="key must be"):
            hashed.send("t", b"x", key=1.5)
        big = producer.send("t", b"y" * limit)  # exactly the limit is fine
    with b0.connection() as conn:
        stored = read_partition(conn, "t", 0, max_size=8 * 1024 * 1024)
    assert [(m.offset, len(m.payload)) for m in stored] == [(big.offset, limit)]
    with Producer(zk_connect, max_message_size=10) as small, \
            pytest.raises(MessageTooLargeError, match="11 bytes is over the limit of 10"):
        small.send("t", b"x" * 11)


def test_hash_and_user_partitioners(brokers: StartBroker, zk_connect: str) -> None:
    brokers(0, {"t": 2})
    brokers(1, {"t": 2})
    names = ["0-0", "0-1", "1-0", "1-1"]
    placed: list[dict[str, str]] = []
    for security in (None, ZkSecurity(auth="producer:secret")):  # two producers: same placement
        with Producer(zk_connect, partitioner="hash", zk_security=security) as producer:
            where: dict[str, str] = {}
            for i in range(60):
                key = f"user-{i % 12}"
                r = producer.send("t", b"%d" % i, key=key)
                assert where.setdefault(key, r.partition) == r.partition
                assert r.partition == names[zlib.crc32(key.encode()) % 4]
            placed.append(where)
    assert placed[0] == placed[1] and len(set(placed[0].values())) > 1

    calls = []

    def pick(topic, partitions, body, key):  # type: ignore[no-untyped-def]
        calls.append((topic, [str(p) for p in partitions], body, key))
        return "1-0" if body.startswith(b"x") else 0

    with Producer(zk_connect, partitioner=pick) as producer:
        assert producer.send("t", b"x1", key="k").partition == "1-0"
        assert producer.send("t", "y1").partition == "0-0"
    assert calls[0] == ("t", names, b"x1", "k") and calls[1][2] == b"y1"

    with Producer(zk_connect, partitioner=lambda *a: "7-7") as producer, \
            pytest.raises(ProducerError, match="not one of its 4 partitions"):
        producer.send("t", b"x")


def test_crash_with_group_commit_loses_no_acknowledged_message(brokers: StartBroker,
                                                               zk_connect: str) -> None:
    b0 = brokers(0, {"c": 2}, group_commit=True)
    acked: list[tuple[SendResult, bytes]] = []
    failed: list[BaseException] = []
    lock = threading.Lock()
    stop = threading.Event()

    with Producer(zk_connect, send_timeout=2.0, retries=1) as producer:
        def writer(n: int) -> None:
            i = 0
            while not stop.is_set():
                body = b"w%d-%d-" % (n, i) + os.urandom(i % 64)
                i += 1
                try:
                    fut = producer.send_async("c", body)
                except ProducerError as e:
                    with lock:
                        failed.append(e)
                    continue

                def done(f, body=body) -> None:  # type: ignore[no-untyped-def]
                    with lock:
                        if f.exception() is None:
                            acked.append((f.result(), body))
                        else:
                            failed.append(f.exception())
                fut.add_done_callback(done)

        threads = [threading.Thread(target=writer, args=(n,), name=f"test-writer-{n}")
                   for n in range(3)]
        for t in threads:
            t.start()
        wait_until(lambda: len(acked) > 3000, 30, what="3000 acknowledged messages")
        b0.kill()  # SIGKILL with messages in flight
        wait_until(lambda: len(failed) > 0, 10, what="sends to fail after the crash")
        stop.set()
        for t in threads:
            t.join(30)
    assert all(isinstance(e, (SendTimeoutError, NoBrokerAvailableError, ProducerError))
               for e in failed)
    snapshot = list(acked)

    b0.start()  # recovery scans the logs
    with b0.connection() as conn:
        stored = {(f"0-{p}", m.offset): m for p in range(2) for m in read_partition(conn, "c", p)}
    for r, body in snapshot:
        m = stored.get((r.partition, r.offset))
        assert m is not None and (m.msg_id, m.payload) == (r.msg_id, body), r
    for seg in sorted(b0.data_dir.glob("c-*/*.meta")):
        data = seg.read_bytes()
        valid, count, problem = scan_messages(data)
        assert (valid, problem) == (len(data), None), f"{seg}: {problem} at {valid}"
    with Producer(zk_connect) as producer:  # writing continues after the crash
        more = [(producer.send("c", b"later%d" % i), b"later%d" % i) for i in range(20)]
    with b0.connection() as conn:
        stored_after = {(f"0-{p}", m.offset): m.payload for p in range(2)
                        for m in read_partition(conn, "c", p)}
    assert all(stored_after[(r.partition, r.offset)] == body for r, body in more)


def test_close_waits_for_messages_in_flight_and_stops_threads(brokers: StartBroker,
                                                              zk_connect: str) -> None:
    brokers(0, {"t": 2})
    producer = Producer(zk_connect)
    chained: list = []
    errors: list = []

    def callback(fut) -> None:  # type: ignore[no-untyped-def]
        chained.append(producer.send_async("t", b"chained"))  # fine: does not wait
        try:
            producer.send("t", b"blocking")  # would wait for its own thread
        except ProducerError as e:
            errors.append(e)

    producer.send_async("t", b"first").add_done_callback(callback)
    wait_until(lambda: chained and errors, 10, what="the callback to run")
    assert "callback" in str(errors[0]) and chained[0].result(10).offset >= 0
    futures = [producer.send_async("t", b"%d" % i) for i in range(5000)]
    names = {t.name for t in threading.enumerate()}
    assert {"metaq-producer-zk", "metaq-producer-retry"} <= names
    assert any(n.startswith("metaq-pipe-reader-0@") for n in names)
    producer.close()
    assert all(f.done() and f.exception() is None for f in futures)
    wait_until(lambda: not [t for t in threading.enumerate()
                            if t.name.startswith(("metaq-producer-", "metaq-pipe-"))], 10,
               what="producer threads to stop")
    with pytest.raises(ProducerError, match="closed"):
        producer.send("t", b"x")


def _cli(args: list[str], stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "metaq", "produce", *args], input=stdin,
                          capture_output=True, timeout=60)


def test_cli_produce(brokers: StartBroker, zk_connect: str, tmp_path: Path) -> None:
    b0 = brokers(0, {"t": 2})
    done = _cli(["--zk", zk_connect, "--topic", "t"], b"alpha\nbeta gamma\r\n\ndelta")
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().splitlines()[-1] == "acknowledged 4 of 4 messages"
    src = tmp_path / "lines.txt"
    src.write_bytes(b"from file 1\nfrom file 2\n")
    done = _cli(["--zk", zk_connect, "--topic", "t", "--file", str(src), "--attribute", "f"])
    assert done.stdout.decode().splitlines()[-1] == "acknowledged 2 of 2 messages"
    done = _cli(["--zk", zk_connect, "--topic", "t", "--count", "500", "--size", "64"])
    assert done.stdout.decode().splitlines()[-1] == "acknowledged 500 of 500 messages"
    done = _cli(["--zk", zk_connect, "--topic", "t", "--sync", "--print"], b"s1\ns2\n")
    out = done.stdout.decode().splitlines()
    assert out[-1] == "acknowledged 2 of 2 messages" and len(out) == 3
    assert all(len(line.split()) == 3 and line.split()[0] in ("0-0", "0-1") for line in out[:2])
    with b0.connection() as conn:
        stored = [m for p in range(2) for m in read_partition(conn, "t", p)]
    payloads = {m.payload for m in stored}
    assert {b"alpha", b"beta gamma", b"", b"delta", b"s1", b"s2"} <= payloads
    assert {b"\x00\x00\x00\x01ffrom file 1", b"\x00\x00\x00\x01ffrom file 2"} <= payloads
    assert sum(1 for m in stored if len(m.payload) == 64) == 500

    done = _cli(["--zk", zk_connect, "--topic", "nope"], b"a\nb\n")
    assert done.returncode == 1
    assert done.stdout.decode().splitlines()[-1] == "acknowledged 0 of 2 messages"
    assert b"NoBrokerAvailableError" in done.stderr
    done = _cli(["--zk", zk_connect, "--topic", "t", "--size", "10"])
    assert done.returncode == 2 and b"--size only applies" in done.stderr
