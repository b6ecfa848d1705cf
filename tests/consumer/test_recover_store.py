"""The on-disk recover store: durable, idempotent, never drops a message."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metaq import ConfigError
from metaq.consumer._recover import RecoveredMessage, RecoverStore


def _put(store, offset=0, payload=b"body", topic="t", partition="0-0"):
    store.put(topic=topic, partition=partition, offset=offset, next_offset=offset + 20 +
              len(payload), msg_id=offset + 1, flag=0, payload=payload, error=ValueError("x"))


def test_put_survives_a_new_instance_and_is_idempotent(tmp_path):
    s = RecoverStore(tmp_path, "g", interval=60)
    _put(s, 0, b"a")
    _put(s, 0, b"a")
    _put(s, 100, b"b", partition="1-3")
    again = RecoverStore(tmp_path, "g", interval=60)
    recs = sorted(again.records(), key=lambda r: r.offset)
    assert [(r.partition, r.offset, r.payload) for r in recs] == [("0-0", 0, b"a"),
                                                                  ("1-3", 100, b"b")]
    assert len(again) == 2 and "ValueError" in recs[0].error


def test_redelivery_success_removes_failure_backs_off_and_keeps(tmp_path):
    s = RecoverStore(tmp_path, "g", interval=10)
    _put(s, 0, b"ok")
    _put(s, 50, b"fails")
    got = []

    def deliver(rec):
        if rec.payload == b"fails":
            raise RuntimeError("still broken")
        got.append(rec.payload)

    now = max(r.next_due for r in s.records())
    assert s.redeliver_due(deliver, now=now - 100) == 0  # nothing due yet
    assert s.redeliver_due(deliver, now=now) == 1
    assert got == [b"ok"]
    (left,) = s.records()
    assert left.payload == b"fails" and left.attempts == 1 and left.next_due >= now + 20
    assert "still broken" in left.error


def test_damaged_record_is_moved_aside_not_dropped(tmp_path):
    s = RecoverStore(tmp_path, "g", interval=60)
    _put(s, 0)
    bad = tmp_path / "g" / "t" / "0-7.rec"
    bad.write_bytes(b"\xc1garbage")
    recs = s.records()
    assert [r.offset for r in recs] == [0]
    assert (tmp_path / "g" / "t" / "0-7.bad").read_bytes() == b"\xc1garbage"


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_in_a_record_file_never_crash_the_reader(tmp_path_factory, data):
    d = tmp_path_factory.mktemp("rs")
    s = RecoverStore(d, "g", interval=60)
    (d / "g" / "t").mkdir(parents=True)
    (d / "g" / "t" / "0-0.rec").write_bytes(data)
    for r in s.records():
        assert isinstance(r, RecoveredMessage)


def test_bad_interval_is_named(tmp_path):
    with pytest.raises(ConfigError, match="interval"):
        RecoverStore(tmp_path, "g", interval=0)
