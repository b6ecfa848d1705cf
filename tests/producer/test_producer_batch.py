"""Producer.send_batch against real broker processes, and its pieces without one.

Every message a batch acknowledges is read back with ``get`` and compared
byte for byte (body, attribute, msgId, partition, offset); a broker killed
while batches are in flight must leave every message either acknowledged
and stored, or reported as failed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from helpers.procs import BrokerProc, read_partition

from metaq import (
    BatchSendError,
    BrokerError,
    MessageError,
    MessageTooLargeError,
    NoBrokerAvailableError,
    Producer,
    ProducerError,
    SendResult,
)
from metaq.producer import BatchResults
from metaq.producer._batch import BatchFuture, _Chunk, chunk_bounds
from metaq.protocol import build_payload, get_codec
from metaq.testing import wait_until

pytestmark = pytest.mark.broker

StartBroker = Callable[..., BrokerProc]


def _stored(procs: list[BrokerProc], topic: str) -> dict[tuple[str, int], object]:
    """(partition name, offset) -> every message stored, read with ``get``."""
    out: dict[tuple[str, int], object] = {}
    for b in procs:
        with b.connection() as conn:
            for index in range(b.topics[topic]):
                for m in read_partition(conn, topic, index):
                    out[(f"{b.broker_id}-{index}", m.offset)] = m
    return out


def _check_stored(stored: dict, results: list[SendResult], payloads: list[bytes],
                  flag: int = 0) -> None:
    for r, payload in zip(results, payloads, strict=True):
        m = stored.get((r.partition, r.offset))
        assert m is not None, f"nothing stored at {r}"
        assert (m.msg_id, m.payload, m.flag) == (r.msg_id, payload, flag), r


# --------------------------------------------------------------------------- integration

def test_batches_are_stored_in_order_with_exact_bytes(brokers: StartBroker,
                                                      zk_connect: str) -> None:
    b0 = brokers(0, {"t": 2})
    b1 = brokers(1, {"t": 2})
    small = [b"m%05d-" % i + b"s" * (i % 100) for i in range(3000)]   # ~100 B
    large = [bytes([i % 251]) * 1024 for i in range(600)]             # 1 KiB
    sent: list[tuple[list[SendResult], list[bytes], int]] = []
    with Producer(zk_connect) as producer:
        futures = [(producer.send_batch("t", small[i:i + 500]), small[i:i + 500])
                   for i in range(0, len(small), 500)]
        futures += [(producer.send_batch("t", large[i:i + 200]), large[i:i + 200])
                    for i in range(0, len(large), 200)]
        for fut, bodies in futures:
            results = fut.result(30)
            assert isinstance(results, BatchResults) and len(results) == len(bodies)
            as_list = list(results)
            assert all(isinstance(r, SendResult) for r in as_list)
            assert results[0] == as_list[0] and results[-1] == as_list[-1]
            assert results == as_list and results.msg_ids == [r.msg_id for r in as_list]
            assert results.offsets == [r.offset for r in as_list]
            # one partition per batch, stored in batch order, back to back
            assert len({r.partition for r in as_list}) == 1
            assert [r.offset for r in as_list] == sorted(r.offset for r in as_list)
            for a, b, body in zip(as_list, as_list[1:], bodies, strict=False):
                assert b.offset == a.offset + 20 + len(body)
            sent.append((as_list, bodies, 0))
        attr = producer.send_batch("t", ["text é", {"k": [1, 2]}, b""], attribute="tag-1")
        texts = attr.result(10)
        sent.append((list(texts), [build_payload(get_codec("auto").encode(v), "tag-1")[0]
                                   for v in ["text é", {"k": [1, 2]}, b""]], 1))
        assert producer.send_batch("t", []).result(1) == []
    with Producer(zk_connect, partitioner="hash") as hashed:  # the key picks the partition
        keyed = [hashed.send_batch("t", [b"k"] * 3, key="same-key") for _ in range(2)]
        assert len({r.partition for f in keyed for r in f.result(10)}) == 1
    # round-robin moves on per batch: the ten batches used every partition
    assert {r.partition for results, _, _ in sent for r in results} == {"0-0", "0-1", "1-0",
                                                                        "1-1"}
    stored = _stored([b0, b1], "t")
    assert len(stored) == 3000 + 600 + 3 + 6
    for results, payloads, flag in sent:
        _check_stored(stored, results, payloads, flag)
    assert len({r.msg_id for results, _, _ in sent for r in results}) == 3603


def test_bad_bodies_refuse_the_whole_batch_before_sending(brokers: StartBroker,
                                                         zk_connect: str) -> None:
    b0 = brokers(0, {"t": 1})
    with Producer(zk_connect, max_message_size=1000) as producer:
        with pytest.raises(MessageTooLargeError, match="message #2 of the batch has a body of "
                                                       "1001 bytes"):
            producer.send_batch("t", [b"a", b"b", b"x" * 1001])
        with pytest.raises(MessageError, match="message #1 of the batch: .*msgpack"):
            producer.send_batch("t", [b"a", object()])
        with pytest.raises(MessageError, match="sequence of bodies, not one bytes"):
            producer.send_batch("t", b"abc")  # type: ignore[arg-type]
        with pytest.raises(MessageError, match="attribute must be a str"):
            producer.send_batch("t", [b"a"], attribute=b"x")  # type: ignore[arg-type]
        with pytest.raises(NoBrokerAvailableError, match="'nope'"):
            producer.send_batch("nope", [b"a"])
        ok = producer.send_batch("t", (b"gen%d" % i for i in range(3))).result(10)
    with b0.connection() as conn:
        assert [m.payload for m in read_partition(conn, "t", 0)] == [b"gen0", b"gen1", b"gen2"]
    assert [r.offset for r in ok] == [0, 24, 48]
    with pytest.raises(ProducerError, match="closed"):
        producer.send_batch("t", [b"late"])


def test_messages_the_broker_refuses_are_reported_by_index(brokers: StartBroker,
                                                          zk_connect: str) -> None:
    """A broker with a smaller message limit answers 400 to the big ones: the batch
    fails naming exactly those, and the others are stored."""
    b0 = brokers(0, {"t": 1}, extra_args=["--max-message-size", "2000"])
    bodies = [b"x" * (3000 if i in (3, 7, 8) else 100 + i) for i in range(12)]
    with Producer(zk_connect) as producer:
        fut = producer.send_batch("t", bodies)
        with pytest.raises(BatchSendError, match=r"3 of 12 messages .*#3: .*#7: .*#8: ") as e:
            fut.result(10)
        err = e.value
        assert sorted(err.errors) == [3, 7, 8]
        assert all(isinstance(x, BrokerError) and x.code == 400 for x in err.errors.values())
        assert [i for i, r in enumerate(err.results) if r is None] == [3, 7, 8]
        good = [(r, bodies[i]) for i, r in enumerate(err.results) if r is not None]
        assert producer.send("t", b"after").offset > good[-1][0].offset  # connection still fine
    stored = _stored([b0], "t")
    assert len(stored) == 10
    _check_stored(stored, [r for r, _ in good], [b for _, b in good])


def test_broker_killed_mid_batch_nothing_lost_nothing_invented(
        brokers: StartBroker, zk_connect: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches in flight to a broker that is SIGKILLed: each message ends up
    acknowledged (and then really stored, where its result says) or reported
    failed; the unanswered ones are retried on the other broker."""
    b0 = brokers(0, {"k": 2})
    b1 = brokers(1, {"k": 2})
    retried = [0]
    item = _Chunk.item

    def counting_item(self: _Chunk, index: int) -> object:
        retried[0] += 1  # a message leaving its batch for the one-message retry path
        return item(self, index)

    monkeypatch.setattr(_Chunk, "item", counting_item)
    batches: list[tuple[BatchFuture, list[bytes]]] = []
    stop = threading.Event()
    with Producer(zk_connect, send_timeout=8.0, request_timeout=1.0) as producer:
        producer.send_batch("k", [b"warm"] * 4).result(10)

        def writer() -> None:
            i = 0
            while not stop.is_set() or i < 40:
                bodies = [b"b%d-%d-" % (i, j) + b"z" * (j % 50) for j in range(300)]
                batches.append((producer.send_batch("k", bodies), bodies))
                i += 1

        t = threading.Thread(target=writer, name="test-batch-writer")
        t.start()
        wait_until(lambda: len(batches) > 10, 20, what="batches in flight")
        wait_until(lambda: producer._connections.by_broker.get(1) is not None, 20,
                   what="a connection to broker 1")
        conn = producer._connections.by_broker[1]
        with conn._lock:
            before = set(conn._pending)
        b1.pause()  # SIGSTOP: what is in flight to broker 1 now stays unanswered
        # (replies it wrote before it stopped may still be read: those are acknowledged,
        # so wait for a request sent after the stop, which it cannot have answered)

        def sent_after_the_stop() -> bool:
            with conn._lock:
                return bool(set(conn._pending) - before)

        wait_until(sent_after_the_stop, 20, what="batches in flight to the stopped broker 1")
        b1.kill()  # SIGKILL (of the stopped process): the connection resets
        stop.set()
        t.join(60)
        acked: list[tuple[SendResult, bytes]] = []
        failed = 0
        for fut, bodies in batches:
            try:
                results = list(fut.result(30))
            except BatchSendError as e:
                assert len(e.results) == len(bodies) and e.errors
                assert all(e.results[i] is None for i in e.errors)
                results = list(e.results)
                failed += len(e.errors)
            assert len(results) == len(bodies)
            acked += [(r, body) for r, body in zip(results, bodies, strict=True) if r is not None]
        assert retried[0] > 0, "no message in flight to the killed broker was retried"
        assert len(acked) + failed == sum(len(bodies) for _, bodies in batches)
        after = producer.send_batch("k", [b"after"] * 10).result(10)
        assert {r.broker_id for r in after} == {0}  # broker 1 is gone
    b1.start()
    stored = _stored([b0, b1], "k")
    for r, body in acked:
        m = stored.get((r.partition, r.offset))
        assert m is not None, f"acknowledged but not stored: {r}"
        assert (m.msg_id, m.payload) == (r.msg_id, body), r


