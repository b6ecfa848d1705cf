"""Message codec (reference section 5): bytes both ways, iteration, msgIds."""

from __future__ import annotations

import struct
import threading
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

import metaq
from metaq.protocol import (
    HEADER,
    HEADER_SIZE,
    MSG_ID_EPOCH_MS,
    MsgIdGenerator,
    RawMessage,
    build_payload,
    checksum,
    encode_message,
    iter_messages,
    msg_id_parts,
    scan_messages,
    split_payload,
)

attributes = st.one_of(st.none(), st.text(max_size=50))
bodies = st.binary(max_size=300)


def test_header_layout_is_metaq():
    assert HEADER.format == ">iiqi" and HEADER_SIZE == 20
    rec = encode_message(0x0102030405060708, 1, b"\x00\x00\x00\x01ab")
    length, check, msg_id, flag = struct.unpack(">iiqi", rec[:20])
    assert length == 6 and msg_id == 0x0102030405060708 and flag == 1
    assert check == zlib.crc32(b"\x00\x00\x00\x01ab") & 0x7FFFFFFF


def test_checksum_masks_sign_bit():
    # crc32(b"a") = 0xe8b7be43 has the top bit set
    assert zlib.crc32(b"a") > 0x7FFFFFFF
    assert checksum(b"a") == 0xe8b7be43 & 0x7FFFFFFF


def test_payload_with_attribute_bytes():
    payload, flag = build_payload(b"body", "ké")
    assert flag == 1
    assert payload == b"\x00\x00\x00\x03k\xc3\xa9body"
    assert split_payload(payload, flag) == ("ké", b"body")
    assert build_payload(b"body", None) == (b"body", 0)
    assert split_payload(b"body", 0) == (None, b"body")
    assert split_payload(b"\x00\x00\x00\x00", 1) == ("", b"")


@given(bodies, attributes)
def test_payload_round_trip(body, attribute):
    payload, flag = build_payload(body, attribute)
    assert split_payload(payload, flag) == (attribute, body)


@pytest.mark.parametrize("payload, what", [
    (b"\x00\x00", "only 2 bytes"),
    (b"\x00\x00\x00\x09abc", "bad attribute length 9"),
    (b"\xff\xff\xff\xffabc", "bad attribute length -1"),
    (b"\x00\x00\x00\x02\xff\xfeabc", "not valid UTF-8"),
])
def test_split_payload_rejects_bad_attribute(payload, what):
    with pytest.raises(metaq.MessageError, match=what):
        split_payload(payload, 1)


@given(st.lists(st.tuples(st.integers(0, 2**63 - 1), bodies, attributes), max_size=20),
       st.integers(0, 2**40), st.data())
def test_iter_messages_round_trip_and_truncation(msgs, start, data):
    recs = []
    for msg_id, body, attr in msgs:
        payload, flag = build_payload(body, attr)
        recs.append(encode_message(msg_id, flag, payload))
    buf = b"".join(recs)
    got = list(iter_messages(buf, start))
    assert len(got) == len(msgs)
    off = start
    for raw, (msg_id, body, attr) in zip(got, msgs, strict=True):
        assert isinstance(raw, RawMessage)
        assert raw.offset == off and raw.msg_id == msg_id
        assert split_payload(raw.payload, raw.flag) == (attr, body)
        off = raw.next_offset
    assert off == start + len(buf)
    assert scan_messages(buf) == (len(buf), len(msgs), None)
    # any truncation yields exactly the complete prefix, silently
    cut = data.draw(st.integers(0, len(buf)))
    bounds = [0]
    for r in recs:
        bounds.append(bounds[-1] + len(r))
    complete = sum(1 for b in bounds[1:] if b <= cut)
    assert len(list(iter_messages(memoryview(buf)[:cut], start))) == complete
    assert scan_messages(buf[:cut]) == (bounds[complete], complete, None)


