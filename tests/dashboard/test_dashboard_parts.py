"""The dashboard's parts on their own: the watched tree (one ZooKeeper read per changed
node, a view answering as a kazoo client would, no write even for a missing root), the
body codecs, and the pages' escaping and chart."""

from __future__ import annotations

import json

import msgpack
import pytest
from kazoo.exceptions import NoNodeError

from metaq.testing import wait_until
from zk_layout import Layout, take_snapshot

pytest.importorskip("aiohttp", reason="the dashboard extra (aiohttp) is not installed")

from metaq.dashboard import ZkTreeCache, decode_body  # noqa: E402
from metaq.dashboard import _pages as pages  # noqa: E402

L = Layout()


def test_the_cache_reads_each_changed_node_once_and_answers_like_a_client(zk_client):
    for i in range(20):
        zk_client.create(f"/meta/consumers/g/offsets/t/0-{i}", b"0", makepath=True)
    cache = ZkTreeCache(zk_client, "/meta")
    cache.start(timeout=30)
    try:
        view = cache.view()
        assert sorted(view.get_children("/meta/consumers/g/offsets/t")) == sorted(
            f"0-{i}" for i in range(20))
        assert view.get("/meta/consumers/g/offsets/t/0-3")[0] == b"0"
        assert view.exists("/meta/nope") is None
        with pytest.raises(NoNodeError):
            view.get("/meta/nope")
        assert view.get_async("/meta/consumers/g/offsets/t/0-1").get()[0] == b"0"
        before, changes = cache.reads, cache.changes
        for i in range(10):
            zk_client.set(f"/meta/consumers/g/offsets/t/0-{i}", b"%d" % (i + 100))
        wait_until(lambda: all(view.get(f"/meta/consumers/g/offsets/t/0-{i}")[0] ==
                               b"%d" % (i + 100) for i in range(10)), timeout=30,
                   what="the changes in the cache")
        assert cache.reads - before == 10  # one get per changed node
        assert cache.changes - changes == 10
        # a deleted node leaves the copy; polling the view reads nothing
        zk_client.delete("/meta/consumers/g/offsets/t/0-19")
        wait_until(lambda: view.exists("/meta/consumers/g/offsets/t/0-19") is None,
                   timeout=30, what="the deletion in the cache")
        # the deletion fires two watches (the node's, its parent's children): a change
        # made after it is seen only once both were handled (ZooKeeper delivers a
        # session's events in order), and the reads they cost are counted
        zk_client.set("/meta/consumers/g/offsets/t/0-0", b"after")
        wait_until(lambda: view.get("/meta/consumers/g/offsets/t/0-0")[0] == b"after",
                   timeout=30, what="a later change in the cache")
        reads = cache.reads
        for _ in range(50):
            take_snapshot(view, L)
        assert cache.reads == reads
    finally:
        cache.close()


def test_a_missing_root_is_watched_not_created(zk_client):
    cache = ZkTreeCache(zk_client, "/meta")
    cache.start(timeout=30)
    try:
        assert zk_client.exists("/meta") is None  # read-only: TreeCache's ensure_path skipped
        assert take_snapshot(cache.view(), L).exists is False
        zk_client.create("/meta/brokers/ids", makepath=True)
        wait_until(lambda: take_snapshot(cache.view(), L).exists, timeout=30,
                   what="the root seen once created")
    finally:
        cache.close()


@pytest.mark.parametrize("codec, body, used, value, error", [
    ("msgpack", msgpack.packb({"a": [1, b"\x00"]}), "msgpack", {"a": [1, {"$bytes": "00"}]},
     None),
    ("auto", msgpack.packb({"k": 1}), "msgpack", {"k": 1}, None),
    ("auto", b'{"x": [1, 2]}', "json", {"x": [1, 2]}, None),
    ("auto", "héllo".encode(), "text", "héllo", None),
    ("auto", b"\xff\x00\xfe", "hex", "ff00fe", None),
    ("json", b"{nope", "hex", b"{nope".hex(), "not JSON"),
    ("text", b"\xff", "hex", "ff", "not UTF-8"),
    ("msgpack", b"\xc1", "hex", "c1", "not valid msgpack"),
    ("hex", b"ab", "hex", "6162", None),
    ("rot13", b"ab", "hex", "6162", "unknown codec"),
])
def test_bodies_decode_by_codec_and_never_raise(codec, body, used, value, error):
    got = decode_body(body, codec)
    assert got[0] == used and got[1] == value
    assert (got[2] is None) if error is None else error in got[2]
    json.dumps(got[1])  # JSON-ready


def test_pages_escape_what_they_show_and_the_chart_has_a_point_per_sample():
    g = {"group": "g", "status": "ok", "total_lag": 0, "total_lag_messages": 0,
         "max_lag_seconds": 0, "damaged": [{"path": "/x", "error": "<b>bad</b>",
                                            "data_hex": None}],
         "member_states": [{"consumer_id": "g_<img>", "state": "live", "text": "live",
                            "static": False, "instance_id": None, "host": None,
                            "topics": ["t"]}],
         "partitions": [{"topic": "t", "partition": "0-0", "owner": "<script>x</script>",
                         "committed": 1, "msg_id": 2, "log_end": 3, "lag": 2,
                         "lag_messages": 1, "lag_messages_estimated": True,
                         "lag_seconds": 0.5, "state": "lagging", "note": "<i>n</i>",
                         "flagged": False}]}
    points = [{"time_ms": 1000 * k, "lag": k, "lag_messages": k, "lag_seconds": k / 2,
               "status": "ok"} for k in range(5)]
    html = pages.group_page(g, points, token=None)
    assert "<script>x" not in html and "&lt;script&gt;x" in html
    assert "<img>" not in html and "<b>bad" not in html and "<i>n" not in html
    assert html.count('<circle class="point series-messages"') == 5
    assert "reset offsets" not in html  # no token: read-only, no forms
    assert 'name="token" value="tok"' in pages.group_page(g, points, token="tok")
    assert "no sample yet" in pages.lag_svg([])


def test_masters_and_slaves_with_their_replication_state(zk_client):
    from metaq.dashboard import Dashboard
    from zk_layout import ReplicationState, encode_replication_state

    zk_client.create(L.broker_master(3), b"meta://127.0.0.1:7001", makepath=True)
    zk_client.create(L.broker_slave(3, 1), b"meta://127.0.0.1:7002")
    zk_client.create(L.broker_slave(3, 2), b"meta://127.0.0.1:7003")
    zk_client.create(L.replication(3), encode_replication_state(
        ReplicationState(epoch=4, master=0, in_sync=(1,), mode="sync")), makepath=True)
    dash = Dashboard(zk_client, L)
    dash.cache.start(timeout=30)  # the tree alone: no sampler, no broker asked
    try:
        rows = {(r["role"], r["slave_no"]): r for r in dash.brokers()}
        assert set(rows) == {("master", None), ("slave", 1), ("slave", 2)}
        assert rows[("master", None)]["address"] == "127.0.0.1:7001"
        assert rows[("slave", 1)]["in_sync"] is True and not rows[("slave", 1)]["flagged"]
        assert rows[("slave", 2)]["in_sync"] is False and rows[("slave", 2)]["flagged"]
        assert {r["epoch"] for r in rows.values()} == {4}
        assert {r["replication_mode"] for r in rows.values()} == {"sync"}
        html = pages.cluster_page(dash.cluster())
        assert html.count("slave ") >= 2 and "127.0.0.1:7003" in html
    finally:
        dash.close()
