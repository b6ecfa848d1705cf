"""Broker storage (reference section 7): segments, recovery, flush policy, retention."""

from __future__ import annotations

import asyncio
import logging
import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import metaq
from metaq.broker import Storage
from metaq.protocol import encode_message, iter_messages, scan_messages


def rec(i: int, size: int = 100) -> bytes:
    """Message ``i`` of ``20 + size`` bytes."""
    return encode_message(i, 0, ((b"%08d" % i) * (size // 8 + 1))[:size])


def read_all(plog) -> list:
    """Every message of the log, read segment by segment through read()."""
    out, off = [], plog.min_offset
    while off < plog.end:
        s = plog.read(off, 1 << 30)
        data = s.segment.pread(off, s.length)
        msgs = list(iter_messages(data, off))
        assert msgs and msgs[-1].next_offset == off + s.length, "a read ends between messages"
        out += msgs
        off += s.length
    return out


def seg_files(plog) -> list[str]:
    return sorted(n for n in os.listdir(plog.dir) if n.endswith(".meta"))


def test_append_read_and_segment_roll(tmp_path):
    with Storage(tmp_path, max_segment_size=4096) as storage:
        plog = storage.open_topic("t", 2)[1]
        assert plog.dir == tmp_path / "t-1"
        offsets = [plog.append(rec(i), 1) for i in range(100)]
        assert offsets == [i * 120 for i in range(100)]
        assert plog.min_offset == 0 and plog.end == 12000
        names = seg_files(plog)
        assert names[0] == "00000000000000000000.meta"
        # every segment starts at an absolute offset equal to the previous end
        starts = [int(n[:20]) for n in names]
        assert all(len(n) == 25 for n in names) and len(names) == 3
        sizes = [os.path.getsize(plog.dir / n) for n in names]
        assert [a + b for a, b in zip(starts, sizes, strict=True)][:-1] == starts[1:]
        assert all(size <= 4096 for size in sizes)
        msgs = read_all(plog)
        assert [m.msg_id for m in msgs] == list(range(100))
        assert [m.offset for m in msgs] == offsets
        # a read never crosses a segment end
        s = plog.read(starts[1] - 120, 10_000)
        assert s.length == 120
        assert plog.read(12000, 100) is None and plog.read(-1, 100) is None
        assert plog.read_bytes(120, 50) == rec(1)[:50]


def test_batch_append_is_one_unit(tmp_path):
    with Storage(tmp_path, max_segment_size=4096) as storage:
        plog = storage.open_topic("t", 1)[0]
        batch = b"".join(rec(i) for i in range(50))  # 6000 bytes > segment size
        assert plog.append(batch, 50) == 0
        assert plog.append(rec(50), 1) == 6000      # rolled: the batch stays whole
        assert seg_files(plog) == ["00000000000000000000.meta", "00000000000000006000.meta"]


def test_recent_is_the_last_append_only_while_nothing_else_changed_the_log(tmp_path):
    """What a woken slave get is answered from (``_server._replica_get``): the bytes the
    file holds there, and only while they are the last append, whole."""
    with Storage(tmp_path, max_segment_size=1 << 20) as storage:
        plog = storage.open_topic("t", 1)[0]
        assert plog.recent(0, 120) is None
        for i in range(3):
            at = plog.append(rec(i), 1)
            got = plog.recent(at, 120)
            assert got == rec(i) == plog.read_bytes(at, 120)
            assert plog.recent(at, 60) is None and plog.recent(at - 120, 120) is None
        plog.truncate(240)  # the last append is gone from the log
        assert plog.recent(240, 120) is None
        plog.append(rec(7), 1)
        assert plog.recent(240, 120) == rec(7) == plog.read_bytes(240, 120)
        big = b"".join(rec(i, 1000) for i in range(70))  # more than it keeps
        at = plog.append(big, 70)
        assert plog.recent(at, len(big)) is None and plog.recent(240, 120) is None


def test_reopen_keeps_everything(tmp_path):
    with Storage(tmp_path, max_segment_size=4096) as storage:
        plog = storage.open_topic("t", 1)[0]
        for i in range(77):
            plog.append(rec(i, 64), 1)
        end = plog.end
    with Storage(tmp_path, max_segment_size=4096) as storage:
        plog = storage.open_topic("t", 1)[0]
        assert plog.end == end
        assert [m.msg_id for m in read_all(plog)] == list(range(77))
        assert plog.append(rec(77, 64), 1) == end


@pytest.mark.parametrize("damage", ["garbage", "torn_header", "torn_payload"])
def test_recovery_cuts_torn_tail(tmp_path, caplog, damage):
    with Storage(tmp_path, max_segment_size=4096) as storage:
        plog = storage.open_topic("t", 1)[0]
        for i in range(60):
            plog.append(rec(i), 1)
        end = plog.end
        last = plog.dir / seg_files(plog)[-1]
    start = int(last.name[:20])
    if damage == "garbage":
        with open(last, "ab") as f:
            f.write(b"\x00\x00\x00\x10garbage!garbage!garbage")
        cut = 27
    elif damage == "torn_header":
        with open(last, "ab") as f:
            f.write(rec(60)[:11])
        cut = 11
    else:
        with open(last, "ab") as f:
            f.write(rec(60)[:90])
        cut = 90
    caplog.set_level(logging.WARNING)
    with Storage(tmp_path, max_segment_size=4096) as storage:
        plog = storage.open_topic("t", 1)[0]
        assert plog.end == end
        assert os.path.getsize(last) == end - start
        assert [m.msg_id for m in read_all(plog)] == list(range(60))
        assert plog.append(rec(60), 1) == end
    text = caplog.text
    assert f"at offset {end}" in text and f"cut {cut} bytes" in text
    saved = last.with_name(f"{last.name}.cut-{end}")
    assert saved.read_bytes()[:cut] == saved.read_bytes() and len(saved.read_bytes()) == cut


def _written(tmp_path, n: int = 50, **kw):
    with Storage(tmp_path, **kw) as storage:
        plog = storage.open_topic("t", 1)[0]
        for i in range(n):
            plog.append(rec(i), 1)
        return plog.dir / seg_files(plog)[-1], plog.end


@pytest.mark.parametrize("where", ["payload", "length", "checksum", "msg_id"])
def test_recovery_keeps_the_intact_messages_after_a_damaged_one(tmp_path, caplog, where):
    """Issue 13: a damaged message in the writable segment costs only itself; the
    messages after it keep their offsets, and the log end (so every offset) stays."""
    path, end = _written(tmp_path)
    data = bytearray(path.read_bytes())
    at = {"payload": 60, "length": 1, "checksum": 5, "msg_id": 12}[where]
    data[20 * 120 + at] ^= 0x5A  # a byte of message 20
    path.write_bytes(bytes(data))
    caplog.set_level(logging.WARNING)
    with Storage(tmp_path) as storage:
        plog = storage.open_topic("t", 1)[0]
        assert plog.end == end  # nothing cut: no offset will be reused
        bad = (2400, 2520) if where != "msg_id" else None
        if bad is None:  # the msgId is not covered by the checksum: still a valid message
            assert plog.damaged == []
            return
        assert [(a, b) for a, b, _ in plog.damaged] == [bad]
        assert plog.nearest_valid_offset(2400) == 2520
        assert plog.nearest_valid_offset(2450) == 2520
        good = [m.msg_id for m in _valid_messages(plog)]
        assert good == [i for i in range(50) if i != 20]
        assert plog.append(rec(50), 1) == end  # new messages go after everything
    assert "at offset 2400; 120 bytes (offsets 2400..2520) kept in place" in caplog.text
    aside = path.with_name(f"{path.name}.damaged-2400")
    assert aside.read_bytes() == bytes(data[2400:2520])
    # a second restart knows the damage (from <segment>.damaged) and records it once
    with Storage(tmp_path) as storage:
        plog = storage.open_topic("t", 1)[0]
        assert [(a, b) for a, b, _ in plog.damaged] == [bad]
        assert plog.end == end + 120


def test_recovery_never_resyncs_on_an_empty_message_inside_a_torn_one(tmp_path):
    """A flag of 0 followed by a body starting with 4 zero bytes reads, 16 bytes into
    the message, as an empty message (length 0, checksum 0 = CRC32 of nothing): a torn
    write of such a message must still be cut, not kept as damage and a fake message."""
    body = b"\0\0\0\0" + b"A" * 12 + b"\x7f\xff\xff\xff" + b"B" * 200
    with Storage(tmp_path) as storage:
        plog = storage.open_topic("t", 1)[0]
        plog.append(encode_message(1, 0, body), 1)
        path = plog.dir / seg_files(plog)[-1]
    with open(path, "r+b") as f:
        f.truncate(120)  # torn: the fake "message" at 16..36 is whole, what follows is not
    with Storage(tmp_path) as storage:
        plog = storage.open_topic("t", 1)[0]
        assert (plog.end, plog.damaged) == (0, [])


def test_a_reader_never_resyncs_on_an_empty_message_inside_damage(tmp_path):
    """The same rule for damage met by a reader in a sealed segment."""
    body = b"\0\0\0\0" + b"A" * 100
    with Storage(tmp_path, max_segment_size=1024) as storage:
        plog = storage.open_topic("t", 1)[0]
        for i in range(20):
            plog.append(encode_message(i + 1, 0, body), 1)
        first = plog.segments[0].path
    data = bytearray(first.read_bytes())
    data[124 + 60] ^= 0x55  # message 1's payload; 16 bytes in, a fake empty "message"
    first.write_bytes(bytes(data))
    with Storage(tmp_path, max_segment_size=1024) as storage:
        plog = storage.open_topic("t", 1)[0]
        assert plog.nearest_valid_offset(124) == 248  # the next real message


def test_a_damaged_first_message_is_named_by_the_byte_after_it(tmp_path):
    """The log start is answered as it is (what readers ask for "earliest"), damaged
    or not; asked for the byte after it, the broker checks the message holding that
    byte and names the next valid one: how a reader that met damage at the log start
    goes on."""
    body = b"B" * 100
    with Storage(tmp_path, max_segment_size=1024) as storage:
        plog = storage.open_topic("t", 1)[0]
        for i in range(20):
            plog.append(encode_message(i + 1, 0, body), 1)
        assert plog.nearest_valid_offset(1) == 0  # intact: the start
        path = plog.segments[0].path
    data = bytearray(path.read_bytes())
    data[40] ^= 0x55  # message 0's payload
    path.write_bytes(bytes(data))
    with Storage(tmp_path, max_segment_size=1024) as storage:
        plog = storage.open_topic("t", 1)[0]
        assert plog.nearest_valid_offset(0) == 0  # the start, not looked at
        assert plog.nearest_valid_offset(1) == 120  # damaged: the next message
        assert plog.damage_at(0) is not None  # and recorded, for gets
        assert plog.nearest_valid_offset(1) == 120


def _valid_messages(plog) -> list:
    """Every valid message, stepping over damaged ranges with nearest_valid_offset."""
    out, off = [], plog.min_offset
    while off < plog.end:
        known = plog.damage_at(off)
        if known is not None:
            off = known[1]
            continue
        s = plog.read(off, 1 << 30)
        data = s.segment.pread(off, s.length)
        valid, _n, _problem = scan_messages(data)
        out += list(iter_messages(data[:valid], off))
        off += valid
        if off < plog.end and valid < s.length:
            off = plog.nearest_valid_offset(off)
    return out


def test_recovery_marks_garbage_to_the_end_damaged_and_appends_after_it(tmp_path):
    path, end = _written(tmp_path)
    data = bytearray(path.read_bytes())
    data[40 * 120:] = os.urandom(len(data) - 40 * 120)  # no valid message from 40 on
    data[40 * 120:40 * 120 + 4] = b"\x00\x00\x00\x10"  # a plausible length, bad checksum
    path.write_bytes(bytes(data))
    with Storage(tmp_path) as storage:
        plog = storage.open_topic("t", 1)[0]
        assert plog.end == end
        assert [(a, b) for a, b, _ in plog.damaged] == [(4800, end)]
        assert plog.nearest_valid_offset(4800) == end
        assert plog.append(rec(99), 1) == end


def test_recovery_does_not_take_a_zeroed_tail_for_messages(tmp_path):
    """A hole (power loss extends a file with zeros) reads as empty messages with a
    matching checksum; it is damage, never delivered as messages."""
    path, end = _written(tmp_path, 10)
    with open(path, "ab") as f:
        f.write(bytes(20 * 7))
    with Storage(tmp_path) as storage:
        plog = storage.open_topic("t", 1)[0]
        assert [(a, b) for a, b, _ in plog.damaged] == [(end, end + 140)]
        assert [m.msg_id for m in _valid_messages(plog)] == list(range(10))


@pytest.mark.parametrize("zero_bodies", [3, 40])  # the hole search, and its header walk
def test_recovery_finds_a_hole_among_messages_full_of_zero_bytes(tmp_path, zero_bodies):
    """Zero-filled bodies hold runs of zero bytes that are not headers: only an all-zero
    header where a message starts is a hole (the messages after it are kept)."""
    with Storage(tmp_path) as storage:
        plog = storage.open_topic("t", 1)[0]
        for i in range(zero_bodies):
            plog.append(encode_message(i + 1, 0, bytes(50)), 1)
        hole = plog.end
        path = plog.dir / seg_files(plog)[-1]
    after = b"".join(rec(100 + i) for i in range(10))
    with open(path, "ab") as f:
        f.write(bytes(40) + after)
    with Storage(tmp_path) as storage:
        plog = storage.open_topic("t", 1)[0]
        assert [(a, b) for a, b, _ in plog.damaged] == [(hole, hole + 40)]
        assert plog.end == hole + 40 + len(after)
        assert [m.msg_id for m in _valid_messages(plog)] == (
            [i + 1 for i in range(zero_bodies)] + [100 + i for i in range(10)])


def test_recovery_of_a_message_bigger_than_the_scan_chunk(tmp_path, monkeypatch):
    import metaq.broker._segment as segmod
    monkeypatch.setattr(segmod, "_SCAN_CHUNK", 1000)
    with Storage(tmp_path) as storage:
        plog = storage.open_topic("t", 1)[0]
        plog.append(rec(0, 100), 1)
        plog.append(rec(1, 5000), 1)
        plog.append(rec(2, 100), 1)
        end = plog.end
    with Storage(tmp_path) as storage:
        plog = storage.open_topic("t", 1)[0]
        assert plog.end == end
        assert [m.msg_id for m in read_all(plog)] == [0, 1, 2]


def test_inconsistent_segments_refused(tmp_path):
    with Storage(tmp_path, max_segment_size=4096) as storage:
        plog = storage.open_topic("t", 1)[0]
        for i in range(60):
            plog.append(rec(i), 1)
        first = plog.dir / seg_files(plog)[0]
    with open(first, "r+b") as f:
        f.truncate(1200)
    with pytest.raises(metaq.StorageError, match="inconsistent.*ends at offset 1200"):
        Storage(tmp_path, max_segment_size=4096).open_topic("t", 1)


def test_stray_files_ignored_and_dir_locked(tmp_path, caplog):
    (tmp_path / "t-0").mkdir()
    (tmp_path / "t-0" / "README").write_text("hi")
    with Storage(tmp_path) as storage:
        plog = storage.open_topic("t", 1)[0]
        assert plog.end == 0
        with pytest.raises(metaq.StorageError, match="in use by another broker"):
            Storage(tmp_path)
    assert "ignoring stray file README" in caplog.text
    Storage(tmp_path).close()  # lock released


def test_retention_deletes_whole_old_segments_never_the_writable_one(tmp_path):
    with Storage(tmp_path, max_segment_size=4096) as storage:
        plog = storage.open_topic("t", 1)[0]
        for i in range(120):
            plog.append(rec(i), 1)
        names = seg_files(plog)
        assert len(names) == 4
        old = time.time() - 10 * 3600
        for n in names:  # all old, even the writable one
            os.utime(plog.dir / n, (old, old))
        os.utime(plog.dir / names[2], None)  # the third is recent: stops the deletion there
        deleted = storage.delete_expired(5 * 3600)
        assert [p.name for p in deleted] == names[:2]
        assert seg_files(plog) == names[2:]
        assert plog.min_offset == int(names[2][:20])
        assert plog.read(0, 100) is None
        os.utime(plog.dir / names[2], (old, old))
        assert [p.name for p in storage.delete_expired(5 * 3600)] == [names[2]]
        assert seg_files(plog) == names[3:]  # the writable one stays
        assert storage.delete_expired(5 * 3600) == []
        assert plog.append(rec(999), 1) == 120 * 120
    with Storage(tmp_path, max_segment_size=4096) as storage:
        plog = storage.open_topic("t", 1)[0]
        assert plog.min_offset == int(names[3][:20]) and plog.end == 121 * 120


def test_retention_keeps_pinned_file_open(tmp_path):
    with Storage(tmp_path, max_segment_size=4096) as storage:
        plog = storage.open_topic("t", 1)[0]
        for i in range(60):
            plog.append(rec(i), 1)
        s = plog.read(0, 1000)
        plog.pin(s)
        old = time.time() - 10 * 3600
        os.utime(s.segment.path, (old, old))
        assert storage.delete_expired(3600) == [s.segment.path]
        # the file is gone from the directory but a pinned read still works
        assert os.pread(s.file.fileno(), s.length, s.position) == rec(0) + rec(1) + rec(2) + \
            rec(3) + rec(4) + rec(5) + rec(6) + rec(7) + rec(8)[:40]
        plog.unpin(s)
        assert s.file.closed


def test_threshold_flush(tmp_path):
    with Storage(tmp_path, unflush_threshold=3) as storage:
        plog = storage.open_topic("t", 1)[0]
        plog.append(rec(0), 1)
        plog.append(rec(1), 1)
        assert plog.unflushed == 2 and plog.durable_end == 0
        plog.append(rec(2), 1)  # reaches the threshold: fsync (synchronous outside a loop)
        assert plog.unflushed == 0 and plog.durable_end == 360
        assert plog.needs_flush(time.monotonic() + 100, 10) is False
        plog.append(rec(3), 1)
        assert plog.needs_flush(time.monotonic() + 100, 10) is True
        assert plog.needs_flush(time.monotonic(), 10) is False


def test_group_commit_batches_fsyncs(tmp_path, monkeypatch):
    import metaq.broker._storage as stmod
    calls = []
    real = stmod._fsync_job

    def counting(sealed, fd, dir_path):
        calls.append(fd)
        real(sealed, fd, dir_path)

    monkeypatch.setattr(stmod, "_fsync_job", counting)

    async def main():
        with Storage(tmp_path, unflush_threshold=0, max_segment_size=4096) as storage:
            plog = storage.open_topic("t", 1)[0]
            futs = []
            for i in range(100):
                plog.append(rec(i), 1)
                futs.append(plog.request_flush())
                assert plog.readable_end <= plog.durable_end
            # the first append started an fsync; all later ones share the next one
            assert len({id(f) for f in futs[1:]}) == 1
            await asyncio.gather(*futs)
            assert plog.durable_end == plog.end == 12000
            assert plog.readable_end == 12000
            assert len(calls) == 2

    asyncio.run(main())


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(st.integers(0, 700), min_size=1, max_size=5), min_size=1, max_size=30),
       st.integers(512, 3000), st.data())
def test_any_appends_survive_reopen_and_any_truncation(tmp_path_factory, batches, seg_size, data):
    path = tmp_path_factory.mktemp("h")
    expected = []
    with Storage(path, max_segment_size=seg_size) as storage:
        plog = storage.open_topic("h", 1)[0]
        n = 0
        for sizes in batches:
            recs = []
            for size in sizes:
                # msgIds from 1: a real one is never 0, and an all-zero header (msgId 0,
                # empty payload) reads as a hole, not a message
                recs.append(encode_message(n + 1, 0, os.urandom(size)))
                n += 1
            start = plog.append(b"".join(recs), len(recs))
            for r in recs:
                expected.append((start, r))
                start += len(r)
        last = plog.dir / seg_files(plog)[-1]
        seg_start = int(last.name[:20])
    # cut the writable segment anywhere: recovery keeps exactly the whole messages before it
    size = os.path.getsize(last)
    cut = data.draw(st.integers(0, size))
    with open(last, "r+b") as f:
        f.truncate(cut)
    keep = [(o, r) for o, r in expected if o + len(r) <= seg_start + cut]
    with Storage(path, max_segment_size=seg_size) as storage:
        plog = storage.open_topic("h", 1)[0]
        got = read_all(plog)
        assert [(m.offset, m.msg_id) for m in got] == [
            (o, i + 1) for i, (o, _r) in enumerate(keep)]
        assert plog.end == (keep[-1][0] + len(keep[-1][1]) if keep else 0)


def test_nearest_valid_offset(tmp_path):
    with Storage(tmp_path, max_segment_size=4096) as storage:
        plog = storage.open_topic("t", 1)[0]
        for i in range(100):
            plog.append(rec(i), 1)
        assert plog.nearest_valid_offset(-5) == 0
        assert plog.nearest_valid_offset(0) == 0
        assert plog.nearest_valid_offset(120) == 120
        assert plog.nearest_valid_offset(121) == 120
        assert plog.nearest_valid_offset(239) == 120
        assert plog.nearest_valid_offset(12000) == 12000
        assert plog.nearest_valid_offset(10 ** 9) == 12000
        second = plog.segments[1]
        assert plog.nearest_valid_offset(second.start + 5) == second.start
        first_path = plog.segments[0].path
    # corrupt message 3 of a sealed segment: it is skipped, resume at message 4
    data = bytearray(first_path.read_bytes())
    data[3 * 120 + 30] ^= 0x55
    first_path.write_bytes(bytes(data))
    with Storage(tmp_path, max_segment_size=4096) as storage:
        plog = storage.open_topic("t", 1)[0]
        assert plog.damaged == []  # sealed segments are not scanned at start
        assert plog.nearest_valid_offset(3 * 120) == 4 * 120
        assert [(a, b) for a, b, _ in plog.damaged] == [(360, 480)]  # recorded when met
        assert plog.nearest_valid_offset(3 * 120 + 50) == 4 * 120
        assert plog.nearest_valid_offset(2 * 120 + 1) == 2 * 120
        assert plog.nearest_valid_offset(10 * 120 + 7) == 10 * 120
    with Storage(tmp_path, max_segment_size=4096) as storage:  # kept across a restart
        assert [(a, b) for a, b, _ in storage.open_topic("t", 1)[0].damaged] == [(360, 480)]


@pytest.mark.parametrize("case", ["recovered", "sealed", "sealed-index"])
def test_a_walk_past_a_damaged_length_marks_no_intact_message(tmp_path, case):
    """A message whose length field is damaged lies between the index entry before an
    offset and the offset: the walk to the message holding the offset steps over the
    damage (known from recovery, or found by this walk) and never reads the damaged
    length as a jump, so the message holding the offset is found and no intact byte
    is recorded as damaged.

    ``recovered``: the writable segment, the damage recorded at start.  ``sealed``: a
    sealed segment (not scanned at start).  ``sealed-index``: a sealed segment longer
    than an index step, where a header walk taking the damaged length at its word
    would put an index entry inside a later message."""
    size, count, seg_max = {"recovered": (100, 50, 1024 ** 3),
                            "sealed": (100, 100, 4096),
                            "sealed-index": (1000, 200, 150_000)}[case]
    step = 20 + size
    bad, ask = {"recovered": (20, 30), "sealed": (3, 10), "sealed-index": (10, 120)}[case]
    with Storage(tmp_path, max_segment_size=seg_max) as storage:
        plog = storage.open_topic("t", 1)[0]
        for i in range(count):
            plog.append(rec(i, size), 1)
        path = plog.segments[0].path
        assert (case == "recovered") == (len(plog.segments) == 1)
    data = bytearray(path.read_bytes())
    if case == "sealed-index":  # the length points into message 100's payload (ASCII digits)
        data[bad * step:bad * step + 4] = (100 * step + 27 - bad * step - 20).to_bytes(4, "big")
    else:  # a length past the end of the segment
        data[bad * step + 1] ^= 0x5A
    path.write_bytes(bytes(data))
    with Storage(tmp_path, max_segment_size=seg_max) as storage:
        plog = storage.open_topic("t", 1)[0]
        damage = [(bad * step, (bad + 1) * step)]
        assert [(a, b) for a, b, _ in plog.damaged] == (damage if case == "recovered" else [])
        assert plog.nearest_valid_offset(ask * step + 7) == ask * step
        assert plog.nearest_valid_offset(ask * step) == ask * step
        assert [(a, b) for a, b, _ in plog.damaged] == damage
        got = [m.msg_id for m in _valid_messages(plog)]
        assert got == [i for i in range(count) if i != bad]
        assert [(a, b) for a, b, _ in plog.damaged] == damage


def test_failed_write_leaves_no_partial_message(tmp_path, monkeypatch):
    import errno

    import metaq.broker._segment as segmod
    with Storage(tmp_path) as storage:
        plog = storage.open_topic("t", 1)[0]
        plog.append(rec(0), 1)
        real = os.pwrite

        def half_then_enospc(fd, data, offset):
            if len(data) > 100:
                real(fd, bytes(data)[:50], offset)  # a torn write reaches the file...
                return 50
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(segmod.os, "pwrite", half_then_enospc)
        with pytest.raises(metaq.StorageError, match="No space left"):
            plog.append(rec(1) + rec(2), 2)
        monkeypatch.setattr(segmod.os, "pwrite", real)
        # ...and is cut away: the log is as before and appends go on
        assert plog.end == 120 and os.path.getsize(plog.segments[-1].path) == 120
        assert plog.append(rec(3), 1) == 120
        assert [m.msg_id for m in read_all(plog)] == [0, 3]
