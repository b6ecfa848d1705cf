"""A slave's storage primitives (issue 26): ``append_copy`` (a master's bytes at the same
offsets), ``truncate`` (cut back to a boundary) and ``reset`` (an empty log at a start),
on real files; the master of the byte-identity test is a real broker written by puts."""

from __future__ import annotations

import asyncio
import os
import struct

import pytest
from helpers.raw_client import RawClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import metaq
from metaq.broker import BrokerConfig, Storage
from metaq.protocol import (
    Value,
    build_payload,
    checksum,
    encode_get,
    encode_message,
    encode_put,
    iter_messages,
)


def rec(i: int, size: int = 100) -> bytes:
    """Message ``i`` (msgId ``i + 1``: a real msgId is never 0) of ``20 + size`` bytes."""
    return encode_message(i + 1, 0, ((b"%08d" % i) * (size // 8 + 1))[:size])


def log_bytes(plog) -> bytes:
    """The whole log from ``min_offset``, read through ``read``."""
    out, off = [], plog.min_offset
    while off < plog.end:
        b = plog.read_bytes(off, 1 << 30)
        assert b, f"nothing readable at {off} before the end {plog.end}"
        out.append(b)
        off += len(b)
    return b"".join(out)


def seg_files(plog) -> list[str]:
    return sorted(n for n in os.listdir(plog.dir) if n.endswith(".meta"))


def master_log(storage: Storage, n: int = 120, seed: int = 0) -> bytes:
    """Write ``n`` messages into partition 0 of ``t`` in groups of varied sizes."""
    plog = storage.open_topic("t", 1)[0]
    i = 0
    while i < n:
        k = 1 + (i + seed) % 5
        recs = [rec(j, (j * 37 + seed) % 300) for j in range(i, min(i + k, n))]
        plog.append(b"".join(recs), len(recs))
        i += len(recs)
    return log_bytes(plog)


def copy_all(slave, data: bytes, start: int, chunk: int = 777) -> None:
    pos = 0
    while pos < len(data):
        n, _k = slave.append_copy(data[pos:pos + chunk], start + pos)
        pos += n if n else 0
        if not n:
            chunk *= 2


# --------------------------------------------------------------------------- byte identity

def test_copy_of_a_real_brokers_log_is_byte_identical(tmp_path, tmp_path_factory,
                                                        broker_factory):
    """Puts in pipelined groups of 1..17 (bodies 0..1500 bytes, some with attributes) into
    a broker with small segments; its log read back with gets, then copied in any chunking
    into logs whose segments roll elsewhere: the same bytes at the same offsets, and a
    restart of the copy recovers the same end."""
    cfg = BrokerConfig(broker_id=1, data_dir=tmp_path / "master", port=0, topics={"t": 1},
                       max_segment_size=4096)
    master = broker_factory(config=cfg)
    c = RawClient(master.port)
    sent = 0
    for g, size in enumerate([1, 3, 17, 2, 9, 1, 5, 12, 4, 7] * 3):
        reqs = []
        for k in range(size):
            body = bytes([65 + (g + k) % 26]) * ((g * 131 + k * 17) % 1500)
            payload, flag = build_payload(body, "a=1" if (g + k) % 4 == 0 else None)
            reqs.append(encode_put("t", 0, payload, flag, checksum(payload), sent + k))
        c.sock.sendall(b"".join(reqs))
        assert [r.code for r in c.replies(size)] == [200] * size
        sent += size
    start, end = master.offsets("t", 0)
    assert start == 0 and len(os.listdir(cfg.data_dir / "t-0")) > 3  # segments rolled
    chunks, off = [], 0
    while off < end:
        c.sock.sendall(encode_get("t", "slave", 0, off, 1 << 20, 1))
        v = c.replies(1)[0]
        assert isinstance(v, Value)
        chunks.append(v.body)
        off += len(v.body)
    c.close()
    data = b"".join(chunks)
    offsets = [m.offset for m in iter_messages(data, 0)]
    assert len(offsets) == sent and data and off == end

    @settings(max_examples=30, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(st.integers(1, 9000), min_size=1, max_size=40),
           st.sampled_from([4096, 5000, 9999, 1 << 20]))
    def copy(sizes, seg_size):
        path = tmp_path_factory.mktemp("slave")
        with Storage(path, max_segment_size=seg_size) as storage:
            slave = storage.open_topic("t", 1)[0]
            pos = i = 0
            while pos < len(data):
                n = sizes[i % len(sizes)]
                i += 1
                chunk = data[pos:pos + n]
                got, k = slave.append_copy(chunk, pos)
                whole = [m for m in iter_messages(chunk, pos)]
                assert (got, k) == (whole[-1].next_offset - pos if whole else 0, len(whole))
                if not got:  # a message bigger than the chunk: ask for more, as a follower does
                    sizes[(i - 1) % len(sizes)] = n * 2
                pos += got
            assert slave.end == end and slave.min_offset == 0
            assert log_bytes(slave) == data
            assert [m.offset for m in iter_messages(log_bytes(slave), 0)] == offsets
            files = seg_files(slave)
            assert b"".join((slave.dir / f).read_bytes() for f in files) == data
            for f in files[:-1]:  # rolled where this log's size says, each whole messages
                b = (slave.dir / f).read_bytes()
                msgs = list(iter_messages(b, 0))
                assert msgs[-1].next_offset == len(b)
                assert len(b) <= seg_size or len(msgs) == 1
        with Storage(path, max_segment_size=seg_size) as storage:
            slave = storage.open_topic("t", 1)[0]
            assert (slave.min_offset, slave.end) == (0, end)
            assert log_bytes(slave) == data

    copy()


# --------------------------------------------------------------------------- refusals

def test_copy_from_another_offset_is_refused_and_writes_nothing(tmp_path):
    with Storage(tmp_path / "m") as m, Storage(tmp_path / "s") as s:
        data = master_log(m, 10)
        cut = [x.offset for x in iter_messages(data, 0)][3]
        slave = s.open_topic("t", 1)[0]
        slave.append_copy(data[:cut], 0)
        for at in (0, cut - 1, cut + 1, 10_000):
            with pytest.raises(metaq.ReplicaDivergedError) as e:
                slave.append_copy(data[cut:], at)
            msg = str(e.value)
            assert "t-0" in msg and f"offset {at}," in msg and f"ends at offset {cut}" in msg
            assert (e.value.topic, e.value.partition, e.value.offset) == ("t", 0, at)
            assert isinstance(e.value, metaq.StorageError)
        assert slave.end == cut and os.path.getsize(slave.dir / seg_files(slave)[0]) == cut
        assert "ReplicaDivergedError" in metaq.__all__


def _corrupt(data: bytes, offsets: list[int], which: int, how: str) -> bytes:
    b = bytearray(data)
    at = offsets[which]
    if how == "checksum":
        b[at + 4] ^= 0x10
    elif how == "payload":
        b[at + 25] ^= 0x01
    elif how == "negative length":
        b[at:at + 4] = struct.pack(">i", -5)
    elif how == "huge length":
        b[at:at + 4] = struct.pack(">i", 2**31 - 1)
    elif how == "zero header":
        b[at:at + 20] = bytes(20)
    return bytes(b)


@pytest.mark.parametrize("how,problem", [
    ("checksum", "checksum mismatch"), ("payload", "checksum mismatch"),
    ("negative length", "impossible message length -5"),
    ("huge length", "impossible message length 2147483647"),
    ("zero header", "all-zero message header")])
@pytest.mark.parametrize("which", [0, 3])
def test_a_bad_message_is_refused_and_nothing_of_the_call_written(tmp_path, how, problem,
                                                                  which):
    with Storage(tmp_path / "m") as m, Storage(tmp_path / "s", max_segment_size=4096) as s:
        data = master_log(m, 20)
        offsets = [x.offset for x in iter_messages(data, 0)]
        slave = s.open_topic("t", 1)[0]
        slave.append_copy(data[:offsets[5]], 0)
        tail = data[offsets[5]:]
        bad = _corrupt(tail, [o - offsets[5] for o in offsets[5:]], which, how)
        files = {f: os.path.getsize(slave.dir / f) for f in seg_files(slave)}
        with pytest.raises(metaq.ReplicaDivergedError) as e:
            slave.append_copy(bad, offsets[5])
        where = offsets[5 + which]
        msg = str(e.value)
        assert "t-0" in msg and f"bad message at offset {where}" in msg and problem in msg
        assert "nothing" in msg and e.value.offset == where
        # nothing of the call, not even the good messages before the bad one
        assert slave.end == offsets[5]
        assert {f: os.path.getsize(slave.dir / f) for f in seg_files(slave)} == files
        # the good prefix can be copied (what the error's offset says), then the rest
        if which:
            assert slave.append_copy(bad[:where - offsets[5]], offsets[5])[1] == which
        copy_all(slave, data[slave.end:], slave.end)
        assert log_bytes(slave) == data


def test_a_trailing_partial_message_is_left_for_the_next_copy(tmp_path):
    with Storage(tmp_path / "m") as m, Storage(tmp_path / "s") as s:
        data = master_log(m, 6)
        offsets = [x.offset for x in iter_messages(data, 0)] + [len(data)]
        slave = s.open_topic("t", 1)[0]
        assert slave.append_copy(data[:offsets[1] - 1], 0) == (0, 0)
        assert slave.append_copy(b"", 0) == (0, 0) and slave.end == 0
        assert slave.append_copy(data[:offsets[3] + 7], 0) == (offsets[3], 3)
        assert slave.append_copy(data[offsets[3]:], offsets[3]) == (len(data) - offsets[3], 3)
        assert log_bytes(slave) == data


def test_copy_honours_the_flush_threshold_and_wakes_readers(tmp_path):
    with Storage(tmp_path / "m") as m, Storage(tmp_path / "s", unflush_threshold=10) as s:
        data = master_log(m, 30)
        offsets = [x.offset for x in iter_messages(data, 0)]
        slave = s.open_topic("t", 1)[0]
        woken = []
        slave.on_readable = woken.append
        slave.append_copy(data[:offsets[4]], 0)  # 4 messages: under the threshold
        assert slave.unflushed == 4 and slave.durable_end == 0 and woken == [slave]
        slave.append_copy(data[offsets[4]:offsets[12]], offsets[4])  # 12: fsynced (no loop)
        assert slave.unflushed == 0 and slave.durable_end == offsets[12]
        assert slave.messages_appended == 12 and len(woken) == 2


def test_copy_on_a_closed_partition_is_refused(tmp_path):
    with Storage(tmp_path / "m") as m, Storage(tmp_path / "s") as s:
        data = master_log(m, 3)
        slave = s.open_topic("t", 1)[0]
        slave.closed = True
        with pytest.raises(metaq.StorageError,
                           match="partition t-0 is closed: the copy of the bytes served "
                                 "from offset 0 is refused"):
            slave.append_copy(data, 0)
        assert slave.end == 0


# --------------------------------------------------------------------------- truncate

def _expected_cut(data: bytes, offset: int) -> tuple[int, int]:
    return len(data) - offset, sum(1 for x in iter_messages(data, 0) if x.offset >= offset)


@pytest.mark.parametrize("where", ["mid-writable", "mid-sealed", "segment start", "min",
                                   "end"])
def test_truncate_cuts_back_to_a_boundary_and_survives_a_restart(tmp_path, where):
    with Storage(tmp_path / "m") as m:
        data = master_log(m, 150)
    offsets = [x.offset for x in iter_messages(data, 0)]
    with Storage(tmp_path / "s", max_segment_size=4096) as s:
        slave = s.open_topic("t", 1)[0]
        copy_all(slave, data, 0)
        starts = [int(f[:20]) for f in seg_files(slave)]
        assert len(starts) >= 4
        cut = {"mid-writable": next(o for o in offsets if o > starts[-1]),
               "mid-sealed": next(o for o in offsets if o > starts[1]),
               "segment start": starts[2], "min": 0, "end": len(data)}[where]
        t_before = slave.offset_for_time(0)
        assert slave.truncate(cut) == _expected_cut(data, cut)
        assert slave.end == slave.durable_end == cut and log_bytes(slave) == data[:cut]
        assert all(int(f[:20]) < cut or int(f[:20]) == 0 for f in seg_files(slave))
        assert not [f for f in os.listdir(slave.dir)
                    if f.endswith(".timeindex") and f[:25] == seg_files(slave)[-1]]
        # the indexes lost what lay past the cut: boundaries and times still answer
        if cut:
            assert slave.nearest_valid_offset(cut - 1) == max(o for o in offsets if o < cut)
            assert slave.offset_for_time(0) == t_before
        assert slave.nearest_valid_offset(cut + 5) == cut
        assert slave.offset_for_time(2**62)[0] == cut
        # and copying goes on at the cut: the master's bytes again
        copy_all(slave, data[cut:], cut)
        assert log_bytes(slave) == data
        slave.truncate(cut)
    with Storage(tmp_path / "s", max_segment_size=4096) as s:
        slave = s.open_topic("t", 1)[0]
        assert (slave.min_offset, slave.end) == (0, cut) and log_bytes(slave) == data[:cut]


def test_truncate_refuses_an_offset_that_is_not_a_boundary_of_the_log(tmp_path):
    with Storage(tmp_path / "m") as m:
        data = master_log(m, 60)
    offsets = [x.offset for x in iter_messages(data, 0)]
    with Storage(tmp_path / "s", max_segment_size=4096) as s:
        slave = s.open_topic("t", 1)[0]
        copy_all(slave, data, 0)
        for bad in (1, offsets[7] + 20, len(data) - 1):
            with pytest.raises(metaq.StorageError) as e:
                slave.truncate(bad)
            assert "t-0" in str(e.value) and f"offset {bad}" in str(e.value)
            assert "not a message boundary" in str(e.value)
        for bad in (-1, len(data) + 1):
            with pytest.raises(metaq.StorageError, match=rf"t-0 to offset {bad}: outside"):
                slave.truncate(bad)
        assert slave.end == len(data) and log_bytes(slave) == data


def test_truncate_keeps_pinned_readers_reading_what_they_pinned(tmp_path):
    with Storage(tmp_path / "m") as m:
        data = master_log(m, 150)
    offsets = [x.offset for x in iter_messages(data, 0)]
    with Storage(tmp_path / "s", max_segment_size=4096) as s:
        slave = s.open_topic("t", 1)[0]
        copy_all(slave, data, 0)
        starts = [int(f[:20]) for f in seg_files(slave)]
        cut = next(o for o in offsets if o > starts[1] + 100)
        pinned = [slave.read(starts[1], 1 << 20), slave.read(starts[-1], 1 << 20)]
        for p in pinned:
            slave.pin(p)
        assert slave.truncate(cut)[0] == len(data) - cut
        for p in pinned:  # the bytes they pinned, through their own file (sendfile's)
            got = os.pread(p.file.fileno(), p.length, p.position)
            assert got == data[p.segment.start + p.position:][:p.length]
            slave.unpin(p)
            assert p.file.closed
        assert log_bytes(slave) == data[:cut]
        copy_all(slave, data[cut:], cut)
        assert log_bytes(slave) == data


def test_truncate_drops_the_damaged_ranges_past_the_cut(tmp_path):
    with Storage(tmp_path / "m") as m:
        data = master_log(m, 40)
    offsets = [x.offset for x in iter_messages(data, 0)]
    with Storage(tmp_path / "s") as s:
        copy_all(s.open_topic("t", 1)[0], data, 0)
    path = tmp_path / "s" / "t-0" / "00000000000000000000.meta"
    raw = bytearray(path.read_bytes())
    raw[offsets[30] + 22] ^= 0xFF  # a bad payload: recovery keeps it as a damaged range
    path.write_bytes(bytes(raw))
    with Storage(tmp_path / "s") as s:
        slave = s.open_topic("t", 1)[0]
        assert slave.damaged and slave.damaged[0][0] == offsets[30]
        assert path.with_name(path.name + ".damaged").exists()
        with pytest.raises(metaq.StorageError, match=f"t-0 to offset {offsets[30] + 3}:"):
            slave.truncate(offsets[30] + 3)
        assert slave.truncate(offsets[30]) == (len(data) - offsets[30], 9)  # 9 intact after
        assert slave.damaged == [] and not path.with_name(path.name + ".damaged").exists()
        copy_all(slave, data[offsets[30]:], offsets[30])
        assert log_bytes(slave) == data
    with Storage(tmp_path / "s") as s:
        assert s.open_topic("t", 1)[0].damaged == []


def test_truncate_waits_for_the_fsync_in_flight(tmp_path):
    """Group commit: puts waiting on an fsync are answered, the cut is durable, and the
    fsync's late completion does not move ``durable_end`` past the cut."""
    with Storage(tmp_path / "m") as m:
        data = master_log(m, 30)
    offsets = [x.offset for x in iter_messages(data, 0)]

    async def main():
        with Storage(tmp_path / "s", unflush_threshold=0) as s:
            slave = s.open_topic("t", 1)[0]
            slave.append_copy(data, 0)
            first = slave.request_flush()
            slave.append_copy(b"", len(data))
            second = slave.request_flush()  # waits behind the first
            assert slave.truncate(offsets[10]) == _expected_cut(data, offsets[10])
            assert first.done() and second.done() and second.result() == len(data)
            assert slave.durable_end == slave.end == offsets[10]
            for _ in range(5):
                await asyncio.sleep(0)  # the late callback of the first fsync
            assert slave.durable_end == offsets[10]
            assert slave.readable_end == offsets[10]

    asyncio.run(main())


# --------------------------------------------------------------------------- reset

def test_reset_starts_an_empty_log_at_a_start_that_survives_a_restart(tmp_path):
    with Storage(tmp_path / "m") as m:
        data = master_log(m, 100)
    offsets = [x.offset for x in iter_messages(data, 0)]
    base = offsets[40]  # the master's log starts here after retention
    with Storage(tmp_path / "s", max_segment_size=4096) as s:
        slave = s.open_topic("t", 1)[0]
        copy_all(slave, data[:offsets[20]], 0)
        pinned = slave.read(0, 100)
        slave.pin(pinned)
        slave.reset(base)
        assert (slave.min_offset, slave.end, slave.durable_end) == (base, base, base)
        assert os.listdir(slave.dir) == [f"{base:020d}.meta"]
        assert slave.read(base, 100) is None and slave.nearest_valid_offset(0) == base
        assert os.pread(pinned.file.fileno(), 100, 0) == data[:100]  # still readable
        slave.unpin(pinned)
        assert pinned.file.closed
        with pytest.raises(metaq.ReplicaDivergedError, match="t-0: bytes served from offset 0"):
            slave.append_copy(data, 0)
        with pytest.raises(metaq.StorageError, match="cannot reset t-0 to offset -1"):
            slave.reset(-1)
    with Storage(tmp_path / "s", max_segment_size=4096) as s:  # empty, at its start
        slave = s.open_topic("t", 1)[0]
        assert (slave.min_offset, slave.end) == (base, base)
        copy_all(slave, data[base:], base)
        assert log_bytes(slave) == data[base:]
        assert seg_files(slave)[0] == f"{base:020d}.meta"
    with Storage(tmp_path / "s", max_segment_size=4096) as s:
        slave = s.open_topic("t", 1)[0]
        assert (slave.min_offset, slave.end) == (base, len(data))
        assert [x.offset for x in iter_messages(log_bytes(slave), base)] == offsets[40:]


def test_truncate_into_a_sealed_segment_without_its_time_index(tmp_path):
    """A sealed segment whose time index file is gone (rebuilt on demand) becomes the
    writable one: both its indexes are rebuilt by a checked scan of what is kept."""
    with Storage(tmp_path / "m") as m:
        data = master_log(m, 150)
    offsets = [x.offset for x in iter_messages(data, 0)]
    with Storage(tmp_path / "s", max_segment_size=4096) as s:
        copy_all(s.open_topic("t", 1)[0], data, 0)
    for f in (tmp_path / "s" / "t-0").glob("*.timeindex"):
        f.unlink()
    with Storage(tmp_path / "s", max_segment_size=4096) as s:
        slave = s.open_topic("t", 1)[0]
        starts = [int(f[:20]) for f in seg_files(slave)]
        cut = next(o for o in offsets if o > starts[1] + 1000)
        assert slave.truncate(cut) == _expected_cut(data, cut)
        assert slave.offset_for_time(0)[0] == 0 and slave.offset_for_time(2**62)[0] == cut
        assert slave.nearest_valid_offset(cut - 1) == max(o for o in offsets if o < cut)
        copy_all(slave, data[cut:], cut)
        assert log_bytes(slave) == data