def test_group_commit_batches_survive_a_crash(brokers: StartBroker, zk_connect: str) -> None:
    b0 = brokers(0, {"g": 1}, group_commit=True)
    with Producer(zk_connect) as producer:
        bodies = [b"gc-%d" % i for i in range(1000)]
        results = list(producer.send_batch("g", bodies).result(30))
    b0.kill()
    b0.start()
    _check_stored(_stored([b0], "g"), results, bodies)


# --------------------------------------------------------------------------- units

def test_batch_results_are_columns_read_as_send_results() -> None:
    res = BatchResults(3)
    assert list(res) == [None, None, None] and res.msg_ids == [None] * 3
    res._set(0, [b"10", b"11"], [b"2", b"2"], [b"0", b"30"], 4)
    res._set(2, [99], [5], [7], 1)
    assert res[0] == SendResult(10, "4-2", 0, 4, 2)
    assert list(res) == [SendResult(10, "4-2", 0, 4, 2), SendResult(11, "4-2", 30, 4, 2),
                         SendResult(99, "1-5", 7, 1, 5)]
    assert res[1:] == list(res)[1:] and res[-1].partition == "1-5"
    assert res.msg_ids == [10, 11, 99] and res.offsets == [0, 30, 7]
    assert res == list(res) and res != list(res)[:2]
    assert "3 messages" in repr(res)
    with pytest.raises(IndexError):
        res[3]


