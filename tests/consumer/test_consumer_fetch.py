"""FetchManager against a real broker process: the get sent ahead keeps every partition
serial, in order and complete, through cut messages, listener failures and seeks."""

from __future__ import annotations

import random
import socket
import threading
import zlib
from collections import defaultdict

import pytest

from metaq.consumer._fetcher import FetchManager
from metaq.consumer._session import Readahead
from metaq.consumer._subscription import PartitionState
from metaq.protocol import build_payload, encode_put, get_codec
from metaq.testing import wait_until

pytestmark = pytest.mark.broker

TOPIC = "t"
PARTS = 3


def _put_all(port: int, messages: list[tuple[int, bytes, str | None]]) -> None:
    """Pipelined puts of (partition, body, attribute); every reply must be 200."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        reqs = []
        for i, (part, body, attr) in enumerate(messages):
            payload, flag = build_payload(body, attr)
            reqs.append(encode_put(TOPIC, part, payload, flag,
                                   zlib.crc32(payload) & 0x7FFFFFFF, i))
        sock.sendall(b"".join(reqs))
        replies = sock.makefile("rb")
        for _ in messages:
            head = replies.readline().split()
            assert head[:2] == [b"result", b"200"], head
            replies.read(int(head[2]))


@pytest.fixture
def loaded(zk_connect, broker_factory):
    """A broker with PARTS partitions holding 150 messages of random sizes (0..400 B)."""
    rnd = random.Random(7)
    messages = [(i % PARTS, rnd.randbytes(rnd.randrange(0, 400)), rnd.choice([None, "k=v"]))
                for i in range(150)]
    broker = broker_factory({TOPIC: PARTS}, zk_connect=zk_connect, process=True)
    _put_all(broker.port, messages)
    want = defaultdict(list)
    for part, body, attr in messages:
        want[f"0-{part}"].append((body, attr))
    return broker, dict(want)


def _fetches(broker, listener=None, batch=None, max_size=256):
    return [PartitionState(topic=TOPIC, partition=f"0-{p}", broker_id=0, index=p,
                           broker_address=("127.0.0.1", broker.port), offset=0, msg_id=-1,
                           max_size=max_size, listener=listener, batch_listener=batch,
                           codec=get_codec("bytes"), verify=True, max_retries=5,
                           retry_backoff=0.01)
            for p in range(PARTS)]


def _manager(errors, prefetch=True, runners=2):
    return FetchManager(group="g", runner_count=runners, fetch_timeout=5.0, max_delay=0.05,
                        max_fetch_size=1 << 20, on_error=lambda e, pf: errors.append(e),
                        prefetch=prefetch)


def _check_serial(got, want):
    """Per partition: contiguous offsets from 0, the bodies put, in order, each once."""
    for part, msgs in want.items():
        mine = got[part]
        assert [(m.raw_body, m.attribute) for m in mine] == msgs, part
        assert mine[0].offset == 0
        assert all(a.next_offset == b.offset for a, b in zip(mine, mine[1:], strict=False))


@pytest.fixture
def ready_hits(monkeypatch):
    """Counts fetches served from bytes got ahead (proves the ahead path ran)."""
    hits = [0]
    real = Readahead.take

    def counting(ra, offset, address):
        data = real(ra, offset, address)
        hits[0] += data is not None
        return data

    monkeypatch.setattr(Readahead, "take", counting)
    return hits


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("mode", ["each", "batch"])
def test_every_partition_complete_in_order_with_messages_cut_by_every_reply(
        loaded, ready_hits, prefetch, mode):
    broker, want = loaded
    got = defaultdict(list)
    lock = threading.Lock()

    def on_message(m):
        with lock:
            got[m.partition].append(m)

    def on_messages(batch):
        with lock:
            got[batch[0].partition].extend(batch)

    errors = []
    fm = _manager(errors, prefetch)
    pfs = _fetches(broker, on_message if mode == "each" else None,
                   on_messages if mode == "batch" else None)
    try:
        for pf in pfs:
            fm.add(pf)
        wait_until(lambda: sum(len(v) for v in got.values()) >= 150, 30, what="150 messages")
        assert all(fm.remove(pf, 10) for pf in pfs)
    finally:
        fm.close()
    assert not errors
    _check_serial(got, want)
    assert (ready_hits[0] > 20) if prefetch else ready_hits[0] == 0


@pytest.mark.parametrize("mode", ["each", "batch"])
def test_listener_failure_redelivers_from_the_failing_message_despite_bytes_got_ahead(
        loaded, mode):
    broker, want = loaded
    got = defaultdict(list)
    failed = set()

    def on_message(m):
        if m.partition == "0-1" and m.offset > 3000 and not failed:
            failed.add(m.offset)
            raise RuntimeError("fails once")
        got[m.partition].append(m)

    def on_messages(batch):
        if any(m.partition == "0-1" and m.offset > 3000 for m in batch) and not failed:
            failed.add(batch[0].offset)
            raise RuntimeError("fails once")  # the whole slice comes again
        got[batch[0].partition].extend(batch)

    errors = []
    fm = _manager(errors, runners=1)
    pfs = _fetches(broker, on_message if mode == "each" else None,
                   on_messages if mode == "batch" else None)
    try:
        for pf in pfs:
            fm.add(pf)
        wait_until(lambda: sum(len(v) for v in got.values()) >= 150, 30, what="all messages")
        assert all(fm.remove(pf, 10) for pf in pfs)
    finally:
        fm.close()
    assert failed and not errors
    _check_serial(got, want)


def test_seek_back_while_bytes_are_ready_restarts_at_the_new_offset(loaded):
    broker, want = loaded
    got = []
    at_20, go = threading.Event(), threading.Event()

    def on_message(m):
        got.append(m)
        if len(got) == 20:
            at_20.set()
            assert go.wait(10)

    errors = []
    fm = _manager(errors, runners=1)
    pf = _fetches(broker, on_message)[0]
    try:
        fm.add(pf)
        wait_until(at_20.is_set, 30, what="20 messages")
        remover = threading.Thread(target=fm.remove, args=(pf, 10))
        remover.start()
        ra = fm.readahead(pf)
        wait_until(lambda: not pf.active, 10, what="the partition to be removed")
        go.set()
        remover.join(10)
        assert not pf.busy and ra is not None and ra.data is not None  # got ahead
        assert fm.readahead(pf) is None  # and dropped with the partition: not delivered
        taken = len(got)
        seek = got[5]
        pf.offset, pf.msg_id = seek.offset, got[4].msg_id  # a seek to a message boundary
        fm.add(pf)
        rest = len(want["0-0"]) - 5
        wait_until(lambda: len(got) >= taken + rest, 30, what="redelivery from the seek")
        assert fm.remove(pf, 10)
    finally:
        go.set()
        fm.close()
    assert not errors
    again = got[taken:]
    assert again[0].offset == seek.offset
    assert [m.raw_body for m in again] == [b for b, _ in want["0-0"][5:]]


def test_replies_land_in_one_buffer_per_partition_given_back_when_idle(loaded):
    """While a partition flows its replies are received into one buffer of its own;
    once it has nothing new (a 404 and a back-off) the buffer is given back."""
    broker, want = loaded
    got = defaultdict(list)
    buffers = defaultdict(set)
    lock = threading.Lock()
    pfs = _fetches(broker, max_size=4096)

    def on_message(m):
        pf = pfs[int(m.partition.split("-")[1])]
        ra = fm.readahead(pf)
        with lock:
            got[m.partition].append(m)
            if ra is not None and ra.buf is not None:
                buffers[m.partition].add(id(ra.buf))

    for pf in pfs:
        pf.listener = on_message
    errors = []
    fm = _manager(errors, runners=1)
    try:
        for pf in pfs:
            fm.add(pf)
        wait_until(lambda: sum(len(v) for v in got.values()) >= 150, 30, what="150 messages")
        wait_until(lambda: all(fm.readahead(pf).buf is None for pf in pfs), 30,
                   what="idle partitions without a receive buffer")
        assert all(fm.remove(pf, 10) for pf in pfs)
    finally:
        fm.close()
    assert not errors
    _check_serial(got, want)
    assert all(len(ids) == 1 for ids in buffers.values()), dict(buffers)