def test_iter_messages_checksum_error_names_offset():
    good = encode_message(1, 0, b"hello")
    bad = bytearray(encode_message(2, 0, b"world"))
    bad[-1] ^= 0x01
    buf = good + bytes(bad)
    it = iter_messages(buf, 1000)
    assert next(it).msg_id == 1
    with pytest.raises(metaq.ChecksumError, match=f"offset {1000 + len(good)}"):
        next(it)
    # not verified: passes through
    assert [m.msg_id for m in iter_messages(buf, 0, verify=False)] == [1, 2]
    valid, count, problem = scan_messages(buf)
    assert (valid, count) == (len(good), 1) and "checksum mismatch" in problem


@pytest.mark.parametrize("length", [-1, -(2**31), 65])
def test_iter_messages_impossible_length(length):
    buf = encode_message(1, 0, b"x") + HEADER.pack(length, 0, 2, 0) + b"y" * 100
    what = f"impossible message length {length} at offset 21"
    with pytest.raises(metaq.MessageError, match=what):
        list(iter_messages(buf, 0, max_payload=64))
    assert scan_messages(buf, max_payload=64)[:2] == (21, 1)


@pytest.mark.parametrize("walk", ["bound", "python"])
def test_iter_messages_and_scan_messages_word_problems_exactly(walk, monkeypatch):
    """Both are the bound ``scan`` with errors worded for people: the same words on C
    and on its Python twin."""
    import metaq.protocol._message as message_module
    from metaq.protocol import _fast

    if walk == "python":
        monkeypatch.setattr(message_module, "scan", _fast.py_scan)
    good = encode_message(1, 0, b"hello")
    bad = bytearray(encode_message(2, 0, b"world"))
    bad[-1] ^= 0x01
    stored, actual = checksum(b"world"), zlib.crc32(bytes(bad[HEADER_SIZE:])) & 0x7FFFFFFF
    with pytest.raises(metaq.ChecksumError) as e:
        list(iter_messages(good + bad, 1000))
    assert str(e.value) == (f"checksum mismatch at offset {1000 + len(good)}: header says "
                            f"{stored}, payload of 5 bytes has {actual}")
    assert scan_messages(good + bad) == (
        len(good), 1, f"checksum mismatch (header {stored}, payload {actual})")
    cut = good + HEADER.pack(-1, 0, 2, 0)
    with pytest.raises(metaq.MessageError) as e:
        list(iter_messages(cut, 7, max_payload=64))
    assert str(e.value) == "impossible message length -1 at offset 32 (limit 64)"
    assert scan_messages(cut) == (len(good), 1, "impossible message length -1")


def test_msg_id_layout():
    gen = MsgIdGenerator(1023)
    mid = gen.next_id()
    ms, broker, seq = msg_id_parts(mid)
    assert broker == 1023 and 0 <= seq < 4096
    assert mid == ((ms - MSG_ID_EPOCH_MS) << 22) | (1023 << 12) | seq
    import time
    assert abs(ms - time.time() * 1000) < 60_000


@pytest.mark.parametrize("bad", [-1, 1024, "1", 1.0, True, None])
def test_msg_id_broker_id_validated(bad):
    with pytest.raises(metaq.ConfigError, match="broker_id"):
        MsgIdGenerator(bad)


def test_msg_ids_unique_and_increasing_past_4096_per_ms():
    gen = MsgIdGenerator(5)
    ids = gen.next_ids(20_000) + [gen.next_id() for _ in range(5000)]
    assert all(a < b for a, b in zip(ids, ids[1:], strict=False))
    assert {msg_id_parts(i)[1] for i in ids} == {5}
    # more than 4096 ids were made in fewer ms than ids/4096 would allow without borrowing
    assert max(msg_id_parts(i)[2] for i in ids) == 4095


def test_msg_ids_thread_safe():
    gen = MsgIdGenerator(7)
    results: list[list[int]] = [[] for _ in range(4)]

    def work(out):
        for _ in range(3000):
            out.append(gen.next_id())

    threads = [threading.Thread(target=work, args=(r,), name=f"idgen-{i}")
               for i, r in enumerate(results)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    all_ids = [i for r in results for i in r]
    assert len(set(all_ids)) == len(all_ids) == 12000
    for r in results:
        assert all(a < b for a, b in zip(r, r[1:], strict=False))