def test_batch_future_fails_listing_what_failed() -> None:
    fut = BatchFuture("t", 8)
    fut._acked(0, [b"1", b"2", b"3"], [b"0"] * 3, [b"0", b"9", b"18"], 0)
    for i in range(3, 8):
        assert not fut.done()
        if i in (4, 6):
            fut._outcome(i, None, BrokerError(500, f"disk {i}"))
        else:
            fut._outcome(i, SendResult(100 + i, "1-0", 5 * i, 1, 0), None)
    with pytest.raises(BatchSendError, match=r"2 of 8 messages of a batch to topic 't' were "
                                             r"not stored \(#4: .*disk 4; #6: .*disk 6\)") as e:
        fut.result(0)
    assert list(e.value.errors) == [4, 6] and e.value.results[5].msg_id == 105
    assert e.value.results[4] is None and e.value.results[0].offset == 0


def test_chunk_bounds_cover_everything_in_order() -> None:
    assert chunk_bounds([10] * 5, 100, 10_000) == [(0, 5)]
    assert chunk_bounds([10] * 5, 2, 10_000) == [(0, 2), (2, 4), (4, 5)]
    bounds = chunk_bounds([1000, 1000, 5000, 10, 10], 100, 3000)
    assert bounds == [(0, 2), (2, 3), (3, 5)]  # one message alone may pass the byte cap
    assert chunk_bounds([], 4, 100) == [(0, 0)]
