"""Java's ``sync`` (Samsa master to Gregor slave, ``GregorCommandProcessor``) against real
brokers over real sockets: stored with the master's msgId at the partition's end and
answered as a put is, only by a broker that accepts syncs (a slave)."""

from __future__ import annotations

import os

import pytest
from helpers.raw_client import RawClient

from metaq.broker import Broker, BrokerConfig
from metaq.protocol import (
    Result,
    build_payload,
    checksum,
    encode_put,
    encode_sync,
    iter_messages,
    parse_put_result,
)

pytestmark = pytest.mark.broker


def slave_broker(broker_factory, tmp_path, *, accepts_sync: bool = True, **kw) -> Broker:
    cfg = BrokerConfig(broker_id=5, data_dir=tmp_path / "slave", port=0,
                       topics=kw.pop("topics", {"t": 2}), **kw)
    b = broker_factory(config=cfg)
    b._call(lambda: setattr(b._server, "accepts_sync", accepts_sync))  # as the slave sets it
    return b


MSG_ID = 6340863216562294785


@pytest.mark.parametrize("group_commit", [False, True])
def test_a_slave_stores_syncs_with_the_masters_msgids_and_answers_as_gregor(
        tmp_path, broker_factory, group_commit):
    slave = slave_broker(broker_factory, tmp_path,
                         unflush_threshold=0 if group_commit else 1000)
    c = RawClient(slave.port)
    payloads = [build_payload(b"body %d" % i * i, "k=v" if i % 2 else None) for i in range(6)]
    reqs = []
    for i, (payload, flag) in enumerate(payloads):
        if i == 4:  # the 7-field form of masters before 1.4.4: no checksum
            reqs.append(b"sync t 1 %d %d %d %d\r\n%b" % (len(payload), flag, MSG_ID + i, 10 + i,
                                                       payload))
        else:
            reqs.append(encode_sync("t", 1, payload, flag, MSG_ID + i,
                                    -1 if i == 3 else checksum(payload), 10 + i))
    c.sock.sendall(b"".join(reqs))
    got = c.replies(len(reqs))
    offsets = []
    off = 0
    for i, (r, (payload, _flag)) in enumerate(zip(got, payloads, strict=True)):
        assert isinstance(r, Result) and (r.code, r.opaque) == (200, 10 + i), r
        # Java's genPutResultString: "<msgId> <partition> <offset>", the master's msgId
        assert parse_put_result(r.body) == (MSG_ID + i, 1, off)
        offsets.append(off)
        off += 20 + len(payload)
    # readable at once (with group commit only once fsynced: the reply waited for it)
    msgs = list(iter_messages(c.log("t", 1), 0))
    assert [(m.offset, m.msg_id, m.flag, m.payload) for m in msgs] == [
        (o, MSG_ID + i, f, p) for i, (o, (p, f)) in enumerate(zip(offsets, payloads,
                                                                   strict=True))]
    assert slave.offsets("t", 1) == (0, off) and slave.offsets("t", 0) == (0, 0)
    # a put to a slave still gets the slave's own msgId, after the syncs
    r = c.call(encode_put("t", 1, b"x", 0, checksum(b"x"), 99))
    assert r.code == 200 and parse_put_result(r.body)[2] == off
    c.close()


def test_a_bad_checksum_is_refused_and_nothing_written(tmp_path, broker_factory):
    slave = slave_broker(broker_factory, tmp_path)
    c = RawClient(slave.port)
    r = c.call(encode_sync("t", 0, b"payload", 0, MSG_ID, checksum(b"payload") ^ 1, 3))
    assert r == Result(400, b"checksum mismatch", 3)
    assert slave.offsets("t", 0) == (0, 0)
    r = c.call(encode_sync("t", 0, b"payload", 0, MSG_ID, checksum(b"payload"), 4))
    assert r.code == 200 and parse_put_result(r.body) == (MSG_ID, 0, 0)
    c.close()


def test_sync_to_a_closed_or_missing_partition(tmp_path, broker_factory):
    slave = slave_broker(broker_factory, tmp_path)
    slave.set_partition_closed("t", 0)
    c = RawClient(slave.port)
    r = c.call(encode_sync("t", 0, b"p", 0, MSG_ID, checksum(b"p"), 5))
    assert (r.code, r.opaque) == (403, 5) and b"t-0 is closed" in r.body
    r = c.call(encode_sync("t", 7, b"p", 0, MSG_ID, checksum(b"p"), 6))
    assert (r.code, r.opaque) == (404, 6) and b"topic t partition 7 not found" in r.body
    r = c.call(encode_sync("t", -1, b"p", 0, MSG_ID, checksum(b"p"), 7))
    assert (r.code, r.opaque) == (400, 7) and b"bad partition -1" in r.body
    assert slave.offsets("t", 0) == (0, 0)
    c.close()


def test_a_broker_that_is_not_a_slave_refuses_sync(tmp_path, broker_factory):
    b = slave_broker(broker_factory, tmp_path, accepts_sync=False)
    c = RawClient(b.port)
    r = c.call(encode_sync("t", 0, b"p", 0, MSG_ID, checksum(b"p"), 8))
    assert r == Result(403, b"broker 5 is not a slave; sync is only accepted by a slave", 8)
    assert c.call(encode_put("t", 0, b"p", 0, checksum(b"p"), 9)).code == 200  # goes on
    assert b.offsets("t", 0) == (0, 21)
    c.close()


def test_syncs_of_a_masters_messages_make_a_byte_identical_log(tmp_path, broker_factory):
    """What a Samsa master does: each put it stores sent on to the slave as a sync with
    its msgId, flag, payload and checksum; the slave's log is the master's, byte for byte,
    segments rolling in both."""
    master = broker_factory(config=BrokerConfig(
        broker_id=4, data_dir=tmp_path / "master", port=0, topics={"t": 1},
        max_segment_size=4096))
    slave = slave_broker(broker_factory, tmp_path, topics={"t": 1}, max_segment_size=4096)
    m, s = RawClient(master.port), RawClient(slave.port)
    for i in range(60):
        body = os.urandom((i * 97) % 700)
        payload, flag = build_payload(body, "a" if i % 3 == 0 else None)
        assert m.call(encode_put("t", 0, payload, flag, checksum(payload), i)).code == 200
    data = m.log("t", 0)
    syncs = [encode_sync("t", 0, x.payload, x.flag, x.msg_id, checksum(x.payload), k)
             for k, x in enumerate(iter_messages(data, 0))]
    s.sock.sendall(b"".join(syncs))
    assert [r.code for r in s.replies(len(syncs))] == [200] * len(syncs)
    assert s.log("t", 0) == data and slave.offsets("t", 0) == master.offsets("t", 0)
    assert len(list((tmp_path / "slave" / "t-0").glob("*.meta"))) > 1
    m.close()
    s.close()
